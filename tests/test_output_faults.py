"""Files that cannot be written, caused for real: a run's output (the run
directory's disk full on a small tmpfs, written by this process and by the
record writer process; a read-only file system; a path under a regular
file), the data directory (full, read-only), and a port another process
holds where ray.address points. Each ends in one line naming the path or
port and the fix; what a run wrote before stays readable, a last line
cut off mid-write dropped by the readers."""
from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from testbed.metrics import read_iterations, read_requests


@pytest.fixture
def mount(tmp_path):
    """mount(size, read_only) -> a fresh tmpfs of `size` under tmp_path (needs root)."""
    mounted = []

    def make(size: str, read_only: bool = False, mkdir: str | None = None) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the fault needs root")
        mounted.append(where)
        if mkdir:
            (where / mkdir).mkdir()
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def run(tmp_path: Path, run_dir: Path, *overrides: str) -> tuple[int, list[str]]:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    p = subprocess.run([sys.executable, "-m", "testbed.cli", "run", "runtime=sim", "model=llama3-8b",
                        "hardware=h100-sxm", "seed=1", f"hydra.run.dir={run_dir}", *overrides],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:") or "Traceback" in ln]
    return p.returncode, errors


@pytest.mark.parametrize("size, writer_after", [("48k", "null"), ("256k", "10")],
                         ids=["this-process", "record-writer-process"])
def test_a_full_disk_ends_in_one_line_and_the_records_stay_readable(tmp_path, mount, size, writer_after):
    run_dir = mount(size) / "run"
    code, errors = run(tmp_path, run_dir, "workload.num_requests=2000", f"runtime.record_writer_after={writer_after}")
    assert code == 2 and len(errors) == 1
    full = next(run_dir / f for f in ("iterations.jsonl", "requests.jsonl") if str(run_dir / f) in errors[0])
    assert errors == [f"error: the disk holding {full} is full (No space left on device); free space there or set "
                      "hydra.run.dir (hydra.sweep.dir for -m) to a disk with room; the records written before it "
                      f"are in {run_dir}"]
    assert not (run_dir / "summary.json").exists()
    # every whole record is read back; a line the full disk cut off is dropped
    texts = {f: (run_dir / f).read_text() for f in ("iterations.jsonl", "requests.jsonl")}
    assert sum(t.count("\n") for t in texts.values()) > 0
    assert len(read_iterations(run_dir / "iterations.jsonl")) == _whole_records(texts["iterations.jsonl"])
    assert len(read_requests(run_dir / "requests.jsonl")) == _whole_records(texts["requests.jsonl"])


def _whole_records(text: str) -> int:
    """Lines that end in a newline, and a last one without it whose record is
    whole (the disk filled between its closing brace and its newline)."""
    *ended, tail = text.split("\n")
    try:
        tail_whole = isinstance(json.loads(tail), dict)
    except json.JSONDecodeError:
        tail_whole = False
    return len(ended) + tail_whole


def test_a_read_only_output_directory_ends_in_one_line(tmp_path, mount):
    run_dir = mount("64k", read_only=True, mkdir="run") / "run"
    code, errors = run(tmp_path, run_dir, "workload.num_requests=2")
    assert code == 2
    assert errors == [f"error: cannot write '{run_dir / 'cli.log'}' (Read-only file system); set hydra.run.dir "
                      "(hydra.sweep.dir for -m) to a writable path whose names are each at most 255 bytes"]


def test_an_output_directory_that_cannot_be_made_ends_in_one_line(tmp_path, mount):
    for run_dir in (tmp_path / "a-file" / "run", mount("64k", read_only=True) / "run"):
        (tmp_path / "a-file").touch()
        code, errors = run(tmp_path, run_dir, "workload.num_requests=2")
        why = "Not a directory" if "a-file" in str(run_dir) else "Read-only file system"
        assert code == 2
        assert errors == [f"error: cannot create the output directory '{run_dir}' ({why}); set hydra.run.dir "
                          "(hydra.sweep.dir for -m) to a writable path whose names are each at most 255 bytes"]


def test_readers_drop_only_an_unterminated_last_line(tmp_path):
    run_dir = tmp_path / "run"
    code, errors = run(tmp_path, run_dir, "workload.num_requests=3")
    assert code == 0, errors
    path = run_dir / "iterations.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][:25])
    assert len(read_iterations(path)) == len(lines) - 1
    path.write_text("".join(lines[:-1]) + lines[-1][:25] + "\n")      # terminated: a bad line, not a cut one
    with pytest.raises(ValueError, match=f"^{path}:{len(lines)}: not valid JSON"):
        read_iterations(path)
    path.write_text(lines[0][:25] + "\n" + "".join(lines[1:]))        # a bad line before others
    with pytest.raises(ValueError, match=f"^{path}:1: not valid JSON"):
        read_iterations(path)


def test_a_data_directory_without_room_or_write_access_is_one_line_and_left_clean(tmp_path, mount):
    from testbed.data import DataError
    from testbed.data.importer import import_dataset
    src = Path(__file__).resolve().parents[2] / "shared" / "data" / "vidur-profiles"
    full = mount("1m")
    with pytest.raises(DataError) as e:
        import_dataset("vidur-profiles", src, data_dir=full)
    assert str(e.value) == (f"the data directory's disk is full ({full}); free space there or set $TESTBED_DATA "
                            "to a directory with room")
    assert list(full.iterdir()) == []
    read_only = mount("64k", read_only=True)
    with pytest.raises(DataError) as e:
        import_dataset("vidur-profiles", src, data_dir=read_only / "data")
    assert str(e.value) == (f"cannot write the data directory ({read_only / 'data'}: Read-only file system); set "
                            "$TESTBED_DATA to a writable directory")


# ---- a port already taken ---------------------------------------------------------

class _Http1(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(params=["silent", "http"])
def taken_port(request):
    """A port on 127.0.0.1 held by a process that is not a Ray head: a socket
    that listens and never answers, or an HTTP/1.1 server (as the dashboard's
    port, a usual mistake for the head's)."""
    if request.param == "silent":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]
        sock.close()
        return
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Http1)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_ray_address_on_a_port_another_process_holds_is_one_line_and_leaves_nothing(tmp_path, taken_port):
    """Ray itself retried such an address for minutes, printing GCS time-outs."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(Path(__file__).parent / "reaped.py"), sys.executable, "-m", "testbed.cli",
                        "run", "launcher=ray", "mode=disagg", f"ray.address=127.0.0.1:{taken_port}",
                        "workload.num_requests=2", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: ray.address: port {taken_port} on 127.0.0.1 is taken by a process that is not a Ray head (it does "
        "not answer as Ray's GCS); give the port `ray start --head` printed (6379 by default; not the dashboard's "
        f"8265), or free port {taken_port}, or leave ray.address unset for a local cluster"]
    assert json.loads(p.stdout.strip().splitlines()[-1])["leftover"] == []      # no Ray daemon, no worker
    assert (tmp_path / "run" / "requests.jsonl").read_text() == "" and not (tmp_path / "run" / "summary.json").exists()
