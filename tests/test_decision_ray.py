"""The decision study's sweeps as Ray tasks (testbed/experiments/decision_ray.py)
on a real local cluster bound to loopback, two workers, on the constructed
case of decision_case.py through `testbed run`: the same files as the serial
run, byte for byte but for the timing fields; a worker SIGKILLed mid-sweep
is retried and the files stay the same; a sweep whose worker dies on both
tries comes back as rows flagged worker_died while the other sweep's rows
stand. After each run no process of it is left (tests/reaped.py adopts and
reports what would be)."""
from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decision_case import DATA, GRID, read_rows
from reaped import descendants

HERE = Path(__file__).parent
REPO = HERE.parent
# the timing fields: the only ones that differ between runs (decision.py says so)
TIMING_COLUMNS = ("wall_s", "cpu_s", "load_1m")
TIMING_KEYS = ("elapsed_s", "probe_cpu_s", "probe_wall_s")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the local cluster's private network namespace needs root")

STUDY = ["experiment=decision", "runtime=sim", "model=tiny", "hardware=cpu", "max_num_batched_tokens=1100",
         "wandb.mode=disabled", "experiment.models=[tiny]",
         f"experiment.hardware=['{DATA / 'decision_hardware.yaml'}']",
         f"experiment.links=['{DATA / 'decision_link.yaml'}','{DATA / 'decision_link_b.yaml'}']",
         f"experiment.context_lens=[{','.join(map(str, GRID))}]", "experiment.token_budgets=[1100]",
         "experiment.colocated=[sarathi]", "experiment.ttft_k=3.5", "experiment.tbt_slos_ms=[50]",
         "experiment.output_len=16", "experiment.prompt_sigma=0.001", "experiment.rate_start=20.0",
         "experiment.max_requests_per_gpu=1000"]
# the grid's two sweeps: sarathi-1100 (index 0, once for both links) and disagg-1P1D (index 1, per link)
DISAGG = "ray::decision-sweep-1"
KILL_AFTER_S = 1.0          # the disagg sweep runs 2-4 s here


def study(out: Path, parallel: str, kill: str = "", kills: int = 0, *extra: str,
          env: dict | None = None, ready=None) -> tuple[str, list[int]]:
    """`testbed run` of the study under reaped.py; with `kill`, SIGKILL the first `kills`
    processes seen under that title (a Ray worker running that sweep) once seen for KILL_AFTER_S
    (past the task's start: some of its probes made) and `ready(pid)` holds. Its log and the pids killed."""
    env = dict(env or os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.environ.get("PYTHONPATH") or str(REPO))
    with open(out.with_suffix(".out"), "w") as stdout:
        proc = subprocess.Popen([sys.executable, str(HERE / "reaped.py"), sys.executable, "-m", "testbed.cli", "run",
                                 *STUDY, f"experiment.parallel={parallel}", f"hydra.run.dir={out}", *extra],
                                cwd=out.parent, env=env, stdout=stdout, stderr=subprocess.STDOUT)
        killed: list[int] = []
        seen: dict[int, float] = {}
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and len(killed) < kills:
            for pid in descendants(proc.pid):
                try:
                    title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
                except OSError:
                    continue
                if title == kill and pid not in killed:
                    if time.monotonic() - seen.setdefault(pid, time.monotonic()) >= KILL_AFTER_S and \
                            (ready is None or ready(pid)):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            time.sleep(0.05)
        try:
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    log = out.with_suffix(".out").read_text()
    assert rc == 0, log[-3000:]
    assert json.loads(log.strip().splitlines()[-1])["leftover"] == [], "processes outlived the study"
    return log, killed


def without_timing(out: Path, cached: str = "False") -> dict[str, bytes]:
    """Every file the study wrote, its timing fields removed (decision_probes.csv's columns, the
    summaries' keys); the rest as written."""
    files = {}
    for path in sorted(out.iterdir()):
        if path.name == "cli.log" or path.is_dir():
            continue
        data = path.read_bytes()
        if path.name == "decision_probes.csv":
            rows = [{k: v for k, v in r.items() if k not in TIMING_COLUMNS}
                    for r in csv.DictReader(io.StringIO(data.decode()))]
            assert rows and all(r.pop("cached") == cached for r in rows)
            data = json.dumps(rows).encode()
        elif path.suffix == ".json":
            d = json.loads(data)
            for k in TIMING_KEYS:
                assert k in d or path.name != "decision_summary.json", k
                d.pop(k, None)
            data = json.dumps(d, sort_keys=True).encode()
        files[path.name] = data
    return files


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("serial") / "study"
    log, _ = study(out, "1")
    assert "as Ray tasks" not in log
    return without_timing(out)


def test_two_ray_workers_write_the_serial_runs_files(serial, tmp_path):       # ~25 s here
    log, _ = study(tmp_path / "study", "2")
    assert "decision: 2 sweeps as Ray tasks on 2 CPUs" in log
    files = without_timing(tmp_path / "study")
    assert sorted(files) == sorted(serial) and len([n for n in files if n.endswith(".png")]) == 6
    for name in serial:
        assert files[name] == serial[name], name
    # byte for byte as written, timing fields and all: the rows, the figures
    assert (tmp_path / "study" / "decision.csv").read_bytes() == serial["decision.csv"]


