"""A Hydra sweep in W&B as a user meets it: `testbed run -m` with wandb
offline puts the sweep's runs in one group (the sweep) and names each by the
values its point changes; read back from each point's offline run files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_wandb import Logged, offline  # noqa: F401  (the fixture)
from testbed.sweep_names import dir_safe, point_name, sweep_group, swept_keys

REPO = Path(__file__).resolve().parents[1]
SMALL = ["runtime=sim", "model=tiny", "workload.num_requests=3", "workload.rate=20", "workload.prompt_dist=fixed",
         "workload.output_min=2", "workload.output_max=4"]


def run_testbed(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """This checkout's `testbed` (python -m testbed.cli with the repository first on the path)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "testbed.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def points(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=lambda p: int(p.name.split("-", 1)[0]))


@pytest.mark.slow          # ~25 s here: four CLI points, each a wandb offline run
def test_a_sweep_is_one_group_and_each_run_is_named_by_its_overrides(offline):  # noqa: F811
    sweep = offline / "multirun" / "sweep-a"
    proc = run_testbed("run", "-m", *SMALL, "mode=colocated,disagg", "workload.prompt_len=64,128",
                       f"hydra.sweep.dir={sweep}", cwd=offline)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [Logged(p) for p in points(sweep)]
    assert [run.group for run in logged] == [str(sweep)] * 4
    assert [run.name for run in logged] == ["mode=colocated,workload.prompt_len=64",
                                            "mode=colocated,workload.prompt_len=128",
                                            "mode=disagg,workload.prompt_len=64",
                                            "mode=disagg,workload.prompt_len=128"]
    assert [run.config["workload"]["prompt_len"] for run in logged] == [64, 128, 64, 128]
    assert [run.config["mode"] for run in logged] == ["colocated", "colocated", "disagg", "disagg"]


@pytest.mark.slow          # ~35 s here: two CLI commands
def test_wandb_group_and_name_set_by_the_user_win_and_a_single_run_keeps_its_name(offline):  # noqa: F811
    sweep = offline / "sweep-b"
    proc = run_testbed("run", "-m", *SMALL, "workload.prompt_len=64,128", "wandb.group=mine",
                       f"hydra.sweep.dir={sweep}", cwd=offline)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(r.group, r.name) for r in map(Logged, points(sweep))] == \
        [("mine", "workload.prompt_len=64"), ("mine", "workload.prompt_len=128")]

    single = offline / "single"
    proc = run_testbed("run", *SMALL, "workload.prompt_len=64", f"hydra.run.dir={single}", cwd=offline)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = Logged(single)
    assert (run.group, run.name) == ("", "colocated-sarathi-tiny-mixed")


def test_a_point_is_named_by_the_swept_values_in_command_line_order():
    argv = ["-m", "runtime=sim", "mode=colocated,disagg", "workload.prompt_len=1024,4096", "hydra.sweep.dir=x",
            "hydra/launcher=joblib", "+experiment.extra=range(1,3)", "wandb.mode=offline"]
    swept = swept_keys(argv)
    assert swept == {"mode", "workload.prompt_len", "experiment.extra"}
    task = ["runtime=sim", "mode=disagg", "workload.prompt_len=4096", "+experiment.extra=1", "wandb.mode=offline"]
    assert point_name(task, swept) == "mode=disagg,workload.prompt_len=4096,+experiment.extra=1"
    # nothing swept (-m over single values): every override; none at all: no name (the default one)
    assert point_name(["runtime=sim", "mode=disagg"], set()) == "runtime=sim,mode=disagg"
    assert point_name([], set()) is None
    assert sweep_group("multirun/2026-12-01/11-55-10") == "multirun/2026-12-01/11-55-10"
    assert sweep_group("/" + "d" * 300) == "d" * 128


def test_a_points_directory_name_has_no_slash_and_fits_a_file_name():
    assert dir_safe("experiment.probe_cache=/a/b,runtime=sim") == "experiment.probe_cache=_a_b,runtime=sim"
    many = ",".join(f"workload.key_{i}=value_{i}" for i in range(30))
    a, b = dir_safe(many), dir_safe(many.replace("value_29", "value_x"))
    assert len(a.encode()) == len(b.encode()) == 200 and a != b        # cut, the whole kept apart by its hash
    assert a[:150] == many[:150]
    assert len(dir_safe("x=" + "é" * 150).encode()) <= 200              # not cut inside a character
