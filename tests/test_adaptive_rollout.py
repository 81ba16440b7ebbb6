"""adaptive's TTFT rollout (testbed/schedulers/ttft_rollout.py): the summed
TTFT of a queue by hand, the prompt that would push the batch over a tile
step deferred (on the engine, with the rollout off and without the step as
controls), a long queue keeping the deadline budget that a short one
would split, and a backlog keeping it even where the sum alone would not."""
from __future__ import annotations

import pytest

from testbed.block_manager import BlockManager
from testbed.engine import Engine, VirtualClock
from testbed.request import Request
from testbed.schedulers import SchedulerConfig, SchedulerContext, make_scheduler
from testbed.schedulers.adaptive_config import AdaptiveConfig
from testbed.schedulers.ttft_rollout import summed_ttft_s, take, ttft_minimising_budget
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
                          adaptive=AdaptiveConfig(**adaptive))
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
