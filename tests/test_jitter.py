"""StepJitter: measured step-time noise applied to simulated iterations."""
from __future__ import annotations

import dataclasses
import statistics

import pytest

from testbed.config import RunConfig, WandbConfig
from testbed.runtime.sim import SimRuntime
from testbed.sim.config import load_hardware_preset
from testbed.sim.jitter import StepJitter, jitter_quantiles
from testbed.workloads.build import build_workload
from testbed.workloads.config import WorkloadConfig


def test_quantiles_run_from_min_to_max_through_the_median():
    q = jitter_quantiles([1.0, 0.9, 1.1, 2.0, 1.0], num_quantiles=5)
    assert q == [0.9, 1.0, 1.0, 1.1, 2.0]
    with pytest.raises(ValueError, match="at least 2"):
        jitter_quantiles([1.0])


def test_draws_follow_the_quantiles_and_repeat_with_the_seed():
    quantiles = [0.8, 0.95, 1.0, 1.1, 2.5]
    a, b, c = StepJitter(quantiles, 7), StepJitter(quantiles, 7), StepJitter(quantiles, 8)
    draws = [a() for _ in range(20000)]
    assert draws[:50] == [b() for _ in range(50)] and draws[:50] != [c() for _ in range(50)]
    assert 0.8 <= min(draws) and max(draws) <= 2.5
    assert statistics.median(draws) == pytest.approx(1.0, abs=0.01)
    # a quarter of the mass lies between each pair of quantiles
    assert sum(d > 1.1 for d in draws) / len(draws) == pytest.approx(0.25, abs=0.02)


@pytest.mark.parametrize("bad", [[1.0], [0.0, 1.0], [1.2, 1.0, 1.5]])
def test_hardware_rejects_a_malformed_table(bad):
    base = load_hardware_preset("h100-sxm")
    with pytest.raises(ValueError, match="hardware.step_jitter"):
        dataclasses.replace(base, step_jitter=bad)


def _iterations(step_jitter, seed=0):
    hardware = dataclasses.replace(load_hardware_preset("h100-sxm"), step_jitter=step_jitter)
    workload = WorkloadConfig(name="j", num_requests=12, arrival="poisson", rate=50.0, prompt_dist="fixed",
                              prompt_len=300, output_dist="fixed", output_len=20)
    cfg = RunConfig(runtime="sim", workload=workload, hardware=hardware, seed=seed, wandb=WandbConfig(mode="disabled"),
                    progress=False)
    result = SimRuntime(cfg, log=lambda _: None).run(build_workload(workload, cfg.model.vocab_size, seed))
    assert all(r.status == "finished" for r in result.records)
    return [(it.num_prefill_tokens, it.num_decode_tokens, it.duration_s) for it in result.iterations]


def test_a_simulated_run_with_jitter_is_reproducible_and_spread_around_the_model():
    plain = _iterations([])
    noisy = _iterations([0.5, 1.0, 3.0])
    assert noisy == _iterations([0.5, 1.0, 3.0])
    # the same batches where arrivals do not intervene: compare decode-only steps by shape
    base = {(p, d): t for p, d, t in plain if p == 0}
    ratios = [t / base[(p, d)] for p, d, t in noisy if p == 0 and (p, d) in base]
    assert len(ratios) > 50
    assert min(ratios) < 0.9 and max(ratios) > 1.5
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.25)


def test_gpu_presets_carry_no_jitter():
    for name in ("h100-sxm", "a100-80gb-sxm", "a100-80gb-pcie", "h200"):
        assert load_hardware_preset(name).step_jitter == []
