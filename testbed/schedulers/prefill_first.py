"""Whether adaptive spends the running decodes' slack on the waiting prompts by
deferring every decode one iteration: a prefill-only iteration of the whole
queue, then the decodes (adaptive.prefill_first).

A short prompt's TTFT is the rest of the iteration in progress when it
arrives plus the iteration that prefills it. With hundreds of decodes in that
iteration, most of it is theirs: on chat (llama3-8b, h100-sxm) 190 decodes and
two ~77-token prompts take ~14 ms together, the prompts alone ~9.5 ms. Each
decode's next token is due one TBT SLO after its last one, and an iteration of
~14 ms leaves it room for two. So the decodes can wait one iteration and the
prompts get their first tokens ~4.5 ms sooner.

What it costs is a second fixed step cost (the weights read twice): the split
takes longer than the mixed iteration, by d = t_prefill + t_decodes - t_mixed,
and the prompts that arrive meanwhile (at the observed rate lambda, over the
split's t_prefill + t_decodes) each wait d longer. So the decodes are deferred
only when

    k (t_mixed - t_prefill) > lambda (t_prefill + t_decodes) d

for the k waiting prompts, and every decode's next token still meets its
deadline through this iteration and the next (the predictor's bound, as
adaptive plans every iteration). Checked by the caller: no backlog (every
waiting prompt arrived during the last iteration, the whole queue fits this
iteration's seats and max_budget, no prompt is part-prefilled) and no
deferral in the last iteration. The figures: experiments/README.md,
"adaptive".

Pure arithmetic over (new tokens, context after the step) pairs, priced by
adaptive's predictor and its StepCorrection."""
from __future__ import annotations

from typing import Callable

from testbed.schedulers.step_correction import DECODE, MIXED, PREFILL, StepCorrection

Pairs = list[tuple[int, int]]               # (new tokens, context after the step), as the predictor takes them
Predict = Callable[[Pairs, int], float]     # (slices, number sampled) -> raw predicted seconds


def defers_decodes(predict: Predict, correction: StepCorrection, decodes: Pairs, prompts: Pairs,
                   deadline_s: float, arrival_rate_per_s: float) -> bool:
    """Whether a prefill-only iteration of `prompts` (each (tokens, context
    after)) and then one of the decodes (each one token further, with the
    prompts' first decodes) beats scheduling them together: the decodes' next
    token still within `deadline_s` from now (the corrected predictions'
    bounds), and the prompts' gain over the mixed iteration above the delay the
    split's extra time causes the arrivals expected meanwhile (their means)."""
    if not decodes or not prompts:
        return False
    after = [(1, ctx + 1) for _, ctx in decodes] + [(1, ctx + 1) for _, ctx in prompts]
    n_dec, n_pf = len(decodes), len(prompts)
    raw_prefill = predict(prompts, n_pf)
    if correction.bound(raw_prefill, PREFILL) + correction.bound(predict(after, n_dec + n_pf), DECODE) > deadline_s:
        return False
    t_prefill = correction.corrected(raw_prefill, PREFILL)
    t_decodes = correction.corrected(predict(decodes, n_dec), DECODE)
    t_mixed = correction.corrected(predict(decodes + prompts, n_dec + n_pf), MIXED)
    extra_s = t_prefill + t_decodes - t_mixed
    return n_pf * (t_mixed - t_prefill) > arrival_rate_per_s * (t_prefill + t_decodes) * extra_s
