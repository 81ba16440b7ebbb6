"""`testbed run -m hydra/launcher=ray` (testbed/launchers/hydra_ray, installed as hydra_plugins.testbed_ray_launcher):
three simulator points as Ray tasks on a local cluster that lives in a
private, loopback-only network namespace, one point deliberately failing.
Every point's run directory exists, the good ones with their summary, the
bad one with its failed.json; the points ran in Ray workers; while the sweep
runs, every listening socket of every process of the sweep is on loopback
(read from /proc, whatever namespace the process is in); after it, nothing
is left running (tests/reaped.py adopts and reports what would be)."""
from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reaped import descendants
from test_wandb_sweeps import REPO, SMALL, points

HERE = Path(__file__).parent
LISTEN = "0A"        # TCP_LISTEN in /proc/net/tcp

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sweep's private network namespace needs root")


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s 'ADDR:PORT' address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr.split(":")[0])
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def on_loopback(addr) -> bool:
    return addr.is_loopback or bool(getattr(addr, "ipv4_mapped", None) and addr.ipv4_mapped.is_loopback)


def listening(pid: int) -> set[tuple]:
    """(address, port) of the TCP sockets process `pid` holds and listens on."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    out = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == LISTEN and f[9] in inodes:
                out.add((_address(f[1]), int(f[1].rsplit(":", 1)[1], 16)))
    return out


@pytest.mark.slow          # ~40-60 s here: a local Ray cluster started and stopped, three points
def test_ray_runs_the_points_as_tasks_on_loopback_and_records_the_failed_one(tmp_path):
    sweep = tmp_path / "sweep"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.environ.get("PYTHONPATH") or str(REPO),
               WANDB_MODE="disabled")
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, str(HERE / "reaped.py"), sys.executable, "-m", "testbed.cli", "run",
                                 "-m", "hydra/launcher=ray", "hydra.launcher.num_cpus=2", *SMALL,
                                 "wandb.mode=disabled", "workload.rate=20,0,40", f"hydra.sweep.dir={sweep}"],
                                cwd=tmp_path, env=env, stdout=out, stderr=err)
        seen: set[tuple] = set()
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in descendants(proc.pid):
                seen |= listening(pid)
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert proc.wait() == 0, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["leftover"] == [], "processes outlived the sweep"

    assert seen, "no listening socket seen: Ray's servers were never up, or /proc was misread"
    assert all(on_loopback(addr) for addr, _ in seen), f"listening beyond loopback: {sorted(map(str, seen))}"

    ok, bad, ok2 = points(sweep)
    for point in (ok, ok2):
        summary = json.loads((point / "summary.json").read_text())
        assert summary["num_finished"] == summary["num_requests"] == 3
        assert not (point / "failed.json").exists()
    assert not (bad / "summary.json").exists()
    assert json.loads((bad / "failed.json").read_text()) == {"error": "ValueError: workload.rate: must be > 0, got 0.0"}
    # the points ran as Ray tasks, in Ray worker processes (Ray prefixes their output with the task's name)
    workers = set(re.findall(r"\(run_point pid=(\d+)\)", stdout + stderr))
    assert workers and str(proc.pid) not in workers, (stdout + stderr)[-3000:]
