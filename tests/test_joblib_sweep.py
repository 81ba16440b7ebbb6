"""`testbed run -m hydra/launcher=joblib`: sweep points run in parallel in
joblib's worker processes; a point that fails at run time (a value Hydra
accepts and the run's validation refuses) is recorded in its failed.json and
the others finish, each logged to W&B in the sweep's group."""
from __future__ import annotations

import json

import pytest

from test_wandb import Logged, offline  # noqa: F401  (the fixture)
from test_wandb_sweeps import SMALL, points, run_testbed


@pytest.mark.slow          # ~30 s here: three CLI points in loky workers, two wandb offline runs
def test_joblib_runs_the_points_in_parallel_and_records_the_failed_one(offline):  # noqa: F811
    sweep = offline / "sweep"
    proc = run_testbed("run", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *SMALL,
                       "workload.prompt_len=64", "workload.rate=20,0,40", f"hydra.sweep.dir={sweep}", cwd=offline)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2,backend=loky" in proc.stdout + proc.stderr     # the joblib launcher ran them
    ok, bad, ok2 = points(sweep)
    for point, rate in ((ok, 20.0), (ok2, 40.0)):
        summary = json.loads((point / "summary.json").read_text())
        assert summary["num_finished"] == summary["num_requests"] == 3
        assert not (point / "failed.json").exists()
        logged = Logged(point)
        assert logged.config["workload"]["rate"] == rate
        assert (logged.group, logged.name) == (str(sweep), f"workload.rate={rate:g}")
    assert not (bad / "summary.json").exists()
    failed = json.loads((bad / "failed.json").read_text())
    assert failed["error"] == "ValueError: workload.rate: must be > 0, got 0.0"
    assert "error: workload.rate: must be > 0, got 0.0" in proc.stderr


@pytest.mark.slow          # ~45 s here: two real-engine points, three worker processes
def test_joblib_points_on_the_real_engine_start_their_worker_processes(tmp_path):
    """A loky worker's default start method ('loky') is unknown to the
    processes launcher=local spawns from it; the CLI puts spawn back, so the
    real engine's workers start, and both modes give the same tokens."""
    from testbed.metrics import read_requests
    sweep = tmp_path / "sweep"
    proc = run_testbed("run", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "mode=colocated,disagg",
                       "workload.num_requests=3", "workload.prompt_max=64", "workload.output_min=4",
                       "workload.output_max=8", "wandb.mode=disabled", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    colocated, disagg = points(sweep)
    assert not list(sweep.glob("*/failed.json")), proc.stderr[-3000:]
    tokens = [{r.request_id: r.output_token_ids for r in read_requests(p / "requests.jsonl")}
              for p in (colocated, disagg)]
    assert len(tokens[0]) == 3 and all(len(t) >= 4 for t in tokens[0].values())
    assert tokens[0] == tokens[1]
