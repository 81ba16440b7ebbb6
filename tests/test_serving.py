"""Colocated serving on the real runtime: worker processes running the tiny
model, the frontend releasing requests on the wall clock, tokens streamed
back over ZMQ. One small workload (8 requests, prompts up to 160 tokens,
4-12 outputs) runs once under each scheduler; the tests read the run
directories it leaves: identical tokens across schedulers, the token budget
per iteration, every field of requests.jsonl / iterations.jsonl /
summary.json, clean shutdown. Then replicas behind both routers, Ctrl-C on
`testbed run`, and runtime=sim writing the same files."""
from __future__ import annotations

import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from testbed.config import RunConfig, from_dict
from testbed.run import execute
from testbed.runtime.build import apply_sampling
from testbed.runtime.real import RealRuntime
from testbed.schedulers import SCHEDULERS
from testbed.workloads.build import build_workload

REPO = Path(__file__).resolve().parents[1]
TOKEN_BUDGET = 48
WORKLOAD = {"name": "serving_test", "num_requests": 8, "arrival": "poisson", "rate": 20.0,
            "prompt_dist": "uniform", "prompt_min": 16, "prompt_max": 160,
            "output_dist": "uniform", "output_min": 4, "output_max": 12}

REQUEST_FIELDS = ("request_id", "status", "prompt_len", "output_token_ids", "arrival_s", "first_token_s",
                  "token_times_s", "finish_s", "num_preemptions")
ITERATION_FIELDS = ("start_s", "duration_s", "num_prefill_tokens", "num_decode_tokens", "kv_bytes_read")
LATENCY_KEYS = ("mean", "p50", "p90", "p99", "p999", "max")
FILES = {"config.yaml", "requests.jsonl", "iterations.jsonl", "summary.json"}


def config(**overrides) -> RunConfig:
    d = {"token_budget": TOKEN_BUDGET, "workload": WORKLOAD, "wandb": {"mode": "disabled"}, "progress": False,
         "timeout_s": 90}
    d.update(overrides)
    return from_dict(d)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tokens_by_request(records) -> dict[str, list[int]]:
    return {(r["request_id"] if isinstance(r, dict) else r.request_id):
            (r["output_token_ids"] if isinstance(r, dict) else r.output_token_ids) for r in records}


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of every live or zombie child of `pid`, from /proc, except
    multiprocessing's resource tracker (one per parent, for the parent's life)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and b"resource_tracker" not in cmdline:
            out.append((int(entry), state))
    return out


def in_process_group(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie waiting for init to reap it has exited."""
    try:
        state = Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


class TerminalRun:
    """`testbed run ARGS` in its own session (its own process group), stderr
    on a pseudo-terminal so that it shows progress, as in a terminal."""

    def __init__(self, cwd: Path, args: list[str], stdout=subprocess.DEVNULL):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([str(Path(sys.executable).with_name("testbed")), "run", *args], cwd=cwd,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=stdout, stderr=slave,
                                     start_new_session=True)
        os.close(slave)
        self.seen = b""

    def read(self, timeout_s: float = 0.05) -> None:
        """What the run printed within timeout_s (without blocking past it)."""
        import select
        if select.select([self.master], [], [], timeout_s)[0]:
            try:
                self.seen += os.read(self.master, 4096)
            except OSError:         # the run closed its terminal
                time.sleep(timeout_s)

    def requests_done(self) -> int:
        done = re.findall(rb"(\d+)/\d+ requests done", self.seen)
        return int(done[-1]) if done else 0

    def wait_until(self, ready, timeout_s: float = 90.0) -> None:
        """Read until ready() holds; fail if the run exits or timeout_s passes first."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert time.monotonic() < deadline and self.proc.poll() is None, self.text()[-2000:]
            self.read()

    def wait_exit(self, timeout_s: float) -> float:
        """Read (so that the run never blocks on its terminal) until it exits or
        timeout_s passes; the seconds that took."""
        start = time.monotonic()
        while self.proc.poll() is None and time.monotonic() - start < timeout_s:
            self.read()
        return time.monotonic() - start

    def text(self) -> str:
        return self.seen.decode(errors="replace")

    def close(self) -> None:
        """Kill whatever is left of the run's process group; close the terminal."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def cpu_hog():
    """Two busy loops, one per core, for the test's length (a signal
    must stop the run in time on a loaded machine too)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for h in hogs:
        h.kill()
        h.wait()


