"""mode=kvstore against mode=disagg, and the cache-aware router against the
load-only ones, on a multi-turn chat workload (testbed/workloads/multiturn.py).
Prints tables; never part of the test run.

    python experiments/benchmarks/bench_kvstore.py sim       # llama3-8b, h100-sxm, 2P2D, rdma-400
    python experiments/benchmarks/bench_kvstore.py capacity  # the same, highest rate within the SLOs, per GPU
    python experiments/benchmarks/bench_kvstore.py routers   # cache_aware vs round_robin vs least_prompt_tokens
    python experiments/benchmarks/bench_kvstore.py real      # tiny on this CPU, real processes, 1P1D and 2P1D
    python experiments/benchmarks/bench_kvstore.py speed     # the simulator's own speed on a Mooncake-like trace
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed.config import RunConfig
from testbed.model.config import CONF_DIR

GPU = ["model=llama3-8b", "hardware=h100-sxm", "link=rdma-400", "runtime=sim", "prefill_workers=2",
       "decode_workers=2", "token_budget=2048", "slo.ttft_ms=2000", "slo.tpot_ms=100",
       "num_kv_blocks=28000",   # ~450K tokens: what an 80 GB H100 holds beside llama3-8b's 16 GB
       "kvstore.capacity_bytes=1099511627776"]   # 1 TiB of DRAM in the store node (8M tokens of llama3-8b)
# 60% of prompt tokens reusable: 300 conversations of 4 turns, each 70% its previous prompt; first turns ~2K
CHAT = ["workload.conversation_turns=4", "workload.reuse_fraction=0.7", "workload.think_time_s=20",
        "workload=chat", "workload.num_requests=1200", "workload.prompt_dist=lognormal", "workload.prompt_len=2000",
        "workload.prompt_min=256", "workload.prompt_max=8192", "workload.output_len=128",
        "workload.output_min=16", "workload.output_max=512", "workload.hash_block_size=16",
        "workload.max_prompt_len=32768"]
REAL = ["workload.conversation_turns=4", "workload.reuse_fraction=0.75", "workload.think_time_s=2",
        "workload=chat", "workload.num_requests=40", "workload.rate=1.0", "workload.prompt_dist=uniform",
        "workload.prompt_min=128", "workload.prompt_max=384", "workload.output_min=4", "workload.output_max=16",
        "workload.hash_block_size=16", "workload.max_prompt_len=2048", "token_budget=128"]
COMMON = ["wandb.mode=disabled", "progress=false"]


def compose(overrides: list[str]) -> RunConfig:
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(hydra_compose("config", overrides))


def run(overrides: list[str], out: Path) -> dict:
    from testbed.run import execute
    return execute(compose(COMMON + overrides), out)


def row(label: str, s: dict) -> tuple:
    pc = s.get("prefix_cache") or {}
    hit = pc.get("prefix_cache_hit_rate")
    return (label, f"{s['ttft_ms']['p50']:.1f}", f"{s['ttft_ms']['p99']:.1f}", f"{s['tbt_ms']['p99']:.1f}",
            f"{s['goodput']:.2f}", "-" if hit is None else f"{hit:.3f}",
            "-" if not pc else f"{pc['store_hit_rate']:.3f}", str(s.get("num_rejected", 0)))


HEAD = ("config", "TTFT p50 ms", "TTFT p99 ms", "TBT p99 ms", "goodput req/s", "hit rate", "store hit", "rejected")


def table(rows: list[tuple], head: tuple = HEAD) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths)))


def reuse_of(overrides: list[str]) -> float:
    import numpy as np

    from testbed.workloads.multiturn import block_reuse, multiturn_rows
    cfg = compose(COMMON + overrides)
    rows = multiturn_rows(cfg.workload, [np.random.default_rng([cfg.seed, s]) for s in range(3)])
    return block_reuse(rows, cfg.block_size)


def sim(args) -> None:
    out = Path(args.out)
    rate = [f"workload.rate={args.rate}"]
    print(f"multi-turn chat, {reuse_of(GPU + CHAT + rate):.1%} of prompt tokens reusable (hash ids), "
          f"{args.rate} conversations/s, llama3-8b h100-sxm 2P2D rdma-400")
    disagg = run(GPU + CHAT + rate + ["mode=disagg"], out / "disagg")
    kv = run(GPU + CHAT + rate + ["mode=kvstore"], out / "kvstore")
    table([row("disagg", disagg), row("kvstore", kv)])
    print(f"TTFT p50: disagg / kvstore = {disagg['ttft_ms']['p50'] / kv['ttft_ms']['p50']:.2f}x")


def capacity(args) -> None:
    from testbed.capacity import find_capacity
    out = Path(args.out)
    rows = []
    for mode in ("disagg", "kvstore"):
        cfg = compose(COMMON + GPU + CHAT + [f"workload.rate={args.rate}", f"mode={mode}"])
        res = find_capacity(cfg, out / f"cap-{mode}", rel_tol=0.1, max_probes=10, log=lambda m: None)
        gpus = cfg.prefill_workers + cfg.decode_workers
        rows.append((mode, f"{res.rate:.3g}" if res.rate else "none", str(gpus),
                     f"{res.rate / gpus:.3g}" if res.rate else "-", str(len(res.probes))))
    table(rows, ("mode", "capacity req/s", "GPUs", "per GPU", "probes"))


def routers(args) -> None:
    out = Path(args.out)
    rows = []
    for router in ("cache_aware", "round_robin", "least_prompt_tokens"):
        s = run(GPU + CHAT + [f"workload.rate={args.rate}", "mode=kvstore", f"kvstore.prefill_router={router}"],
                out / router)
        rows.append(row(router, s))
    table(rows)


def real(args) -> None:
    """Disagg's prefill workers have prefix caches of their own: with one, the
    store adds no reuse (only its cost); with two, it serves what the other computed."""
    out = Path(args.out)
    print(f"tiny on this CPU, real processes, multi-turn chat, {reuse_of(REAL):.1%} reusable")
    rows = []
    for pd in ("1", "2"):
        layout = [f"prefill_workers={pd}", "decode_workers=1"]
        disagg = run(REAL + layout + ["mode=disagg"], out / f"disagg-{pd}P1D")
        kv = run(REAL + layout + ["mode=kvstore"], out / f"kvstore-{pd}P1D")
        rows += [row(f"disagg {pd}P1D", disagg), row(f"kvstore {pd}P1D", kv)]
        print(f"{pd}P1D TTFT p50: disagg / kvstore = {disagg['ttft_ms']['p50'] / kv['ttft_ms']['p50']:.2f}x")
    table(rows)


# the simulator-speed runs: a 12K-request trace with Mooncake's conversation statistics
SPEED_TRACE = ["runtime=sim", "hardware=h100-sxm", "model=llama3-8b", "token_budget=2048", "enable_prefix_caching=true",
               "workload=azure_code", "workload.trace_format=mooncake", "workload.time_scale=1",
               "workload.max_prompt_len=200000", "workload.max_output_len=100000", "wandb.mode=disabled",
               "progress=false"]
SPEED_CASES = {"colocated": ["mode=colocated", "replicas=8", "scheduler=sarathi"],          # sarathi, 8 replicas
               "kvstore": ["mode=kvstore", "prefill_workers=2", "decode_workers=2", "link=rdma-400"]}   # 2P2D


def _rss_kb(pid: int) -> dict[str, int]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines) if k in ("VmRSS", "VmHWM")}


def _tree_rss_kb(pid: int) -> int:
    """The resident memory of the process and all its descendants (the record
    writer; with runtime.sim_processes, the parts and their writers)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _rss_kb(p).get("VmRSS", 0)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return total


