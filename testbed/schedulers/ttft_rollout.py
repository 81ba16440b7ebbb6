"""The prefill budget that minimises the waiting prompts' summed time to first
token, by a one-step rollout of adaptive's deadline policy.

The deadline policy (adaptive.py) takes the largest budget B the decodes' token
deadlines allow. That is not the TTFT-minimising choice when several prompts
wait: every prompt in an iteration waits for the whole iteration, so one more
prompt that pushes the batch over a GEMM tile step (the fixed cost of the
step, measured on the GPU tables) delays all the others by it, while deferring
it costs that one prompt one more (short) iteration. So each candidate budget
P <= B (B itself, and each prompt boundary of the FCFS queue rounded up to
adaptive.budget_multiple: whole prompts, never a new chunk, and always the
oldest prompt, so nothing starves) is priced by the predictor as the
rollout "this iteration takes P, every later one takes B": the sum over the
waiting prompts of the predicted time until each samples its first token. The
cheapest wins; ties keep B. Only when there is no backlog: if two
iterations of B would not drain the queue, B stays, because the capacity a
smaller P leaves unused is paid by every prompt behind, including those not
arrived yet (without this rule, azure_code's p99 TTFT near capacity rose
5-15%: experiments/README.md, "adaptive"). Iterations after the second
(when a smaller P leaves some) are priced as the second.

With adaptive.rollout_arrivals, the prompts that arrive while the rollout
runs are priced too (arrivals_wait_s), at the arrival rate lambda observed: one
arriving in iteration j waits out the rest of it and then the next, which
serves it, so iteration j costs lambda (t_j^2/2 + t_j t_(j+1)); the
candidates' horizons are made equal by filling the shorter one with typical
iterations tau (each lambda 1.5 tau^2, the same sum with t = tau). A batch
that passes a tile step lengthens the horizon, and so costs every arrival in
it, which the waiting prompts' sum alone cannot see. (Charging only each
iteration's residual, lambda t^2 / 2, rewards cutting an iteration in two,
though its arrivals then wait for the second: worse on chat.)

Pure arithmetic over (remaining tokens, computed tokens) pairs and a price
function; adaptive.py builds both."""
from __future__ import annotations

import math
from typing import Callable, Sequence

Pairs = list[tuple[int, int]]          # (new tokens, context after the step), as the predictor takes them
Price = Callable[[Pairs, int], float]  # (slices, number sampled) -> predicted seconds


def take(todo: Sequence[tuple[int, int]], pos: tuple[int, int], budget: int,
         min_chunk: int) -> tuple[Pairs, list[int], tuple[int, int]]:
    """One iteration's FCFS chunks of `todo` ((remaining, computed) per prompt)
    from pos = (prompt index, tokens of it already taken), as sarathi's
    _schedule_prefills cuts them: the slices, the prompt lengths that finish,
    and the position after."""
    i, done = pos
    pairs, finished = [], []
    while i < len(todo) and budget > 0:
        remaining, computed = todo[i]
        left = remaining - done
        if budget < min(min_chunk, left):
            break
        n = min(left, budget)
        pairs.append((n, computed + done + n))
        budget -= n
        if n == left:
            finished.append(computed + remaining)
            i, done = i + 1, 0
        else:
            done += n
    return pairs, finished, (i, done)


def arrivals_wait_s(durations: Sequence[float], typical_s: float) -> float:
    """The summed TTFT, per unit of arrival rate, of the prompts arriving
    during iterations of `durations` (each served by the next, the one after
    the last taking `typical_s`), less what typical iterations would cost over
    the same time (1.5 typical_s per second), so that rollouts of different
    lengths compare over one horizon."""
    nexts = list(durations[1:]) + [typical_s]
    return sum(t * t / 2 + t * n for t, n in zip(durations, nexts)) - 1.5 * typical_s * sum(durations)


def summed_ttft_s(price: Price, decodes: Pairs, todo: Sequence[tuple[int, int]], first: int, then: int,
                  min_chunk: int, arrival_rate_per_s: float = 0.0, typical_s: float = 0.0) -> float:
    """Predicted sum over `todo`'s prompts of the time until each samples its
    first token, when this iteration schedules `first` prefill tokens and each
    later one `then` (with the same decodes, and the prompts finished so far
    decoding); plus, at `arrival_rate_per_s`, that of the prompts arriving
    meanwhile (arrivals_wait_s)."""
    pairs1, fin1, pos = take(todo, (0, 0), first, min_chunk)
    t1 = price(decodes + pairs1, len(decodes) + len(fin1))
    decodes2 = decodes + [(1, n + 1) for n in fin1]
    pairs2, fin2, pos = take(todo, pos, then, min_chunk)
    t2 = price(decodes2 + pairs2, len(decodes2) + len(fin2))
    total = len(fin1) * t1 + len(fin2) * (t1 + t2)
    i, done = pos
    streamed = -done                      # prompt tokens after the second iteration, to each prompt's end
    for remaining, _ in todo[i:]:
        streamed += remaining
        total += t1 + t2 + math.ceil(streamed / then) * t2
    if arrival_rate_per_s:
        later = math.ceil(streamed / then) if streamed > 0 else 0
        total += arrival_rate_per_s * arrivals_wait_s([t1, t2] + [t2] * later, typical_s)
    return total


def ttft_minimising_budget(price: Price, decodes: Pairs, todo: Sequence[tuple[int, int]], budget: int,
                           min_chunk: int, min_budget: int, multiple: int, arrival_rate_per_s: float = 0.0,
                           typical_s: float = 0.0) -> int:
    """The candidate P in [min_budget, budget] with the least summed TTFT
    (summed_ttft_s, later iterations at `budget`, arrivals at
    `arrival_rate_per_s`); `budget` on ties, and
    whenever two iterations of `budget` would not drain the queue (a backlog:
    the capacity a smaller P leaves unused is then paid by every prompt
    behind, the ones still to arrive included, which the sum cannot see)."""
    _, _, pos = take(todo, (0, 0), budget, min_chunk)
    if take(todo, pos, budget, min_chunk)[2][0] < len(todo):
        return budget
    candidates, cum = [], 0
    for remaining, _ in todo:
        cum += remaining
        p = max(min_budget, -(-cum // multiple) * multiple)
        if p >= budget:
            break
        if not candidates or p > candidates[-1]:
            candidates.append(p)
    if not candidates:
        return budget
    arrivals = (arrival_rate_per_s, typical_s)
    best, best_s = budget, summed_ttft_s(price, decodes, todo, budget, budget, min_chunk, *arrivals)
    for p in reversed(candidates):
        s = summed_ttft_s(price, decodes, todo, p, budget, min_chunk, *arrivals)
        if s < best_s - 1e-9 * abs(best_s):      # the arrivals' term may make a sum negative
            best, best_s = p, s
    return best

