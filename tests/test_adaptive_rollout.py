"""adaptive's TTFT rollout (testbed/schedulers/ttft_rollout.py): the summed
TTFT of a queue by hand, the prompt that would push the batch over a tile
step deferred (on the engine, with the rollout off and without the step as
controls), a long queue keeping the deadline budget that a short one
would split, a backlog keeping it even where the sum alone would not, and
the prompts arriving meanwhile (their rate and the typical iteration
observed online) deferring a prompt past a tile step that the waiting
prompts alone would take."""
from __future__ import annotations

import pytest

from testbed.block_manager import BlockManager
from testbed.engine import Engine, VirtualClock
from testbed.request import Request
from testbed.schedulers import SchedulerConfig, SchedulerContext, make_scheduler
from testbed.schedulers.adaptive_config import AdaptiveConfig
from testbed.schedulers.traffic import Traffic
from testbed.schedulers.ttft_rollout import arrivals_wait_s, summed_ttft_s, take, ttft_minimising_budget
from tests.test_adaptive import PredictedExecutor


class TilePredictor:
    """5 ms + 1 µs per token, plus `step_s` once the batch holds more than
    512 tokens (a GEMM tile step)."""
    def __init__(self, step_s: float):
        self.step_s = step_s

    def iteration_time_s(self, slices, num_sampled=None) -> float:
        m = sum(q for q, _ in slices)
        return 0.005 + 1e-6 * m + (self.step_s if m > 512 else 0.0)


def linear(pairs, sampled) -> float:
    return 0.005 + 1e-5 * sum(q for q, _ in pairs)          # 5 ms + 10 µs per token


def test_take_cuts_chunks_as_sarathi_does():
    todo = [(100, 0), (300, 20), (50, 0)]
    assert take(todo, (0, 0), 128, 64) == ([(100, 100)], [100], (1, 0))          # 28 left < 64: p1 waits
    assert take(todo, (1, 0), 128, 64) == ([(128, 148)], [], (1, 128))
    assert take(todo, (1, 256), 128, 64) == ([(44, 320), (50, 50)], [320, 50], (3, 0))


def test_summed_ttft_by_hand():
    todo = [(1000, 0), (1000, 0)]
    # one prompt per iteration: 15 ms, then 15.01 ms (the first prompt decodes beside the second)
    assert summed_ttft_s(linear, [], todo, 1024, 2048, 64) == pytest.approx(0.015 + 0.015 + 0.01501)
    assert summed_ttft_s(linear, [], todo, 2048, 2048, 64) == pytest.approx(2 * 0.025)
    # a short queue: one prompt at a time is cheaper in sum (45 against 50 ms)...
    assert ttft_minimising_budget(linear, [], todo, 2048, 64, 64, 64) == 1024
    # ...a long one pays a fixed cost per later prompt for it (1,050 against ~1,080 ms; also a backlog)
    long_queue = todo + [(1000, 0)] * 10
    assert summed_ttft_s(linear, [], long_queue, 2048, 2048, 64) < summed_ttft_s(linear, [], long_queue, 1024,
                                                                                  2048, 64)
    assert ttft_minimising_budget(linear, [], long_queue, 2048, 64, 64, 64) == 2048


def _first_batch_after_decodes(predictor, **adaptive) -> list[tuple[str, int]]:
    """60 decodes running (8-token prompts, 480 tokens: under the step), then
    8 prompts of 64 tokens arrive: the prefill slices of the next iteration.
    With the step: all 8 (572 tokens) cost 8 x 9.57 = 76.6 ms of summed TTFT;
    7 now (508, 5.51 ms) and the 8th in the next iteration (67 decodes + 64:
    5.13 ms) 7 x 5.51 + 10.64 = 49.2 ms; 6 now 53.9 ms. Without the step all
    8 are cheapest (8 x 5.57 = 44.6 against 49.2)."""
    clock = VirtualClock()
    cfg = SchedulerConfig(token_budget=256, max_num_seqs=128, max_num_batched_tokens=8192,
                          settings=AdaptiveConfig(**adaptive))
    sched = make_scheduler("adaptive", cfg, BlockManager(4096, 16), SchedulerContext(clock, 2000.0, 50.0, predictor))
    e = Engine(sched, PredictedExecutor(predictor), clock)
    for i in range(60):
        e.add_request(Request(f"d{i}", list(range(100 * i, 100 * i + 8)), 50))
    e.step()
    assert all(r.num_computed_tokens == 8 for r in sched.running)
    for i in range(8):
        e.add_request(Request(f"p{i}", list(range(10_000 + 100 * i, 10_000 + 100 * i + 64)), 4))
    e.step()
    return e.executor.batches[-1]