def cmdline(pid: int) -> str:
    try:
        return Path("/proc", str(pid), "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def expected_requests(cfg: RunConfig):
    reqs = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, reqs)
    return reqs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One run directory per scheduler (same workload and seed)."""
    base = tmp_path_factory.mktemp("serving")
    before = set(children(os.getpid()))
    out = {}
    for name in sorted(SCHEDULERS):
        out[name] = base / name
        execute(config(scheduler=name), out[name])
        left = set(children(os.getpid())) - before
        assert not left, f"{name}: worker processes left after the run: {left}"
    return out


def test_schedulers_generate_identical_tokens(runs):
    tokens = {name: tokens_by_request(read_jsonl(d / "requests.jsonl")) for name, d in runs.items()}
    expected = {r.request_id: r.max_tokens for r in expected_requests(config())}
    ref = tokens["sarathi"]
    assert {rid: len(t) for rid, t in ref.items()} == expected      # ignore_eos: exactly max_tokens each
    assert len({t for ts in ref.values() for t in ts}) > 10          # real text, not a constant
    for name, got in tokens.items():
        assert got == ref, f"{name} generated different tokens than sarathi"


def test_sarathi_never_exceeds_the_token_budget(runs):
    its = read_jsonl(runs["sarathi"] / "iterations.jsonl")
    sizes = [it["num_prefill_tokens"] + it["num_decode_tokens"] for it in its]
    assert max(sizes) == TOKEN_BUDGET                  # prompts up to 160 tokens: the budget is used in full
    reqs = expected_requests(config())
    # every prompt token and every fed-back output computed exactly once
    assert sum(it["num_prefill_tokens"] for it in its) == sum(r.prompt_len for r in reqs)
    assert sum(it["num_decode_tokens"] for it in its) == sum(r.max_tokens - 1 for r in reqs)
    # whole-prefill policies do put more than the budget in one iteration
    whole = read_jsonl(runs["vllm_v0"] / "iterations.jsonl")
    assert max(it["num_prefill_tokens"] for it in whole) >= max(r.prompt_len for r in reqs) > TOKEN_BUDGET
    assert all(it["num_prefill_tokens"] == 0 or it["num_decode_tokens"] == 0 for it in whole)


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_run_directory_has_every_field(runs, scheduler):
    d = runs[scheduler]
    assert FILES <= {p.name for p in d.iterdir()}
    reqs = {r.request_id: r for r in expected_requests(config())}
    records = read_jsonl(d / "requests.jsonl")
    assert [r["request_id"] for r in records] == list(reqs)
    for rec in records:
        assert set(REQUEST_FIELDS) <= set(rec), set(REQUEST_FIELDS) - set(rec)
        want = reqs[rec["request_id"]]
        assert (rec["status"], rec["prompt_len"], rec["num_preemptions"]) == ("finished", want.prompt_len, 0)
        times = rec["token_times_s"]
        assert len(times) == len(rec["output_token_ids"]) == want.max_tokens
        assert rec["first_token_s"] == times[0]
        assert rec["arrival_s"] < times[0] and times == sorted(times) and times[-1] <= rec["finish_s"]
    for it in read_jsonl(d / "iterations.jsonl"):
        assert set(ITERATION_FIELDS) <= set(it)
        assert it["duration_s"] > 0 and it["num_prefill_tokens"] + it["num_decode_tokens"] > 0
        assert it["kv_bytes_read"] > 0

    summary = json.loads((d / "summary.json").read_text())
    for key in ("ttft_ms", "tbt_ms", "tpot_ms", "e2e_ms"):
        assert set(LATENCY_KEYS) <= set(summary[key]), key
        s = summary[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"] <= s["p999"] <= s["max"], (key, s)
    assert {"requests_per_s", "output_tokens_per_s"} <= set(summary["throughput"])
    assert (summary["num_requests"], summary["num_finished"], summary["num_preemptions"]) == (8, 8, 0)
    for key in ("goodput", "fluidity_index"):
        assert isinstance(summary[key], float), key
    # the summary is computed from the records it sits next to
    ttft_max = max((r["first_token_s"] - r["arrival_s"]) * 1000 for r in records)
    assert summary["ttft_ms"]["max"] == pytest.approx(ttft_max)
    tput = sum(len(r["output_token_ids"]) for r in records) / summary["duration_s"]
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(tput)
    assert summary["scheduler"] == scheduler and summary["interrupted"] is False
    assert summary["kv_blocks_leaked"] == {} and summary["workers"]["replica0"]["all_free"]


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
def test_replicas_serve_everything_with_the_same_tokens(runs, router):
    """Two worker processes behind the router; afterwards no process is left and
    the frontend's ports are free again."""
    cfg = config(replicas=2, router=router)
    ports: set[int] = set()

    def capture_ports(rt: RealRuntime, ev: dict) -> None:
        if not ports:
            for sock in (rt.cmd, rt.events):
                ports.add(int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]))

    before = set(children(os.getpid()))
    requests = expected_requests(cfg)
    result = RealRuntime(cfg, on_event=capture_ports).run(requests)
    assert set(children(os.getpid())) <= before, "worker processes left after the run"
    assert len(ports) == 2 and all(port_is_free(p) for p in ports), ports

    assert [r.status for r in result.records] == ["finished"] * len(requests)
    ref = tokens_by_request(read_jsonl(runs["sarathi"] / "requests.jsonl"))
    assert tokens_by_request(result.records) == ref
    assert set(result.worker_stats) == {"replica0", "replica1"}
    assert all(s["all_free"] for s in result.worker_stats.values())
    prefill = {w: sum(it.num_prefill_tokens for it in result.iterations if it.worker == w)
               for w in ("replica0", "replica1")}
    assert sum(prefill.values()) == sum(r.prompt_len for r in requests)
    if router == "round_robin":                 # r0, r2, ... to replica0; r1, r3, ... to replica1
        assert prefill == {"replica0": sum(r.prompt_len for r in requests[0::2]),
                           "replica1": sum(r.prompt_len for r in requests[1::2])}
    else:
        assert min(prefill.values()) > 0


