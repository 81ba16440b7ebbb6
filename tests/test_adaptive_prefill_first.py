"""adaptive.prefill_first (testbed/schedulers/prefill_first.py): the decodes'
slack spent on fresh prompts. The rule in closed form under a linear
predictor (the deadline, the gain against the arrivals' delay); on the
engine, a prompt-only iteration then the decodes, never twice in a row, not
with a backlog, past a deadline or when switched off; every token gap within
the TBT SLO over a random workload with deferrals; and the same tokens as
sarathi on the real engine (tiny, fp32) with prompts arriving while others
decode."""
from __future__ import annotations

import random

import pytest
import torch

from testbed.block_manager import BlockManager
from testbed.engine import Engine, VirtualClock, WallClock
from testbed.model.config import load_model_preset
from testbed.request import Request
from testbed.schedulers import SchedulerConfig, SchedulerContext, make_scheduler
from testbed.schedulers.adaptive_config import AdaptiveConfig
from testbed.schedulers.prefill_first import defers_decodes
from testbed.schedulers.step_correction import StepCorrection

from test_adaptive import LinearPredictor, engine

LINEAR = LinearPredictor(base_s=0.005, per_token_s=1e-5)


DECODES = [(1, 200)] * 100
PROMPTS = [(64, 64), (64, 64)]


def test_rule_in_closed_form():
    """Prompts alone 6.28 ms, then the 102 decodes 6.02 ms; mixed 7.28 ms.
    The 2 prompts gain 1.00 ms each; the split (6.28 + 6.00 ms for the 100
    decodes) is 5.00 ms longer, which the arrivals over its 12.28 ms pay: at
    lambda 2 ms / (12.28 ms x 5 ms) = 32.57 req/s the two are equal."""
    def defers(deadline_s=0.05, rate=0.0, decodes=DECODES, prompts=PROMPTS):
        return defers_decodes(LINEAR.iteration_time_s, StepCorrection(0.2), decodes, prompts, deadline_s, rate)
    assert defers(rate=0.0) and defers(rate=32.5)
    assert not defers(rate=32.6)
    assert defers(deadline_s=0.01231) and not defers(deadline_s=0.01229)     # 6.28 + 6.02 ms
    assert not defers(decodes=[]) and not defers(prompts=[])


def _engine(**adaptive) -> tuple[Engine, VirtualClock]:
    """100 requests arriving 50 ms apart (the observed rate, ~20 req/s, is
    under the 32.57 of test_rule_in_closed_form), prefilled: 100 decodes, each
    sampled its last token at the last step's end."""
    e = engine(LINEAR, max_num_seqs=128, **adaptive)
    clock, sched = e.clock, e.scheduler
    for i in range(100):
        clock.t = 0.05 * i
        e.add_request(Request(f"d{i}", list(range(100 * i, 100 * i + 8)), 50, arrival_s=clock.t))
    while sched.waiting:
        e.step()
    assert len(sched.running) == 100 and sched.num_deferrals == 0
    return e, clock


def _arrive(e: Engine, clock: VirtualClock, *names: str, at: float | None = None) -> None:
    for name in names:                           # p<k>: 64 tokens of its own (no prefix shared)
        k = int(name[1:]) + 1
        e.add_request(Request(name, list(range(10_000 * k, 10_000 * k + 64)), 4,
                              arrival_s=clock.now() if at is None else at))


def test_fresh_prompts_run_alone_then_the_decodes_never_twice_in_a_row():
    e, clock = _engine()
    _arrive(e, clock, "p0", "p1")
    out = e.step()
    assert (out.iteration.num_prefill_tokens, out.iteration.num_decode_tokens) == (128, 0)
    assert e.scheduler.num_deferrals == 1
    _arrive(e, clock, "p2")                      # fresh too, but the decodes waited one iteration already
    out = e.step()
    assert (out.iteration.num_prefill_tokens, out.iteration.num_decode_tokens) == (64, 102)
    assert e.scheduler.num_deferrals == 1


