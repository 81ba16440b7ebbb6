"""StepJitter: measured step-time noise added to simulated iterations."""
from __future__ import annotations

import dataclasses
import itertools
import statistics

import pytest

from testbed.config import RunConfig, RuntimeConfig, WandbConfig
from testbed.runtime.sim import SimRuntime
from testbed.sim.config import load_hardware_preset
from testbed.sim.jitter import StepJitter, jitter_quantiles
from testbed.workloads.build import build_workload
from testbed.workloads.config import WorkloadConfig


def test_quantiles_run_from_min_to_max_through_the_median():
    q = jitter_quantiles([0.0, -0.1, 0.1, 1.0, 0.0], num_quantiles=5, top=1.0)
    assert q == [-0.1, 0.0, 0.0, 0.1, 1.0]
    with pytest.raises(ValueError, match="at least 2"):
        jitter_quantiles([1.0])


def test_one_hiccup_among_thousands_of_steps_does_not_stretch_the_top_percent():
    steps = [i / 1000 for i in range(3000)] + [30.0]          # 0..3 ms, and one 30 ms hiccup
    q = jitter_quantiles(steps)
    assert q[0] == 0.0 and q[50] == pytest.approx(1.5, abs=0.01)
    assert q[99] == pytest.approx(2.97, abs=0.01)
    assert q[100] == pytest.approx(3.0, abs=0.01)            # the 99.9th percentile, not the 30 ms
    assert jitter_quantiles(steps, top=1.0)[100] == 30.0


def test_draws_follow_the_quantiles_in_seconds_and_repeat_with_the_seed():
    quantiles_ms = [-0.2, -0.05, 0.0, 0.1, 1.5]
    a, b, c = StepJitter(quantiles_ms, 7), StepJitter(quantiles_ms, 7), StepJitter(quantiles_ms, 8)
    draws = [a() for _ in range(20000)]
    assert draws[:50] == [b() for _ in range(50)] and draws[:50] != [c() for _ in range(50)]
    assert -0.2e-3 <= min(draws) and max(draws) <= 1.5e-3
    assert statistics.median(draws) == pytest.approx(0.0, abs=0.01e-3)
    # a quarter of the mass lies between each pair of quantiles
    assert sum(d > 0.1e-3 for d in draws) / len(draws) == pytest.approx(0.25, abs=0.02)


@pytest.mark.parametrize("bad", [[1.0], [0.2, -0.1, 1.5]])
def test_hardware_rejects_a_malformed_table(bad):
    base = load_hardware_preset("h100-sxm")
    with pytest.raises(ValueError, match="hardware.step_jitter_ms"):
        dataclasses.replace(base, step_jitter_ms=bad)


def test_a_profile_from_before_the_ms_table_names_the_fix(tmp_path):
    stale = tmp_path / "old.yaml"
    stale.write_text("name: old\npeak_tflops: 1.0\npeak_tflops_fp32: 1.0\nhbm_bw_gbps: 10.0\nmemory_gib: 8.0\n"
                     "step_jitter: [0.8, 1.0, 1.5]\nprofiled_for: old\n")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['step_jitter'\].*rerun `testbed profile`"):
        load_hardware_preset(str(stale))


def _iterations(step_jitter_ms, seed=0):
    hardware = dataclasses.replace(load_hardware_preset("h100-sxm"), step_jitter_ms=step_jitter_ms)
    workload = WorkloadConfig(name="j", num_requests=12, arrival="poisson", rate=50.0, prompt_dist="fixed",
                              prompt_len=300, output_dist="fixed", output_len=20)
    cfg = RunConfig(runtime=RuntimeConfig("sim"), workload=workload, hardware=hardware, seed=seed, wandb=WandbConfig(mode="disabled"),
                    progress=False)
    result = SimRuntime(cfg, log=lambda _: None).run(build_workload(workload, cfg.model.vocab_size, seed))
    assert all(r.status == "finished" for r in result.records)
    return [(it.num_prefill_tokens, it.num_decode_tokens, it.duration_s) for it in result.iterations]


def test_a_simulated_run_with_jitter_is_reproducible_and_spread_around_the_model():
    plain = _iterations([])
    table = [-0.1, 0.0, 0.3]       # ms: tiny's decode steps take ~0.32 ms on h100-sxm
    noisy = _iterations(table)
    assert noisy == _iterations(table)
    # the same batches where arrivals do not intervene: compare decode-only steps by shape
    base = {(p, d): t for p, d, t in plain if p == 0}
    added_ms = [(t - base[(p, d)]) * 1e3 for p, d, t in noisy if p == 0 and (p, d) in base]
    assert len(added_ms) > 50
    assert min(added_ms) < -0.05 and max(added_ms) > 0.15 and min(added_ms) >= -0.1 - 1e-9
    assert statistics.median(added_ms) == pytest.approx(0.0, abs=0.025)


def test_a_deviation_never_takes_a_step_below_half_its_modeled_time():
    plain = _iterations([])
    floored = _iterations([-1e6, -1e6])           # ms: every draw far below zero
    # the same batches until the faster steps meet an arrival at another point
    same = list(itertools.takewhile(lambda pair: pair[0][:2] == pair[1][:2], zip(floored, plain)))
    assert len(same) >= 20
    assert all(t == pytest.approx(base / 2) for (_, _, t), (_, _, base) in same)


def test_gpu_presets_carry_no_jitter():
    for name in ("h100-sxm", "a100-80gb-sxm", "a100-80gb-pcie", "h200"):
        assert load_hardware_preset(name).step_jitter_ms == []