def test_ctrl_c_writes_what_was_measured_and_leaves_no_process(tmp_path, cpu_hog):
    """`testbed run` in its own session with stderr on a pseudo-terminal (so it
    shows progress), two busy loops beside it; once 3 requests are done, SIGINT
    goes to its whole process group, as a terminal's Ctrl-C does, and the run
    exits within 10 s (the bound; the seconds are printed for
    experiments/benchmarks/repeat_ctrl_c.py)."""
    out = tmp_path / "run"
    with open(tmp_path / "stdout", "wb") as stdout_file:
        run = TerminalRun(tmp_path, ["workload=chat", "workload.num_requests=400", "workload.rate=4",
                                     "wandb.mode=disabled", f"hydra.run.dir={out}"], stdout=stdout_file)
    proc = run.proc
    try:
        run.wait_until(lambda: run.requests_done() >= 3, 120)
        os.killpg(proc.pid, signal.SIGINT)
        took = run.wait_exit(30)
        print(f"Ctrl-C: exit {proc.poll()} {took:.2f} s after the signal")
        stdout = (tmp_path / "stdout").read_bytes()
        assert took < 10, f"exited {took:.1f} s after Ctrl-C\n{run.text()[-2000:]}"
        assert proc.wait(1) == 130, f"an interrupted run exits 130, got {proc.returncode}"
    finally:
        run.close()
    # multiprocessing's resource tracker exits when it sees its parent's pipe close: allow it a moment
    left, grace = in_process_group(proc.pid), time.monotonic() + 5
    while left and time.monotonic() < grace:
        time.sleep(0.1)
        left = in_process_group(proc.pid)
    assert left == [], f"processes of the run outlived it: {[cmdline(p) for p in left]}"

    records = read_jsonl(out / "requests.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    finished = [r for r in records if r["status"] == "finished"]
    rest = [r for r in records if r["status"] != "finished"]
    assert len(finished) >= 3 and len(records) < 400, stdout.decode()
    assert all(r["status"] == "aborted" and r["error"] == "interrupted (Ctrl-C)" for r in rest), rest
    assert all(len(r["output_token_ids"]) == len(r["token_times_s"]) for r in records)
    assert summary["interrupted"] is True
    assert (summary["num_finished"], summary["num_aborted"]) == (len(finished), len(rest))
    # the workers stopped cleanly and reported every KV block free (aborts released theirs)
    assert summary["workers"]["replica0"]["all_free"] and summary["kv_blocks_leaked"] == {}


def test_sim_runtime_writes_the_same_files_and_keys(runs, tmp_path):
    execute(config(runtime={"name": "sim"}), tmp_path)
    real = runs["sarathi"]
    assert {p.name for p in tmp_path.iterdir()} == {p.name for p in real.iterdir()}
    sim_summary = json.loads((tmp_path / "summary.json").read_text())
    real_summary = json.loads((real / "summary.json").read_text())
    assert set(sim_summary) == set(real_summary)
    for key in ("ttft_ms", "tbt_ms", "tpot_ms", "e2e_ms", "throughput"):
        assert set(sim_summary[key]) == set(real_summary[key]), key
    sim_recs, real_recs = read_jsonl(tmp_path / "requests.jsonl"), read_jsonl(real / "requests.jsonl")
    assert [set(r) for r in sim_recs] == [set(r) for r in real_recs]
    # same requests, same scheduler: the same shape of work (the sim samples placeholder tokens)
    assert [(r["request_id"], r["prompt_len"], len(r["output_token_ids"]), r["status"]) for r in sim_recs] == \
        [(r["request_id"], r["prompt_len"], len(r["output_token_ids"]), r["status"]) for r in real_recs]
    sim_its, real_its = read_jsonl(tmp_path / "iterations.jsonl"), read_jsonl(real / "iterations.jsonl")
    assert set(sim_its[0]) == set(real_its[0])
    for key in ("num_prefill_tokens", "num_decode_tokens"):
        assert sum(it[key] for it in sim_its) == sum(it[key] for it in real_its), key
    assert max(it["num_prefill_tokens"] + it["num_decode_tokens"] for it in sim_its) == TOKEN_BUDGET


def test_a_request_larger_than_the_kv_cache_fails_at_once(tmp_path):
    """8 blocks of 16 slots = 128 tokens: the longer requests can never fit and
    fail with an error naming the knob; the rest are served."""
    summary = execute(config(runtime={"name": "sim"}, num_kv_blocks=8), tmp_path)
    records = read_jsonl(tmp_path / "requests.jsonl")
    reqs = {r.request_id: r for r in expected_requests(config())}
    for r in records:
        want = reqs[r["request_id"]]
        fits = -(-(want.prompt_len + want.max_tokens - 1) // 16) <= 8
        if fits:
            assert r["status"] == "finished", r
        else:
            assert r["status"] == "failed" and "num_kv_blocks" in r["error"] and r["output_token_ids"] == [], r
    assert 0 < summary["num_failed"] < 8
