"""Liveness both ways, caused for real: a worker that is alive but
no longer stepping (SIGSTOP) is found by the frontend's heartbeat within
runtime.hang_timeout_s, killed, and its requests fail with a clear error while
the other replica serves the rest; and a frontend killed with SIGKILL leaves
no orphans: its workers hear no heartbeat for runtime.frontend_timeout_s and
exit by themselves."""
from __future__ import annotations

import os
import signal
import time

import pytest

from test_disagg_faults import Watch, check, config, run
from test_serving import TerminalRun, alive, cmdline, in_process_group
from testbed.config import from_dict, validate
from testbed.runtime.messages import Event
from testbed.runtime.real import RealRuntime

HEARTBEAT = {"heartbeat_s": 0.25, "hang_timeout_s": 2.0, "frontend_timeout_s": 3.0}


def test_a_hung_worker_is_found_by_its_heartbeat_and_its_requests_fail():
    """colocated, 2 replicas, round robin: replica0 is stopped (SIGSTOP: alive,
    not stepping, not reading commands) at its first iteration. Within
    hang_timeout_s plus a heartbeat the frontend kills it and fails exactly the
    requests it held; replica1 serves the others with the right tokens and
    reports every block free."""
    cfg = config(mode="colocated", replicas=2, router="round_robin", runtime=HEARTBEAT)
    watch, stopped = Watch(), []

    def hook(rt: RealRuntime, ev: Event) -> None:
        if not stopped and ev.kind == "iteration" and ev.worker == "replica0":
            os.kill(rt.launcher.pid("replica0"), signal.SIGSTOP)
            stopped.append(time.monotonic())

    t0 = time.monotonic()
    result = run(cfg, watch, hook)
    assert stopped, "replica0 never stepped"
    records = {r.request_id: r for r in result.records}
    failed = {rid for rid, r in records.items() if r.status != "finished"}
    assert failed and len(failed) < len(records)
    error = "worker replica0 hung (silent for 2 s)"
    check(result, cfg, {rid: ("failed", error) for rid in failed}, {"replica1"})
    # found within the bound: the failure is stamped at most hang_timeout_s + a heartbeat + a liveness tick later
    first_failure = min(records[rid].finish_s for rid in failed)
    stopped_at = stopped[0] - t0
    assert first_failure - stopped_at < 2.0 + 0.25 + 0.2 + 1.0, (first_failure, stopped_at)


def test_liveness_settings_are_checked():
    with pytest.raises(ValueError, match=r"runtime.heartbeat_s: must be > 0"):
        validate(from_dict({"runtime": {"heartbeat_s": 0}}))
    with pytest.raises(ValueError, match=r"runtime.hang_timeout_s: must exceed two heartbeats"):
        validate(from_dict({"runtime": {"heartbeat_s": 1.0, "hang_timeout_s": 1.5}}))
    with pytest.raises(ValueError, match=r"runtime.frontend_timeout_s"):
        validate(from_dict({"runtime": {"frontend_timeout_s": 0.5}}))
    validate(from_dict({"runtime": HEARTBEAT}))


def test_workers_exit_by_themselves_when_the_frontend_is_killed(tmp_path):
    """`testbed run` (2 replicas) in its own session, stderr on a pseudo-terminal
    so that it shows progress; once requests finish (both workers serve), the
    frontend alone gets SIGKILL. Its workers see no heartbeat and exit within
    frontend_timeout_s (3 s) plus a step; nothing of the run is left."""
    term = TerminalRun(tmp_path, ["replicas=2", "workload=chat", "workload.num_requests=400", "workload.rate=4",
                                 "wandb.mode=disabled", "runtime.heartbeat_s=0.25", "runtime.frontend_timeout_s=3",
                                 f"hydra.run.dir={tmp_path / 'run'}"])
    proc = term.proc
    try:
        term.wait_until(lambda: term.requests_done() >= 1)
        workers = [p for p in in_process_group(proc.pid) if "spawn_main" in cmdline(p)]
        assert len(workers) == 2, [cmdline(p) for p in in_process_group(proc.pid)]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
        while True:
            left = [p for p in in_process_group(proc.pid) if alive(p)]
            if not left or time.monotonic() - killed > 3.0 + 10.0:
                break
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert left == [], f"orphans {took:.1f} s after the frontend died: {[cmdline(p) for p in left]}"
        assert took > 2.5, f"the workers exited {took:.1f} s after the frontend died, before frontend_timeout_s"
        print(f"workers gone {took:.1f} s after the frontend's SIGKILL (runtime.frontend_timeout_s=3)")
    finally:
        for p in in_process_group(proc.pid):
            os.kill(p, signal.SIGKILL)
        term.close()