def test_a_worker_killed_mid_sweep_is_retried_and_the_files_stay_the_same(serial, tmp_path):     # ~25 s here
    log, killed = study(tmp_path / "study", "2", kill=DISAGG, kills=1)
    assert len(killed) == 1, "the disagg sweep's worker was never seen running"
    assert all(not Path(f"/proc/{pid}").exists() for pid in killed)
    files = without_timing(tmp_path / "study")
    for name in serial:
        assert files[name] == serial[name], name
    assert "worker_died" not in log


def test_a_sweep_whose_worker_dies_twice_is_flagged_and_the_study_goes_on(serial, tmp_path):     # ~25 s here
    log, killed = study(tmp_path / "study", "2", kill=DISAGG, kills=2)
    assert len(killed) == 2
    rows = read_rows(tmp_path / "study" / "decision.csv")
    serial_rows = list(csv.DictReader(io.StringIO(serial["decision.csv"].decode())))
    died = [r for r in rows if r["deployment"] == "disagg-1P1D"]
    # 2 links x 4 L x 2 SLO definitions, none probed
    assert len(died) == 16 and all((r["limited_by"], r["capacity_per_gpu"], r["probes"], r["steady"])
                                   == ("worker_died", "", "0", "False") for r in died)
    assert [r for r in rows if r["deployment"] != "disagg-1P1D"] == \
        [r for r in serial_rows if r["deployment"] != "disagg-1P1D"]
    summary = json.loads((tmp_path / "study" / "decision_summary.json").read_text())
    assert summary["worker_died_rows"] == 16
    assert "decision: sweep tiny/fixed-10ms/N2 disagg-1P1D: its worker died twice; its 16 rows are flagged " \
           "worker_died" in log


def test_the_probe_cache_resumes_a_parallel_run_cut_by_a_dead_worker(serial, tmp_path):         # ~35 s here
    """A parallel run (one worker killed: its sweep's probes so far in the cache, then run again)
    fills the cache; a serial resume and a parallel one replay every probe and write the same files."""
    cache = f"experiment.probe_cache={tmp_path / 'cache'}"

    def probed(pid: int) -> bool:       # the worker to kill has cached a probe (its own file, by pid)
        return any(p.stat().st_size for p in (tmp_path / "cache").glob(f"*-{pid}-*.jsonl"))
    _, killed = study(tmp_path / "first", "2", DISAGG, 1, cache, ready=probed)
    assert len(killed) == 1
    probes = read_rows(tmp_path / "first" / "decision_probes.csv")
    # the retried sweep replayed what the killed one had probed: cached rows, in its sweep only
    assert {p["key"].split("/")[3] for p in probes if p["cached"] == "True"} == {"disagg-1P1D"}
    assert read_rows(tmp_path / "first" / "decision.csv") == \
        list(csv.DictReader(io.StringIO(serial["decision.csv"].decode())))
    for parallel in ("1", "2"):
        log, _ = study(tmp_path / f"resumed-{parallel}", parallel, "", 0, cache)
        summary = json.loads((tmp_path / f"resumed-{parallel}" / "decision_summary.json").read_text())
        assert summary["num_probe_runs"] == 0 and summary["num_replayed_probes"] > 0, log[-2000:]
        files = without_timing(tmp_path / f"resumed-{parallel}", cached="True")
        assert files.keys() == serial.keys()
        for name in serial:
            if name not in ("decision_summary.json", "experiment.json"):   # they count the replays
                assert files[name] == serial[name], name


def test_a_study_joins_a_running_cluster_and_leaves_it_running(serial, tmp_path):             # ~35 s here
    from ray_cluster import RayCluster
    cluster = RayCluster(num_cpus=2)
    try:
        cluster.wait_nodes(1)
        log, _ = study(tmp_path / "study", "auto", "", 0, f"ray.address={cluster.address}", env=cluster.env)
        assert f"decision: 2 sweeps as Ray tasks on 2 CPUs of the cluster at {cluster.address}" in log
        assert without_timing(tmp_path / "study") == serial
        cluster.wait_nodes(1, timeout_s=10)          # still up: the study only left it
    finally:
        cluster.stop()


def test_ctrl_c_mid_study_leaves_no_ray_process(tmp_path):                                      # ~15 s here
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.environ.get("PYTHONPATH") or str(REPO))
    out = tmp_path / "study"
    with open(tmp_path / "study.out", "w") as stdout:
        proc = subprocess.Popen([sys.executable, str(HERE / "reaped.py"), sys.executable, "-m", "testbed.cli", "run",
                                 *STUDY, "experiment.parallel=2", f"hydra.run.dir={out}"],
                                cwd=tmp_path, env=env, stdout=stdout, stderr=subprocess.STDOUT)
        interrupted, deadline = False, time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and not interrupted:
            pids = descendants(proc.pid)
            titles = {}
            for pid in pids:
                try:
                    titles[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    pass
            if any(t[0] == DISAGG.encode() for t in titles.values()):      # the sweeps are running
                study_pid = next(p for p, t in titles.items() if b"testbed.cli" in t)
                os.kill(study_pid, signal.SIGINT)
                interrupted = True
            time.sleep(0.05)
        rc = proc.wait(60)
    log = (tmp_path / "study.out").read_text()
    assert interrupted and rc == 130, log[-3000:]
    assert "interrupted" in log
    assert json.loads(log.strip().splitlines()[-1])["leftover"] == [], "Ray processes outlived the study"
