"""SIGINT and SIGTERM at every phase of a real run, with a CPU hog beside it:
`testbed run` in its own session, stderr on a pseudo-terminal so
that it shows progress, and the signal sent to its whole process group, as a
terminal's Ctrl-C or a job scheduler's SIGTERM is. In every phase the run
exits within 10 s of the signal, with 128 + the signal's number (or 0 when
the signal landed while the workers were already being stopped, which is
bounded and ignores it), writes summary.json and requests.jsonl, and leaves no
process behind.

Phases: start-up (the workers exist but serve nothing yet), steady state
(requests finishing), mid-transfer (mode=disagg over a shaped 50 Mb/s link:
every prompt's KV spends ~100 ms on it, so one is in flight whenever requests
finish), shutdown (the signal as the last request is done)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from test_serving import TerminalRun, alive, cmdline, cpu_hog, in_process_group  # noqa: F401 (cpu_hog: a fixture)

BOUND_S = 10.0
SMALL = ["workload=chat", "workload.rate=4", "wandb.mode=disabled", "runtime.heartbeat_s=0.5"]
PHASES = {
    # phase: (extra overrides, number of requests, the progress count to wait for; 0 = the workers' start)
    "start-up": ([], 400, 0),
    "steady": ([], 400, 3),
    "mid-transfer": (["mode=disagg", "transfer.transport=shaped", "transfer.rate_gbps=0.05",
                      "workload.prompt_min=256", "workload.prompt_max=512"], 400, 2),
    "shutdown": ([], 6, 6),
}


def interrupt_at(tmp_path: Path, phase: str, signum: int) -> tuple[int, float, Path, str]:
    """Run, signal the group at `phase`; (exit code, seconds from signal to exit, run dir, stderr)."""
    extra, num_requests, wait_for = PHASES[phase]
    out = tmp_path / "run"
    run = TerminalRun(tmp_path, [*SMALL, f"workload.num_requests={num_requests}", *extra, f"hydra.run.dir={out}"])
    proc = run.proc
    try:
        if wait_for == 0:        # a worker process exists, and nothing is served yet
            run.wait_until(lambda: any("spawn_main" in cmdline(p) for p in in_process_group(proc.pid)), 120)
            assert run.requests_done() == 0, "the run was serving before the start-up signal"
        else:
            run.wait_until(lambda: run.requests_done() >= wait_for, 120)
        os.killpg(proc.pid, signum)
        took = run.wait_exit(BOUND_S + 20)
        rc = proc.wait(1)
    finally:
        run.close()
    grace = time.monotonic() + 5          # multiprocessing's resource tracker sees its pipe close
    while (left := [p for p in in_process_group(proc.pid) if alive(p)]) and time.monotonic() < grace:
        time.sleep(0.1)
    assert left == [], f"processes outlived the run: {[cmdline(p) for p in left]}"
    return rc, took, out, run.text()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("phase", [
    "steady", pytest.param("start-up", marks=pytest.mark.slow), pytest.param("mid-transfer", marks=pytest.mark.slow),
    pytest.param("shutdown", marks=pytest.mark.slow)])
def test_a_signal_at_any_phase_stops_the_run_within_10_s_and_keeps_what_it_measured(tmp_path, cpu_hog, phase,
                                                                                    signum):
    rc, took, out, stderr = interrupt_at(tmp_path, phase, signum)
    print(f"{phase} {signal.Signals(signum).name}: exit {rc} {took:.1f} s after the signal")
    assert took < BOUND_S, f"{phase}: exited {took:.1f} s after {signal.Signals(signum).name}\n{stderr[-2000:]}"
    assert rc in ((128 + signum, 0) if phase == "shutdown" else (128 + signum,)), (rc, stderr[-2000:])
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    _, num_requests, wait_for = PHASES[phase]
    finished = [r for r in records if r["status"] == "finished"]
    assert len(finished) >= wait_for and len(records) <= num_requests     # the rest had not arrived yet
    assert (summary["num_requests"], summary["num_finished"]) == (len(records), len(finished))
    if rc:
        assert summary["interrupted"] is True
        assert all(r["status"] == "aborted" and r["error"].startswith("interrupted (Ctrl-C)")
                   for r in records if r["status"] != "finished")
    # the workers that reported say every block is free (aborted requests released theirs)
    assert summary["kv_blocks_leaked"] == {}
