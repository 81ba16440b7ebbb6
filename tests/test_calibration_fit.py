"""The overhead fit: four non-negative terms over steps stepped alone and served."""
from __future__ import annotations

import pytest

from testbed.profiling.calibration import _fit

TRUE = dict(a=1.5, b=0.1, c=0.02, k=0.9)          # ms, ms/seq, ms/token, scale


def _row(seqs: int, tokens: int, modeled_ms: float, count: int = 8, **terms):
    t = {**TRUE, **terms}
    wall_ms = t["a"] + t["b"] * seqs + t["c"] * tokens + t["k"] * modeled_ms
    return (seqs, tokens, wall_ms / 1e3, modeled_ms / 1e3, count)


SHAPES = [(1, 1, 1.2), (8, 8, 3.0), (32, 32, 7.5), (1, 256, 20.0), (1, 2048, 300.0), (4, 67, 8.0), (16, 16, 5.1)]
SERVED = [(1, 1, 1.25), (2, 2, 1.9), (1, 300, 24.0), (3, 120, 11.0), (2, 1800, 260.0)]


def _terms(fit):
    return fit.overhead_ms, fit.overhead_per_seq_ms, fit.overhead_per_token_ms, fit.calibration_scale


def test_both_kinds_of_rows_give_back_the_four_terms():
    fit = _fit([_row(*s) for s in SHAPES], [_row(*s, count=400) for s in SERVED])
    assert _terms(fit) == pytest.approx(tuple(TRUE.values()), rel=1e-6)
    seqs, tokens, wall, modeled, _ = _row(*SERVED[-1])
    assert fit.predict_ms(seqs, tokens, modeled) == pytest.approx(wall * 1e3, rel=1e-6)


def test_a_term_the_steps_do_not_show_comes_out_zero_not_negative():
    fit = _fit([_row(*s, b=0.0) for s in SHAPES], [])
    assert fit.overhead_per_seq_ms == pytest.approx(0.0, abs=1e-9)
    assert _terms(fit) == pytest.approx((TRUE["a"], 0.0, TRUE["c"], TRUE["k"]), rel=1e-6, abs=1e-9)
    # steps that would need a negative per-sequence term get none, and the rest still >= 0
    fit = _fit([_row(*s, b=-0.05) for s in SHAPES], [])
    assert min(_terms(fit)) >= 0.0


def test_one_vote_per_shape_however_many_steps_it_had():
    served = [_row(*s) for s in SERVED]
    # the 1-decode shape 25% slow: repeated 600 times or once, it weighs the same
    once = [(*served[0][:2], served[0][2] * 1.25, *served[0][3:4], 1)] + served[1:]
    many = [(*served[0][:2], served[0][2] * 1.25, *served[0][3:4], 600)] + served[1:]
    alone = [_row(*s) for s in SHAPES]
    assert _terms(_fit(alone, once)) == pytest.approx(_terms(_fit(alone, many)), rel=1e-12)


def test_serving_runs_merge_into_one_pool_of_steps_with_each_runs_own_deviations():
    from testbed.profiling.calibration import ServingRun
    fast = ServingRun([([(1, 100)], 0.003)] * 3, [-0.1, 0.0, 0.1], hop_ms=0.2)
    slow = ServingRun([([(1, 100)], 0.005)] * 2, [-0.4, 0.4], hop_ms=0.4)
    odd = ServingRun([([(64, 64)], 0.020)], [0.0], hop_ms=0.3)
    merged = ServingRun.merge([fast, slow, odd])
    assert [secs for _, secs in merged.steps] == [0.003] * 3 + [0.005] * 2 + [0.020]
    # deviations are each run's own: the 2 ms between the runs' medians is not step noise
    assert merged.step_deviations_ms == [-0.1, 0.0, 0.1, -0.4, 0.4, 0.0]
    assert merged.hop_ms == 0.3
