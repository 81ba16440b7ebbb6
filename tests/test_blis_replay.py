"""The blis-h100 vLLM 0.15.1 runs as testbed.analysis.blis_replay reads and
replays them: each load stage's rate, duration and measured means, and the
replay's figures per stage."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from testbed.analysis.blis_replay import aggregate_runs, replay
from testbed.sim.engine_config import load_engine_preset

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def _rows() -> dict[str, dict[str, str]]:
    with open(SHARED / "blis-h100" / "vllm-0.15-trainval.csv", newline="") as f:
        return {r["experiment"]: r for r in csv.DictReader(f)}


def test_each_stage_carries_its_rate_duration_and_measured_means():
    rows, (runs, _) = _rows(), aggregate_runs(SHARED / "blis-h100")
    assert len(runs) == 9
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
    assert sorted(len(run.stages) for run in runs) == [1, 1, 1, 2, 2, 2, 2, 2, 2]


def test_a_replay_reports_the_stages_its_requests_arrived_in(tmp_path):
    """The first 40 requests of a two-stage run all arrive in its first stage
    (600 s): stage 0's figures are the whole replay's, and stage 1 has none."""
    (run,) = [r for r in aggregate_runs(SHARED / "blis-h100")[0] if r.name.startswith("62-mistral-nemo")]
    got = replay(run, load_engine_preset("vllm-v1"), tmp_path, max_requests=40)
    assert got["num_requests"] == 40
    assert (got["stage0_ttft_mean"], got["stage0_tpot_mean"]) == (got["ttft_mean"], got["tpot_mean"])
    assert not any(k.startswith("stage1_") for k in got)
    assert got["tpot_mean"] == pytest.approx(6.2, rel=0.15)      # a 12B model at TP 2, a handful of decodes