def _speed_run(overrides: list[str], out: Path, num_requests: int) -> dict:
    """One `testbed run` in a subprocess: wall time, iterations, peak RSS, and
    the RSS when 25/50/75/100% of the requests had been written (requests.jsonl
    grows in arrival order as they end)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "testbed.cli", "run", *overrides, f"hydra.run.dir={out}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out / "stderr.log", "w"))
    marks, quarter, done, read_at, peak, tree_peak = {}, 1, 0, 0, 0, 0
    requests = out / "requests.jsonl"
    while child.poll() is None:
        time.sleep(0.25)
        rss = _rss_kb(child.pid)
        peak = max(peak, rss.get("VmHWM", 0))
        tree_peak = max(tree_peak, _tree_rss_kb(child.pid))
        if requests.exists():
            with open(requests, "rb") as f:
                f.seek(read_at)
                chunk = f.read()
            done += chunk.count(b"\n")
            read_at += len(chunk)
        while quarter <= 4 and done >= quarter * num_requests / 4:
            marks[quarter * 25] = rss.get("VmRSS", 0) / 1024
            quarter += 1
    wall = time.perf_counter() - start
    if child.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed; see {out / 'stderr.log'}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    iterations = sum(1 for _ in open(out / "iterations.jsonl", "rb"))
    return {"wall_s": wall, "cpu_s": cpu, "iterations": iterations, "peak_rss_mb": peak / 1024,
            "tree_peak_rss_mb": tree_peak / 1024, "rss_mb_at": marks}


def speed(args) -> None:
    """Wall seconds, iterations, µs per iteration and peak RSS of simulating
    the trace, and the RSS as the run goes (flat: it holds what is in
    flight, never the run). Run each case twice: the spread is the noise."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"mooncake-like-{args.requests}.jsonl"
    here = Path(__file__).resolve().parent
    subprocess.run([sys.executable, str(here / "mooncake_like_trace.py"), str(trace), "--requests",
                    str(args.requests)], check=True)
    workload = SPEED_TRACE + [f"workload.trace_path={trace}", f"workload.max_requests={args.requests}",
                              f"runtime.sim_fast_forward={str(not args.no_fast_forward).lower()}"]
    # runtime.sim_processes applies to the colocated case (round robin, no frontend hop); kvstore runs in one
    processes = args.sim_processes or [1]
    rows = []
    # attempts outermost: each configuration's runs alternate with the others' (drift hits them alike)
    for attempt in range(args.repeat):
        for label in args.cases or list(SPEED_CASES):
            for n in processes if label == "colocated" else [1]:
                load = os.getloadavg()[0]
                name = f"{label}-p{n}-{attempt}"
                r = _speed_run(workload + SPEED_CASES[label] + [f"runtime.sim_processes={n}"], out / name,
                               args.requests)
                at = " ".join(f"{r['rss_mb_at'].get(q, 0):.0f}" for q in (25, 50, 75, 100))
                rows.append((label, str(n), f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", f"{r['iterations']:,}",
                             f"{r['wall_s'] / r['iterations'] * 1e6:.1f}", f"{r['peak_rss_mb']:.0f}",
                             f"{r['tree_peak_rss_mb']:.0f}", at, f"{load:.1f}-{os.getloadavg()[0]:.1f}"))
                print(" | ".join(rows[-1]), flush=True)
    # CPU s (the child's user + system time) is what a busy machine inflates least
    table(rows, ("case", "processes", "wall s", "CPU s", "iterations", "µs/iteration (wall)", "peak RSS MB (main)",
                 "peak RSS MB (all processes)", "RSS MB at 25/50/75/100% (main)", "load avg (start-end)"))
    print(f"children's peak RSS (getrusage): {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MB")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("sim", "capacity", "routers", "real", "speed"))
    p.add_argument("--rate", type=float, default=6.0, help="requests/s (sim, capacity's first probe, routers)")
    p.add_argument("--out", default=tempfile.mkdtemp(prefix="bench-kvstore-"))
    p.add_argument("--requests", type=int, default=12_000, help="speed: the trace's length")
    p.add_argument("--repeat", type=int, default=2, help="speed: runs of each case (their spread is the noise)")
    p.add_argument("--no-fast-forward", action="store_true", help="speed: runtime.sim_fast_forward=false")
    p.add_argument("--cases", nargs="*", choices=sorted(SPEED_CASES), help="speed: only these cases")
    p.add_argument("--sim-processes", nargs="*", type=int,
                   help="speed: the colocated case with each runtime.sim_processes given (default 1)")
    args = p.parse_args()
    {"sim": sim, "capacity": capacity, "routers": routers, "real": real, "speed": speed}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