def test_rollout_defers_the_prompt_that_would_cross_a_tile_step():
    assert _first_batch_after_decodes(TilePredictor(0.004)) == [(f"p{i}", 64) for i in range(7)]
    assert _first_batch_after_decodes(TilePredictor(0.004), ttft_rollout=False) == [(f"p{i}", 64) for i in range(8)]
    assert _first_batch_after_decodes(TilePredictor(0.0)) == [(f"p{i}", 64) for i in range(8)]


def _tile_price(pairs, sampled) -> float:
    return TilePredictor(0.004).iteration_time_s(pairs, sampled)


def test_a_backlog_keeps_the_deadline_budget_even_where_the_sum_would_split():
    decodes = [(1, 9)] * 60
    short = [(64, 0)] * 8                 # 8 x 64 under B = 576: all of them would cross the step
    assert ttft_minimising_budget(_tile_price, decodes, short, 576, 64, 64, 64) == 448
    backlog = [(64, 0)] * 20              # two iterations of 576 leave 64 tokens: a backlog
    assert summed_ttft_s(_tile_price, decodes, backlog, 448, 576, 64) < \
        summed_ttft_s(_tile_price, decodes, backlog, 576, 576, 64)        # the sum alone would split...
    assert ttft_minimising_budget(_tile_price, decodes, backlog, 576, 64, 64, 64) == 576    # ...the backlog keeps B


def test_arrivals_wait_by_hand():
    # arrivals in the 10 ms iteration wait 5 ms of it, then the 4 ms one; in the 4 ms one 2 ms, then tau = 6 ms:
    # 50 + 40 + 8 + 24 (ms^2), less 1.5 x 6 ms over the 14 ms horizon (126)
    assert arrivals_wait_s([0.010, 0.004], 0.006) == pytest.approx((50 + 40 + 8 + 24 - 126) * 1e-6)
    # one iteration cut in two of the same total costs the arrivals the same, but for the next one's length
    assert arrivals_wait_s([0.006, 0.008], 0.006) - arrivals_wait_s([0.010, 0.004], 0.006) == pytest.approx(
        0.006 * (0.008 - 0.004))


def _step_2ms(pairs, sampled) -> float:
    return TilePredictor(0.002).iteration_time_s(pairs, sampled)


def test_arrivals_defer_the_prompt_that_would_cross_a_tile_step():
    """60 decodes and prompts of 400 and 100 tokens, B = 576, a 2 ms step past
    512 tokens. Both now (560 tokens): 7.56 ms, then 5.062 (62 decodes): the
    waiting prompts sum 15.12 ms; the 400 alone (P = 448): 5.46 then 5.161,
    sum 16.081: B by 0.96 ms. The arrivals meanwhile, with tau = 5 ms
    (arrivals_wait_s): B 28.577 + 38.269 + 12.812 + 25.31 - 94.665 = 10.302
    ms^2, P 14.906 + 28.179 + 13.318 + 25.805 - 79.658 = 2.550 ms^2: at 200
    req/s 2.061 against 0.510 ms, which outweighs the 0.96 (P); at 100 req/s
    0.775 does not (B)."""
    decodes, todo = [(1, 9)] * 60, [(400, 0), (100, 0)]
    assert summed_ttft_s(_step_2ms, decodes, todo, 576, 576, 64) == pytest.approx(0.01512)
    assert summed_ttft_s(_step_2ms, decodes, todo, 448, 576, 64) == pytest.approx(0.016081)
    assert summed_ttft_s(_step_2ms, decodes, todo, 576, 576, 64, 200.0, 0.005) == pytest.approx(
        0.01512 + 0.2 * 0.0103024, abs=1e-8)
    assert summed_ttft_s(_step_2ms, decodes, todo, 448, 576, 64, 200.0, 0.005) == pytest.approx(
        0.016081 + 0.2 * 0.0025503, abs=1e-8)
    assert ttft_minimising_budget(_step_2ms, decodes, todo, 576, 64, 64, 64) == 576
    assert ttft_minimising_budget(_step_2ms, decodes, todo, 576, 64, 64, 64, 200.0, 0.005) == 448
    assert ttft_minimising_budget(_step_2ms, decodes, todo, 576, 64, 64, 64, 100.0, 0.005) == 576


