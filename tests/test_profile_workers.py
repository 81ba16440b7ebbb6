"""`testbed profile --workers N` (testbed/profiling/neighbors.py): the profile
is measured beside N - 1 worker processes that really step the model (they
use a core), it records the conditions it was measured under
(profiled_workers, profiled_threads), nothing is left running after it, and
the decision study's real rows say when their profile was measured otherwise."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.experiments.decision_real import profile_conditions
from testbed.profiling.neighbors import Neighbors
from testbed.sim.config import load_hardware_preset


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_neighbour_steps_the_model_while_the_block_runs_and_is_gone_after():
    with Neighbors("tiny", 1) as n:
        (proc,) = n.procs
        before, t0 = _cpu_s(proc.pid), time.monotonic()
        time.sleep(1.0)
        used = (_cpu_s(proc.pid) - before) / (time.monotonic() - t0)
        assert n.alive() == 1
    # stepping without pause (an idle neighbour uses ~0; 2 cores here, shared with others)
    assert used > 0.1, used
    assert not proc.is_alive() and proc.exitcode is not None
    assert not [p for p in mp.active_children() if p.pid == proc.pid]


def test_no_neighbour_for_one_worker():
    with Neighbors("tiny", 0) as n:
        assert n.procs == []


def test_the_shipped_cpu_profile_records_one_worker_and_one_thread():
    hw = load_hardware_preset("cpu")
    assert (hw.profiled_workers, hw.profiled_threads) == (1, 1)
    assert load_hardware_preset("h100-sxm").profiled_workers == 0          # not a CPU profile


def test_real_rows_name_a_profile_measured_with_other_workers_and_the_fix():
    hw = load_hardware_preset("cpu")
    assert profile_conditions(hw, 1, 1) == ""
    note = profile_conditions(hw, 2, 1)
    assert "profiled with 1 worker(s)" in note and "testbed profile --workers 2 --threads 1" in note
    assert "experiment.real_hardware=cpu-2w" in note
    assert "--threads 2" in profile_conditions(hw, 1, 2)


def test_profile_cli_refuses_zero_workers(capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile", "--quick", "--workers", "0", "--out", "/nonexistent/x.yaml"])
    assert e.value.code == 2
    assert "--workers: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a_file/x.yaml", "."])
def test_profile_cli_refuses_an_output_it_cannot_write_before_measuring(where, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / where
    with pytest.raises(SystemExit) as e:
        main(["profile", "--quick", "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--out: cannot write {out}" in err
    assert ("a directory" if where == "." else "File exists") in err      # a file where its directory goes


@pytest.mark.slow
def test_a_profile_beside_a_busy_neighbour_records_two_workers(tmp_path):
    from testbed.profiling.profile import profile_cpu
    hw = profile_cpu(tmp_path / "cpu-2w.yaml", quick=True, name="cpu-2w", engine_overhead=False, num_workers=2)
    assert (hw.profiled_workers, hw.profiled_threads) == (2, 1)
    assert load_hardware_preset(str(tmp_path / "cpu-2w.yaml")) == hw
    assert "workers stepping at once=2" in (tmp_path / "cpu-2w.yaml").read_text()
    assert not mp.active_children()


def test_decision_real_records_its_profile_conditions_and_refuses_a_profile_without_twins(tmp_path):
    from test_decision_real import small

    from testbed.experiments.decision import run_decision
    lines = []
    run_decision(small(real_budget_s=1e-9), tmp_path, lines.append)        # no real probe runs
    import json
    profile = json.loads((tmp_path / "decision_summary.json").read_text())["assumptions"]["real"]["profile"]
    assert (profile["profiled_workers"], profile["profiled_threads"]) == (1, 1)
    assert "testbed profile --workers 2" in profile["note"]
    assert any(line.startswith("decision real: hardware 'cpu' was profiled with 1 worker(s)") for line in lines)
    with pytest.raises(ValueError, match="experiment.real_hardware='cpu-2w'"):
        run_decision(small(real_hardware="cpu-2w"), tmp_path / "refused", lambda *_: None)
    assert not (tmp_path / "refused").exists()
