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