def test_traffic_rate_and_typical_step_over_the_window():
    t = Traffic(3)
    assert t.rate_per_s(1.0) == 0.0 and t.typical_step_s() == 0.0
    for a in (0.00, 0.01, 0.02, 0.03):
        t.observe_arrival(a)
    assert t.rate_per_s(0.03) == pytest.approx(2 / 0.02)      # the window: 0.01, 0.02, 0.03
    assert t.rate_per_s(0.11) == pytest.approx(2 / 0.10)      # no arrival since: the rate decays
    for d in (0.001, 0.002, 0.003, 0.004):
        t.observe_step(d)
    assert t.typical_step_s() == pytest.approx(0.003)


def _batch_after_arrivals(**adaptive) -> list[tuple[str, int]]:
    """The engine's arrival-aware rollout: 60 decodes arrive at t = 0 and
    prefill in one 5.48 ms step (480 tokens, under the step); then prompts of
    400 and 100 tokens arrive. Observed: 62 arrivals over 5.48 ms (61 / 5.48 ms
    = 11,131 req/s) and one step of 5.48 ms (tau). B = max_budget (everything
    fits the 50 ms deadline); the waiting prompts alone take both (as in
    test_arrivals_defer_the_prompt_that_would_cross_a_tile_step: 15.12 against
    16.081 ms); with the arrivals B costs 3.648 ms^2 x 11.131/ms = 40.6 ms and
    P = 448 -2.617 ms^2 (-29.1 ms): only the 400 goes now (the 100's 48
    tokens left are under min_budget)."""
    clock = VirtualClock()
    cfg = SchedulerConfig(token_budget=256, max_num_seqs=128, max_num_batched_tokens=8192,
                          settings=AdaptiveConfig(prefill_first=False, **adaptive))    # the rollout alone
    predictor = TilePredictor(0.002)
    sched = make_scheduler("adaptive", cfg, BlockManager(4096, 16), SchedulerContext(clock, 2000.0, 50.0, predictor))
    e = Engine(sched, PredictedExecutor(predictor), clock)
    for i in range(60):
        e.add_request(Request(f"d{i}", list(range(100 * i, 100 * i + 8)), 50))
    e.step()
    assert clock.now() == pytest.approx(0.00548)
    observed = adaptive.get("rollout_arrivals", False)
    assert (sched.traffic is not None) == observed            # the traffic is observed only when used
    if observed:
        assert sched.traffic.typical_step_s() == pytest.approx(0.00548)
    e.add_request(Request("p0", list(range(10_000, 10_400)), 4))
    e.add_request(Request("p1", list(range(20_000, 20_100)), 4))
    if observed:
        assert sched.traffic.rate_per_s(clock.now()) == pytest.approx(61 / 0.00548)
    e.step()
    return e.executor.batches[-1]


def test_engine_rollout_defers_past_a_tile_step_for_the_arrivals():
    assert _batch_after_arrivals(rollout_arrivals=True) == [("p0", 400)]
    assert _batch_after_arrivals(rollout_arrivals=False) == [("p0", 400), ("p1", 100)]
