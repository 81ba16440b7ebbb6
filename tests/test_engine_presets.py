"""Engine presets (testbed/sim/engine_config.py): the engine a run gets by
default, the terms that moved from the hardware, CUDA graph padding, host
overlap, and engine=vllm-v0's host time against the rows it was fitted to."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


from testbed.config import RunConfig
from testbed.model.config import load_model_preset
from testbed.sim.config import load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.engine_config import EngineConfig, engine_preset_names, load_engine_preset, resolve_engine
from testbed.sim.vllm_v0_fit import fit_rows, fitted_host_model, read_host_rows

from test_cli_override_errors import run_cli  # noqa: E402


def test_auto_is_testbed_on_the_cpu_and_vllm_v1_on_a_gpu():
    cpu, h100 = load_hardware_preset("cpu"), load_hardware_preset("h100-sxm")
    assert resolve_engine(None, cpu).name == "testbed"
    assert resolve_engine(None, load_hardware_preset("cpu-2w")).name == "testbed-cpu-2w"
    assert resolve_engine(EngineConfig(), h100).name == "vllm-v1"
    cfg = RunConfig()
    assert cfg.run_engine().name == "testbed" and cfg.token_budget == 256
    assert {"testbed", "vllm-v0", "vllm-v1"} <= set(engine_preset_names())


def test_the_cpus_measured_host_terms_stay_on_the_cpu():
    testbed = load_engine_preset("testbed")
    on_cpu = testbed.for_hardware("cpu")
    assert (on_cpu.overhead_ms, on_cpu.kernel_launch_us) == (testbed.overhead_ms, 0.0)    # launches inside
    on_gpu = testbed.for_hardware("h100-sxm")
    assert (on_gpu.overhead_ms, on_gpu.overhead_per_seq_ms, on_gpu.kernel_launch_us) == (0.0, 0.0, 5.0)


@pytest.mark.parametrize("field,new", [("overhead_ms", "engine.overhead_ms"),
                                       ("cuda_graph_max_tokens", "engine.cuda_graph_sizes"),
                                       ("token_budget_default", "engine.token_budget")])
def test_an_old_hardware_engine_term_names_its_new_field(field, new, tmp_path):
    code, lines, ran = run_cli(f"hardware.{field}=1")
    assert code != 0 and not ran and len(lines) == 1
    assert lines[0] == (f"error: hardware.{field}: the engine's term now lives in the engine preset; set {new} "
                        "(conf/engine/, engine=testbed|vllm-v0|vllm-v1) instead")
    raw = yaml.safe_load((Path(__file__).parents[1] / "conf/hardware/h100-sxm.yaml").read_text())
    (tmp_path / "old.yaml").write_text(yaml.safe_dump({**raw, field: 1}))
    with pytest.raises(ValueError, match=f"hardware.{field}: .* set {new} "):
        load_hardware_preset(str(tmp_path / "old.yaml"))


def test_cuda_graphs_pad_to_the_captured_size_and_overlapped_host_shows_only_past_the_gpu():
    model, hw = load_model_preset("llama2-7b"), load_hardware_preset("h100-sxm")
    base = EngineConfig(name="g", cuda_graphs=True, cuda_graph_sizes=[8, 16], cuda_graph_mixed=True)
    cost = CostModel(model, hw, engine=base)
    assert cost.breakdown([(1, 512)] * 9)["gemm_s"] == cost.breakdown([(1, 512)] * 16)["gemm_s"]
    assert cost.breakdown([(12, 512)])["gemm_s"] == cost.breakdown([(16, 512)])["gemm_s"]     # a chunk too
    kernels = cost.iteration_time_s([(1, 512)] * 8)
    for host_ms in (0.1 * kernels * 1e3, 2 * kernels * 1e3):
        serial = CostModel(model, hw, engine=EngineConfig(**{**base.__dict__, "overhead_ms": host_ms}))
        overlapped = CostModel(model, hw, engine=EngineConfig(**{**base.__dict__, "overhead_ms": host_ms,
                                                                 "host_overlap": True}))
        assert serial.iteration_time_s([(1, 512)] * 8) == pytest.approx(kernels + host_ms * 1e-3, rel=1e-12)
        assert overlapped.iteration_time_s([(1, 512)] * 8) == pytest.approx(max(kernels, host_ms * 1e-3),
                                                                            rel=1e-12)
        price = overlapped.decode_pricer(8)
        assert price(8 * 512, 512) == overlapped.iteration_time_s([(1, 512)] * 8)


# -- engine=vllm-v0: host time fitted to Vidur's cpu_overheads rows -----------------------------

def _relative_errors(fit, rows):
    return [fit.host_ms(r.batch_size, r.tp) / r.host_ms - 1 for r in rows]


def test_vllm_v0_host_time_within_10_percent_of_every_row_in_sample(data_dir):
    rows = read_host_rows(data_dir / "vidur-profiles" / "cpu_overheads" / "a100.csv")
    assert len(rows) == 76         # 78 rows, two (Qwen-72B at 112 and 128) ran a smaller batch
    fit = fitted_host_model()
    assert max(abs(e) for e in _relative_errors(fit, rows)) < 0.10
    # the cache holds the same fit, keyed by the CSV's checksum
    (cached,) = (data_dir / "derived" / "vidur-profiles" / "vllm-v0-host-a100").glob("*/fit.json")
    assert json.loads(cached.read_text())["source_sha256"] == fit.source_sha256 and fitted_host_model() == fit
    # it carries past the rows: more sequences cost more, TP 8 more than TP 4
    assert fit.host_ms(256, 1) > fit.host_ms(128, 1) and fit.host_ms(64, 8) > fit.host_ms(64, 4)
    assert math.isclose(fit_rows(rows).a, fit.a, rel_tol=1e-12)


def test_vllm_v0_host_time_leaving_one_model_out_within_20_percent():
    rows = read_host_rows(SHARED / "vidur-profiles" / "cpu_overheads" / "a100.csv")
    models = sorted({r.model for r in rows})
    assert len(models) == 6
    for model in models:
        fit = fit_rows([r for r in rows if r.model != model])
        held_out = [r for r in rows if r.model == model]
        assert max(abs(e) for e in _relative_errors(fit, held_out)) < 0.20, model


def test_vllm_v0_prices_its_host_time_serially_and_the_ray_round_trip_at_tp(data_dir):
    model, hw = load_model_preset("llama2-70b"), load_hardware_preset("a100-80gb-sxm")
    from testbed.sim.config import ParallelConfig
    v0 = load_engine_preset("vllm-v0")
    fit = fitted_host_model()
    for tp in (4, 8):
        cost = CostModel(model, hw, ParallelConfig(tp=tp), engine=v0)
        b = cost.breakdown([(1, 1024)] * 32)
        assert b["overhead_s"] == pytest.approx(fit.host_ms(32, tp) * 1e-3, rel=1e-12)


# -- engine=vllm-v1's attention: FA3 / FlashInfer tables ----------------------------------------

def test_fa3_flashinfer_is_refitted_from_the_tables_and_prices_their_rows(data_dir):
    import numpy as np
    from testbed.sim.attention_kernels import attention_kernel
    from testbed.sim.blis_attention import H100_HBM_BYTES_PER_S, fit_kernel, fitted_kernel
    kernel = fitted_kernel()
    assert kernel == fit_kernel(data_dir / "blis-h100") == attention_kernel("fa3_flashinfer")
    assert len(list((data_dir / "derived" / "blis-h100" / "fa3_flashinfer").glob("*/kernel.json"))) == 1
    # FlashInfer decode, Llama-2-7B's 32 KV heads on one H100: 32 sequences of 1K tokens, 192.5 us measured
    nbytes = 32 * 1024 * 32 * 128 * 2 * 2
    seconds = nbytes / (H100_HBM_BYTES_PER_S * kernel.decode_bw_fraction) + kernel.decode_floor_us * 1e-6
    assert seconds == pytest.approx(192.487e-6, rel=0.10)
    # FA3 prefill reaches ~3/4 of the H100's peak on long prompts, a third of it at 1K
    eff = [kernel.peak_fraction["h100"] * (n / (n + kernel.q_half)) ** 2 for n in (1024, 16384)]
    assert 0.2 < eff[0] < 0.4 and 0.65 < eff[1] < 0.8 and np.isclose(kernel.q_half, kernel.ctx_half)


def test_the_crossover_study_prices_with_the_run_engine():
    from testbed.experiments.crossover import _sim_rows
    grid = (["llama3-8b"], ["h100-sxm"], ["rdma-400"], [512], [8192], [32], 1024)
    stated, v0 = (_sim_rows(*grid, engine=load_engine_preset(n))[0] for n in ("stated", "vllm-v0"))
    default = _sim_rows(*grid)[0]
    assert default == _sim_rows(*grid, engine=load_engine_preset("vllm-v1"))[0]
    # each engine its own price: host time, launches, attention kernel
    assert len({row["chunked_prefill_ms"] for row in (stated, v0, default)}) == 3
