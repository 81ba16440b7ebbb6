"""The `testbed` command as a user types it: help, a two-point sweep with
`testbed run -m` (plus one bad point, which fails alone), and `testbed report`
over the sweep's run directories. Single-run config errors (unknown scheduler,
token_budget=0, rate=0, missing trace) are tests/test_config_errors.py's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTBED = str(Path(sys.executable).with_name("testbed"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["workload.num_requests=4", "workload.rate=20", "workload.prompt_max=128", "workload.output_max=24",
         "wandb.mode=disabled"]


def run_cli(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([TESTBED, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands(tmp_path):
    for flag in ("--help", "-h"):
        proc = run_cli(flag, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        for cmd in ("testbed run", "testbed report", "testbed profile"):
            assert cmd in proc.stdout


def test_unknown_command_is_one_line_and_exit_2(tmp_path):
    proc = run_cli("serve", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == "testbed: unknown command 'serve'"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("sweep")
    proc = run_cli("run", "-m", "router=round_robin,least_outstanding,nope", *SMALL, f"hydra.sweep.dir={out}",
                   cwd=out)
    return out, proc


def test_sweep_writes_one_run_directory_per_point(sweep):
    out, proc = sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = sorted(p for p in out.iterdir() if p.is_dir())
    assert [p.name.split("-", 1)[0] for p in points] == ["0", "1", "2"]
    for point, router in zip(points[:2], ("round_robin", "least_outstanding")):
        summary = json.loads((point / "summary.json").read_text())
        assert point.name.startswith(f"{point.name[0]}-router={router},")
        assert (summary["num_requests"], summary["num_finished"]) == (4, 4)
        assert {"requests.jsonl", "iterations.jsonl", "config.yaml"} <= {p.name for p in point.iterdir()}
    # the bad point failed on its own, with the field named, and the sweep went on
    assert not (points[2] / "summary.json").exists()
    failed = json.loads((points[2] / "failed.json").read_text())
    assert "router='nope'" in failed["error"]
    assert "error: router='nope' is not known" in proc.stderr


def test_a_path_in_a_sweeps_overrides_names_one_directory_per_point(tmp_path):
    """A value with '/' (a path) in Hydra's override_dirname made each point a
    chain of directories named by the path's parts, which `testbed report
    SWEEP_DIR` (one level down) never found: conf/config.yaml's dir_safe."""
    out = tmp_path / "sweep"
    proc = run_cli("run", "-m", "runtime=sim", f"kvstore.disk_path={tmp_path}/cache", *SMALL,
                   "workload.rate=20,40", f"hydra.sweep.dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(points) == 2 and all((p / "summary.json").is_file() for p in points)
    assert f"kvstore.disk_path={str(tmp_path).replace('/', '_')}_cache" in points[0].name
    report = run_cli("report", str(out), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    header = next(line for line in report.stdout.splitlines() if line.startswith("metric"))
    assert header.split()[1:] == ["workload.rate=20", "workload.rate=40"]


def test_a_sweep_takes_m_among_its_overrides(tmp_path):
    """`testbed run a=1,2 -m b=3`: Hydra's own parser refused overrides on both sides of -m."""
    out = tmp_path / "sweep"
    proc = run_cli("run", "runtime=sim", *SMALL, "workload.rate=20,40", "-m", f"hydra.sweep.dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len([p for p in out.iterdir() if (p / "summary.json").is_file()]) == 2


def test_an_output_directory_that_cannot_be_made_is_named_not_called_a_bad_override(tmp_path):
    too_long = tmp_path / ("x" * 300)
    proc = run_cli("run", "-m", "runtime=sim", *SMALL, f"hydra.sweep.dir={too_long}", cwd=tmp_path)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: cannot create the output directory '{too_long}'"), line
    assert "File name too long" in line and "hydra.sweep.dir" in line and "overrides were refused" not in line


def test_report_compares_the_sweep_points(sweep):
    out, _ = sweep
    a, b = sorted(p for p in out.iterdir() if p.is_dir() and (p / "summary.json").exists())
    proc = run_cli("report", str(a), str(b), cwd=out)
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("metric"))
    assert header.split()[1:] == ["router=round_robin", "router=least_outstanding"]
    finished = next(line for line in proc.stdout.splitlines() if line.startswith("finished"))
    assert finished.split()[1:] == ["4", "4"]
    for run in (a, b):
        assert (run / "tbt.png").read_bytes()[:8] == PNG_MAGIC
        assert (run / "report.csv").is_file()


def test_report_on_a_directory_without_a_run_fails_in_one_line(tmp_path):
    proc = run_cli("report", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no summary.json" in proc.stderr