def test_a_step_longer_than_the_hang_timeout_is_not_a_hang():
    """One replica whose budget prefills an 8,192-token prompt whole: one step
    of 2.5 s on tiny here (more on a busy machine; 6,144 tokens took 1.25 s on
    a quiet one, too close to 1.25), twice the 1 s hang timeout or more.
    Inside it the worker reads no Ping; its step watch says it lives while the
    step computes (Busy), so it is not killed, and every request finishes with
    the reference tokens and every block free."""
    cfg = config(mode="colocated", replicas=1, token_budget=8192, num_kv_blocks=600,
                 runtime={**HEARTBEAT, "hang_timeout_s": 1.0},
                 workload={"num_requests": 2, "inject_arrival_s": [0.0], "inject_prompt_len": [8192],
                           "inject_output_len": [4]})
    watch, steps = Watch(), []

    def hook(rt: RealRuntime, ev: Event) -> None:
        if ev.kind == "iteration":
            steps.append(ev.record.duration_s)

    result = run(cfg, watch, hook)
    # silent that long, the worker would have been found hung (the first test's bound)
    longest = max(steps, default=0.0)
    assert longest > cfg.runtime.hang_timeout_s + cfg.runtime.heartbeat_s, f"no step outlasted it: {steps}"
    check(result, cfg, {}, {"replica0"})


def test_a_worker_that_fails_to_start_reports_why_and_exits():
    """A worker process whose config cannot be read (a field the schema does not
    know) sends WorkerError, naming the field, over its event socket and exits
    non-zero. Its sockets connect before anything that can fail: before, such a
    failure came first and its report blocked for good on a socket with no peer,
    so the worker never exited and the frontend heard nothing for 120 s."""
    import multiprocessing

    import zmq

    from testbed.launchers.base import WorkerSpec
    from testbed.launchers.local import run_entry
    from testbed.runtime.messages import WorkerError
    from testbed.runtime.wire import decode

    ctx = zmq.Context()
    events, commands = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    event_port = events.bind_to_random_port("tcp://127.0.0.1")
    command_port = commands.bind_to_random_port("tcp://127.0.0.1")
    spec = WorkerSpec(worker_id="replica0", role="replica", needs_kv_port=False, rank=0, world_size=1,
                      cmd_addr=f"tcp://127.0.0.1:{command_port}", event_addr=f"tcp://127.0.0.1:{event_port}",
                      t0=time.monotonic(), dist_addr=None, cfg={"no_such_field": 1})
    proc = multiprocessing.get_context("spawn").Process(target=run_entry, args=(spec,))
    proc.start()
    try:
        assert events.poll(60_000), "the worker sent nothing"
        sender, raw = events.recv_multipart()
        ev = decode(raw)
        assert sender == b"replica0" and type(ev) is WorkerError and ev.worker == "replica0"
        assert "no_such_field" in ev.error
        proc.join(30)
        assert proc.exitcode not in (None, 0), "the worker did not exit after failing"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        ctx.destroy(0)


def test_the_frontend_shows_a_crashed_childs_traceback_once_and_a_refused_setting_in_one_line(capsys):
    """A child that fails reports its error and traceback (WorkerError) and exits
    1 without printing them (launchers/local.py), so its traceback reaches stderr
    once, through the frontend, and only for a crash: a ValueError is a setting it
    refused, whose message names the field (the CLI's one line,
    test_config_errors.py's kvstore_disk_tier_unmakeable)."""
    from testbed.runtime.messages import WorkerError
    from testbed.runtime.real import child_error
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nKeyError: 7\n'
    assert child_error(WorkerError("decode0", "KeyError: 7", trace)) == "KeyError: 7"
    assert capsys.readouterr().err == f"decode0: {trace}"
    refused = WorkerError("kvstore", "ValueError: kvstore.disk_path: cannot make it", trace.replace("KeyError", "ValueError"))
    assert child_error(refused) == refused.error
    assert capsys.readouterr().err == ""
