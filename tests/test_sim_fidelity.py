"""`testbed profile` writes a hardware config that Hydra's typed RunConfig
accepts, and with it the simulator predicts the real engine: p50 TTFT and
TBT of a small chat workload on the tiny model within 50%, p99 TBT within
60% (the benchmark, experiments/benchmarks/bench_sim.py, holds the 15%/25%
table; this machine is shared and the profile here is the quick one, so the
test's tolerance is loose)."""
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.config import RunConfig, register_configs
from testbed.model.config import CONF_DIR
from testbed.run import execute
from testbed.sim.config import load_hardware_preset
from testbed.sim.engine_config import load_engine_preset
from testbed.profiling.profile import profile_main

CHAT = ["model=tiny", "workload=chat", "workload.num_requests=24", "workload.rate=4", "wandb.mode=disabled",
        "progress=false"]


def config(*overrides: str, searchpath: str | None = None) -> RunConfig:
    register_configs()
    extra = [f"hydra.searchpath=[file://{searchpath}]"] if searchpath else []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", [*extra, *overrides]))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("conf")
    threads = torch.get_num_threads()
    try:
        assert profile_main(["--quick", "--out", str(root / "hardware" / "cpu_test.yaml")]) == 0
    finally:
        torch.set_num_threads(threads)
    return root


def test_profile_writes_a_preset_that_runtime_sim_loads_through_hydra(profiled):
    path = profiled / "hardware" / "cpu_test.yaml"
    hw = load_hardware_preset(str(path))
    assert hw.name == "cpu_test" and hw.gemm_profile and hw.attention_profile
    engine = load_engine_preset(str(profiled / "engine" / "testbed-cpu_test.yaml"))
    assert engine.profiled_for == "cpu_test" and (engine.overhead_ms > 0 or engine.overhead_per_seq_ms > 0)
    assert hw.calibration_scale > 0
    # the noise table: 101 quantiles (ms) from the fastest to the slowest step, through 0 (the median)
    jitter = hw.step_jitter_ms
    assert len(jitter) == 101 and jitter[0] < 0.0 < jitter[-1] and abs(jitter[50]) < 0.1
    cfg = config("runtime=sim", "hardware=cpu_test", "engine=testbed-cpu_test", *CHAT, searchpath=str(profiled))
    assert cfg.hardware == hw


@pytest.mark.slow      # ~15 s, but a loaded machine stretches the real run, not the sim: off by default
def test_sim_predicts_the_real_engines_p50_ttft_and_tbt(profiled, tmp_path):
    real = execute(config("runtime=real", *CHAT), tmp_path / "real")
    sim = execute(config("runtime=sim", "hardware=cpu_test", "engine=testbed-cpu_test", *CHAT, searchpath=str(profiled)), tmp_path / "sim")
    assert sim["num_finished"] == real["num_finished"] == 24
    for key, q, tolerance in (("ttft_ms", "p50", 0.5), ("tbt_ms", "p50", 0.5), ("tbt_ms", "p99", 0.6)):
        r, s = real[key][q], sim[key][q]
        print(f"{key} {q}: real {r:.1f} ms, sim {s:.1f} ms")
        assert abs(s - r) / r < tolerance, (key, q, r, s)
