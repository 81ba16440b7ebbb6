"""The blis-h100 vLLM 0.15.1 runs as testbed.analysis.blis_replay reads and
replays them: each load stage's rate, duration and measured means, and the
replay's figures per stage."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from testbed.analysis.blis_replay import aggregate_runs, replay
from testbed.model.config import load_model_preset
from testbed.sim.config import ParallelConfig, load_hardware_preset
from testbed.sim.defaults import kv_blocks_from_memory
from testbed.sim.engine_config import load_engine_preset

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def _rows() -> dict[str, dict[str, str]]:
    with open(SHARED / "blis-h100" / "vllm-0.15-trainval.csv", newline="") as f:
        return {r["experiment"]: r for r in csv.DictReader(f)}


def test_each_stage_carries_its_rate_duration_and_measured_means():
    rows, (runs, _) = _rows(), aggregate_runs(SHARED / "blis-h100")
    assert len(runs) == 13
    for run in runs:
        r = rows[run.name]
        specs = r["stages_rps_x_s"].split()
        assert [(s["rate"], s["duration_s"]) for s in run.stages] == \
            [tuple(float(x) for x in spec.split("x")) for spec in specs]
        for i, stage in enumerate(run.stages):
            # a one-stage run leaves its stage columns empty: the whole run's means are the stage's
            col = (lambda c: r[f"stage{i}_{c}"]) if len(specs) > 1 else (lambda c: r[f"stage{i}_{c}"] or r[c])
            assert (stage["ttft_mean"], stage["tpot_mean"], stage["e2e_mean"]) == \
                (float(col("ttft_mean")), float(col("itl_mean")), float(col("e2e_mean")))
    assert sorted(len(run.stages) for run in runs) == [1] * 5 + [2] * 8


def test_only_the_run_without_a_workload_spec_is_left_out():
    runs, skipped = aggregate_runs(SHARED / "blis-h100")
    assert skipped == {"20260217-162547-llama-2-7b-tp1-roleplay": "no workload spec published"}
    assert sorted({run.model for run in runs}) == ["llama2-7b", "llama3.1-70b", "llama4-scout-fp8", "mistral-nemo-12b",
                                                    "qwen2.5-7b", "yi-34b"]


def test_num_kv_blocks_auto_is_within_6_percent_of_the_blocks_vllm_allocated():
    """The KV blocks `num_kv_blocks=auto` gives each dense model, TP and token
    budget of the runs (gpu_memory_utilization 0.9, as they ran) against the
    blocks vLLM reported: above by 1.7-4.9% (vLLM also reserves its CUDA
    graphs' memory). Scout is left out: vLLM's are 42% fewer (8,253 against
    14,126; the vision encoder vLLM loads and profiles for it is not modelled)."""
    h100 = load_hardware_preset("h100-sxm")
    checked = 0
    for run in aggregate_runs(SHARED / "blis-h100")[0]:
        if run.model == "llama4-scout-fp8":
            continue
        ours = kv_blocks_from_memory(load_model_preset(run.model), h100, ParallelConfig(tp=run.tp), 16, 0.9,
                                     run.max_num_batched_tokens, run.max_num_seqs)
        assert 1.0 <= ours / run.num_kv_blocks <= 1.06, (run.name, ours, run.num_kv_blocks)
        checked += 1
    assert checked == 9


def test_a_replay_reports_the_stages_its_requests_arrived_in(tmp_path):
    """The first 40 requests of a two-stage run all arrive in its first stage
    (600 s): stage 0's figures are the whole replay's, and stage 1 has none."""
    (run,) = [r for r in aggregate_runs(SHARED / "blis-h100")[0] if r.name.startswith("62-mistral-nemo")]
    got = replay(run, load_engine_preset("vllm-v1"), tmp_path, max_requests=40)
    assert got["num_requests"] == 40
    assert (got["stage0_ttft_mean"], got["stage0_tpot_mean"]) == (got["ttft_mean"], got["tpot_mean"])
    assert not any(k.startswith("stage1_") for k in got)
    assert got["tpot_mean"] == pytest.approx(6.2, rel=0.15)      # a 12B model at TP 2, a handful of decodes


def test_the_fp8_moe_scout_decodes_within_15_percent_of_its_measured_tpot(tmp_path):
    """Llama 4 Scout FP8 at TP 2 (fp8 weights, bfloat16 KV; 16 experts, one
    per token, and a shared one), its first 600 requests at 2.5 req/s: the
    stage's measured TPOT (17.90 ms) within 15%. Its TTFT is not: the
    measured one waits ~1.5 TPOT more than the simulated (experiments/README,
    "engine presets")."""
    (run,) = [r for r in aggregate_runs(SHARED / "blis-h100")[0] if r.name.startswith("17-llama-4-scout")]
    got = replay(run, load_engine_preset("vllm-v1"), tmp_path, max_requests=600)
    assert got["stage0_tpot_mean"] == pytest.approx(run.stages[0]["tpot_mean"], rel=0.15)
