"""The record writer process (testbed/record_writer.py) behind a RecordLog:
the same bytes as writing in-process (whatever the records hold, across the
hand-over mid-run), lines on disk as each flush goes, a writer that dies
reported with what it said, and no writer left behind by a parent that dies.
A real child process and pipe throughout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from testbed.metrics import IterationRecord, RequestRecord, write_jsonl
from testbed.record_log import RecordLog
from testbed.record_writer import InlineWriter, RecordWriter, RecordWriterError
from testbed.run_stats import RunStats

ROOT = Path(__file__).resolve().parents[1]


def requests() -> list[RequestRecord]:
    return [RequestRecord(f"r{i}", "finished", 10 + i, [1, 2, i], 0.1 * i, 0.1 * i, 0.1 * i + 1e-3,
                          [0.1 * i + 1e-3 * k for k in range(3)], 0.1 * i + 0.01)
            for i in range(50)] + [
        RequestRecord("r, 50", "failed", 3, [], 5.0, error="x, y \u00fc"),      # ", " inside a string
        RequestRecord("r51", "failed", 3, [], 5.1, error="not utf-8: \udcff"),  # msgpack cannot carry it
        RequestRecord("r52", "finished", 3, [7], 5.2, token_times_s=[float("inf")], kv_bytes_sent=2**70)]


def iterations() -> list[IterationRecord]:
    its = [IterationRecord(i * 0.1, float("nan") if i == 3 else 1e-300 * i, i, 0, 2**40 + i, w, 512, None)
           for i, w in enumerate(["w", None, "a, b", 'q"\\\n, ü'] * 300)]
    its.append(IterationRecord(np.float64(0.1), -0.0, True, 1, 2**70, "w"))        # past 64 bits
    return its


def fill(log: RecordLog) -> None:
    reqs, its = requests(), iterations()
    for i, r in enumerate(reqs):
        log.request(r, i)
        for it in its[i * 24:(i + 1) * 24]:
            log.iteration(it)
    log.extend_iterations(its[len(reqs) * 24:])


# r52's token time of inf (an edge value for the encoder) makes the summary's percentiles NaN, which
# numpy reports as a RuntimeWarning; both summaries must carry the same NaN, so the warning is expected.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("writer_after", [0, 500])       # from the start; handed over mid-run
def test_the_writer_writes_the_bytes_write_jsonl_writes(tmp_path, writer_after):
    log = RecordLog(RunStats(None, None), tmp_path / "w", chunk=64, writer_after=writer_after)
    fill(log)
    assert isinstance(log._writer, RecordWriter)
    log.close()
    log.close()                                            # twice: nothing more happens
    write_jsonl(tmp_path / "requests.jsonl", requests())
    write_jsonl(tmp_path / "iterations.jsonl", iterations())
    for name in ("requests.jsonl", "iterations.jsonl"):
        assert (tmp_path / "w" / name).read_bytes() == (tmp_path / name).read_bytes(), name
    first = (tmp_path / "w" / "iterations.jsonl").read_text().splitlines()[3]
    assert first == json.dumps({f.name: getattr(iterations()[3], f.name) for f in fields(IterationRecord)})
    inline = RecordLog(RunStats(None, None), tmp_path / "i", chunk=64)
    fill(inline)
    assert isinstance(inline._writer, InlineWriter)
    assert json.dumps(log.summary(10.0)) == json.dumps(inline.summary(10.0))     # (NaN != NaN)


def test_lines_reach_the_file_as_each_flush_goes(tmp_path):
    log = RecordLog(RunStats(None, None), tmp_path, chunk=10**9, flush_s=3600, writer_after=0)
    log.extend_iterations(iterations()[:100])
    log.flush()
    path, deadline = tmp_path / "iterations.jsonl", time.monotonic() + 10
    while path.read_bytes().count(b"\n") < 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.read_bytes().count(b"\n") == 100                # before the log is closed
    log.close()


def test_a_writer_that_dies_is_reported_not_ignored(tmp_path):
    log = RecordLog(RunStats(None, None), tmp_path, chunk=16, writer_after=0)
    log.extend_iterations(iterations()[:32])
    pid = log._writer._proc.pid
    os.kill(pid, signal.SIGKILL)
    log._writer._proc.wait()
    with pytest.raises(RecordWriterError, match=rf"record writer process \(pid {pid}\) exited with -9.*incomplete"):
        for _ in range(100):                          # the pipe may take a few chunks before it breaks
            log.extend_iterations(iterations()[:64])


def test_a_ctrl_c_or_a_group_kill_does_not_cut_the_records_short(tmp_path):
    """The writer is in a session of its own (a terminal's Ctrl-C and a kill of the run's
    process group do not reach it) and ignores SIGINT and SIGTERM sent to it anyway: the
    run stops, writes the rest through it and closes the pipe, and then it exits."""
    log = RecordLog(RunStats(None, None), tmp_path, chunk=16, writer_after=0)
    log.extend_iterations(iterations()[:32])
    child = log._writer._proc
    assert os.getsid(child.pid) != os.getsid(0)
    wanted = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    deadline = time.monotonic() + 10           # its start: the handlers are set once it runs
    while time.monotonic() < deadline:
        status = Path(f"/proc/{child.pid}/status").read_text()
        if int(status.split("SigIgn:")[1].split()[0], 16) & wanted == wanted:
            break
        time.sleep(0.01)
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(child.pid, sig)
    time.sleep(0.2)
    assert child.poll() is None
    log.extend_iterations(iterations()[32:64])
    log.close()
    assert child.returncode == 0
    assert (tmp_path / "iterations.jsonl").read_text().count("\n") == 64


def test_the_writer_exits_when_its_parent_dies(tmp_path):
    code = ("import os, sys\n"
            "from testbed.record_log import RecordLog\n"
            "from testbed.run_stats import RunStats\n"
            "from testbed.metrics import IterationRecord\n"
            "log = RecordLog(RunStats(None, None), sys.argv[1], chunk=4, writer_after=0)\n"
            "log.extend_iterations([IterationRecord(0.0, 1.0, 1, 0, 0, 'w')] * 8)\n"
            "print(log._writer._proc.pid, flush=True)\n"
            "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    child = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()
    assert (tmp_path / "iterations.jsonl").read_text().count("\n") == 8      # what it was sent, on disk


@pytest.mark.parametrize("case", ["colocated", "kvstore_1p2d"])
def test_a_simulated_run_writes_the_same_files_through_the_writer(case, tmp_path):
    """runtime.record_writer_after=0 (the writer from the first record) against null
    (never): the same requests.jsonl, iterations.jsonl and summary."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_sim_fast_forward import CASES, _run
    on, on_summary = _run(tmp_path / "on", *CASES[case], "runtime.record_writer_after=0")
    off, off_summary = _run(tmp_path / "off", *CASES[case], "runtime.record_writer_after=null")
    assert on_summary["num_finished"] == on_summary["num_requests"] > 0
    for name in ("requests.jsonl", "iterations.jsonl"):
        assert (tmp_path / "on" / name).read_bytes() == (tmp_path / "off" / name).read_bytes(), name
    assert json.dumps(on_summary) == json.dumps(off_summary)


def test_record_writer_after_must_be_a_count():
    from testbed.config import RuntimeConfig
    with pytest.raises(ValueError, match=r"runtime.record_writer_after: must be >= 0 or null, got -1"):
        RuntimeConfig(record_writer_after=-1).validate()