@pytest.mark.parametrize("case", ["switched off", "backlog", "deadline"])
def test_decodes_run_with_the_prompts(case):
    e, clock = _engine(prefill_first=case != "switched off")
    if case == "backlog":                        # p0 waited through the last iteration
        _arrive(e, clock, "p0", "p1", at=clock.now() - 0.02)
    elif case == "deadline":                     # the decodes' tokens are older: 12.30 ms no longer fits
        clock.t += 0.038
        _arrive(e, clock, "p0", "p1")
    else:
        _arrive(e, clock, "p0", "p1")
    out = e.step()
    assert (out.iteration.num_prefill_tokens, out.iteration.num_decode_tokens) == (128, 100)
    assert e.scheduler.num_deferrals == 0


@pytest.mark.parametrize("seed", range(3))
def test_token_gaps_stay_within_the_slo_with_deferrals(seed):
    """Poisson arrivals of short prompts onto running decodes, on a
    predictor whose step cost is mostly per token (1 ms + 0.1 ms a token), so
    that deferring pays often; it is exact, so every gap between a request's
    tokens is within the 50 ms TBT SLO, deferred iterations included."""
    rng = random.Random(seed)
    e = engine(LinearPredictor(base_s=0.001, per_token_s=1e-4), num_blocks=8192, max_num_seqs=128)
    clock, sched = e.clock, e.scheduler
    t, pending = 0.0, []
    for i in range(300):
        t += rng.expovariate(40.0)
        pending.append(Request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(16, 200))],
                               rng.randint(20, 80), arrival_s=t))
    deferred_in_a_row, reqs = [], list(pending)
    while pending or e.has_work():
        if not e.has_work():
            clock.t = max(clock.t, pending[0].arrival_s)
        while pending and pending[0].arrival_s <= clock.t:
            e.add_request(pending.pop(0))
        before = sched.num_deferrals
        e.step()
        deferred_in_a_row.append(sched.num_deferrals > before)
    assert e.bm.all_free()
    assert sched.num_deferrals >= 10
    assert not any(a and b for a, b in zip(deferred_in_a_row, deferred_in_a_row[1:]))
    gaps = [b - a for r in reqs for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    assert max(gaps) <= 0.05


WORKLOAD = [(23, 6), (50, 12), (9, 8), (70, 5), (33, 7), (300, 5), (140, 9), (12, 10)]   # (prompt_len, max_tokens)


def _real_tokens(scheduler: str) -> tuple[dict[str, list[int]], int]:
    """The tiny model on the CPU; request i arrives before step 2i, so prompts
    come while others decode. adaptive plans with a base-free linear
    predictor, uncorrected (ewma_alpha ~0) and a TBT SLO of 1,000 s: the split
    costs nothing more than the mixed step, so every fresh queue is deferred
    for (its outputs must not change)."""
    from testbed.model_executor import ModelExecutor
    torch.set_num_threads(1)
    model = load_model_preset("tiny")
    bm = BlockManager(256, 16)
    clock = WallClock()
    ctx = SchedulerContext(clock, 2000.0, 1e6, LinearPredictor(base_s=0.0, per_token_s=1e-5))
    adaptive = AdaptiveConfig(min_budget=16, budget_multiple=16, ewma_alpha=1e-9)
    sched = make_scheduler(scheduler, SchedulerConfig(32, 16, 4096, adaptive), bm,
                           ctx if scheduler == "adaptive" else None)
    e = Engine(sched, ModelExecutor(model, 256, 16, bm.block_table), clock)
    reqs = [Request(f"r{i}", torch.randint(0, model.vocab_size, (n,), generator=torch.Generator().manual_seed(100 + i))
                    .tolist(), m) for i, (n, m) in enumerate(WORKLOAD)]
    step = 0
    while step < 2 * len(reqs) or e.has_work():
        if step % 2 == 0 and step // 2 < len(reqs):
            r = reqs[step // 2]
            r.arrival_s = clock.now()
            e.add_request(r)
        if e.has_work():
            e.step()
        step += 1
    assert bm.all_free()
    return {r.request_id: r.output_token_ids for r in reqs}, getattr(sched, "num_deferrals", 0)


def test_real_engine_same_tokens_as_sarathi_with_deferrals():
    tokens, deferrals = _real_tokens("adaptive")
    assert deferrals >= 3
    assert tokens == _real_tokens("sarathi")[0]
