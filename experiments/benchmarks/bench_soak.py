"""Soak: does any process of a run grow with the number of requests it served?

Real (default): N requests (10,000) through the real runtime, tiny model,
mode=disagg 1P1D over zmq, short prompts and outputs at a rate this CPU
sustains. A thread samples the VmRSS of the frontend (this process) and of
each worker process (/proc/PID/status) every --sample-s seconds, beside the
number of requests ended so far. Per process it prints the RSS after warm-up
(the first 10% of requests excluded), the least-squares slope in MiB per
1,000 requests with its standard error (the noise floor of one run), and
the run's KV blocks leaked and requests lost (not finished), plus what the
frontend still holds per request at the end (every map should be empty).

--sim N: N requests (1,000,000) through runtime=sim instead, a cheap
synthetic workload pulled lazily; the same RSS series for the one process,
its peak RSS, the wall time of the run and of the summary.

Target: every slope < 1 MiB per 1,000 requests, 0 leaked, 0 lost. Writes
soak.json (the figures and every sample) to --out.

  python experiments/benchmarks/bench_soak.py --requests 2000 --out /tmp/soak
  python experiments/benchmarks/bench_soak.py --sim 1000000 --out /tmp/soak-sim
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time
from pathlib import Path

import numpy as np

from testbed.config import RunConfig
from testbed.runtime.build import sampled
from testbed.workloads.build import iter_workload

MIB = 2 ** 20


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """Every `interval_s`: (seconds, requests ended, {process: RSS bytes}) for
    the processes `pids()` names, until `total` requests have ended (what
    shutdown frees or exits is not the run's growth)."""

    def __init__(self, pids, ended, interval_s: float, total: int):
        super().__init__(daemon=True)
        self.pids, self.ended, self.interval_s, self.total = pids, ended, interval_s, total
        self.samples: list[tuple[float, int, dict[str, int]]] = []
        self._done = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.sample()
            if self.samples[-1][1] >= self.total:
                return

    def sample(self) -> None:
        rss = {name: b for name, pid in self.pids().items() if (b := rss_bytes(pid)) is not None}
        self.samples.append((time.monotonic() - self.t0, self.ended(), rss))

    def stop(self) -> None:
        self._done.set()
        self.join()


def slopes(samples, num_requests: int, warmup: float = 0.1) -> dict[str, dict]:
    """Per process: RSS after warm-up, and the least-squares slope of RSS
    (MiB) over requests ended (thousands), with its standard error."""
    out = {}
    names = sorted({n for _, _, rss in samples for n in rss})
    for name in names:
        pts = [(done, rss[name]) for _, done, rss in samples if name in rss and done >= warmup * num_requests]
        if len(pts) < 3:
            out[name] = {"samples": len(pts), "slope_mib_per_1k": None}
            continue
        x = np.array([p[0] for p in pts], dtype=np.float64) / 1000
        y = np.array([p[1] for p in pts], dtype=np.float64) / MIB
        if np.ptp(x) == 0:
            out[name] = {"samples": len(pts), "slope_mib_per_1k": None}
            continue
        slope, intercept = np.polyfit(x, y, 1)
        resid = y - (slope * x + intercept)
        se = float(np.sqrt((resid @ resid) / (len(x) - 2) / ((x - x.mean()) @ (x - x.mean()))))
        out[name] = {"samples": len(pts), "rss_after_warmup_mib": float(y[0]), "rss_end_mib": float(y[-1]),
                     "rss_max_mib": float(y.max()), "slope_mib_per_1k": float(slope), "slope_se_mib_per_1k": se}
    return out


def compose_config(*overrides: str) -> RunConfig:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs
    from testbed.model.config import CONF_DIR
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", ["wandb.mode=disabled", "progress=false", *overrides]))


def real_config(args) -> RunConfig:
    return compose_config(
        "runtime=real", "mode=disagg", "prefill_workers=1", "decode_workers=1", "transfer.transport=zmq",
        "timeout_s=600", f"seed={args.seed}", "workload=mixed", "workload.name=soak",
        f"workload.num_requests={args.requests}", "workload.arrival=poisson", f"workload.rate={args.rate}",
        "workload.prompt_dist=uniform", f"workload.prompt_min={args.prompt_min}",
        f"workload.prompt_max={args.prompt_max}", "workload.output_dist=uniform",
        f"workload.output_min={args.output_min}", f"workload.output_max={args.output_max}")


def sim_config(args) -> RunConfig:
    return compose_config(
        "runtime=sim", "mode=colocated", "model=llama3-8b", "hardware=h100-sxm", f"seed={args.seed}",
        "workload=mixed", "workload.name=soak_sim", f"workload.num_requests={args.sim}", "workload.arrival=poisson",
        f"workload.rate={args.sim_rate}", "workload.prompt_dist=fixed", "workload.prompt_len=32",
        "workload.output_dist=fixed", "workload.output_len=4")


def frontend_maps(runtime) -> dict[str, int]:
    """What the frontend still holds per request (every entry should be gone)."""
    ctl = runtime.controller
    maps = {"controller.records": len(ctl.records), "controller.arrival_index": len(ctl.arrival_index),
            "controller.location": len(ctl.location), "controller.unresolved": len(ctl.unresolved),
            "controller.early_tokens": len(ctl.early_tokens), "record_log.waiting": len(runtime.records.waiting)}
    for name in ("handoffs", "prefilling", "queue"):
        if hasattr(ctl, name):
            maps[f"controller.{name}"] = len(getattr(ctl, name))
    gate = getattr(runtime, "gate", None)
    if gate is not None:
        maps["event_gate.sent_to"] = len(gate.sent_to)
    return maps


def soak_real(args, out: Path) -> dict:
    from testbed.runtime.real import RealRuntime
    cfg = real_config(args)
    requests = [sampled(cfg, r) for r in iter_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)]
    rt = RealRuntime(cfg, record_dir=out)

    def pids() -> dict[str, int]:
        found = {"frontend": os.getpid()}
        if rt.controller is not None:
            for w in rt.workers:
                pid = rt.launcher.pid(w.worker_id)
                if pid is not None:
                    found[w.worker_id] = pid
        return found

    sampler = RssSampler(pids, lambda: rt.records.stats.num_requests, args.sample_s, args.requests)
    result, wall = sampled_run(rt, requests, sampler)
    summary = result.log.summary(result.duration_s or None)
    leaked = {w: s["num_blocks"] - s["num_free_blocks"] for w, s in result.worker_stats.items() if not s["all_free"]}
    return {"kind": "real", "num_requests": args.requests, "rate": args.rate, "wall_s": wall,
            "num_finished": summary["num_finished"], "lost": args.requests - summary["num_finished"],
            "kv_blocks_leaked": leaked, "frontend_maps": frontend_maps(rt),
            "ttft_ms": summary["ttft_ms"], "tbt_ms": summary["tbt_ms"],
            "processes": slopes(sampler.samples, args.requests), "samples": sampler.samples}


def sampled_run(rt, requests, sampler: RssSampler):
    """rt.run(requests) with the RSS sampler going; returns the result and the run's wall time."""
    sampler.start()
    t0 = time.monotonic()
    try:
        result = rt.run(requests)
    finally:
        sampler.stop()
    return result, time.monotonic() - t0


def soak_sim(args, out: Path) -> dict:
    from testbed.runtime.sim import SimRuntime
    cfg = sim_config(args)
    rt = SimRuntime(cfg, record_dir=out)
    requests = (sampled(cfg, r) for r in iter_workload(cfg.workload, cfg.model.vocab_size, cfg.seed))
    sampler = RssSampler(lambda: {"sim": os.getpid()}, lambda: rt.records.stats.num_requests, args.sample_s, args.sim)
    result, run_s = sampled_run(rt, requests, sampler)
    t0 = time.monotonic()
    summary = result.log.summary(result.duration_s or None)
    summary_s = time.monotonic() - t0
    return {"kind": "sim", "num_requests": args.sim, "rate": args.sim_rate, "wall_s": run_s, "summary_s": summary_s,
            "num_finished": summary["num_finished"], "lost": args.sim - summary["num_finished"],
            "kv_blocks_leaked": {w: s["num_blocks"] - s["num_free_blocks"]
                                 for w, s in result.worker_stats.items() if not s["all_free"]},
            "frontend_maps": frontend_maps(rt),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "processes": slopes(sampler.samples, args.sim), "samples": sampler.samples}


def print_table(res: dict) -> None:
    print(f"\nsoak ({res['kind']}): {res['num_requests']} requests at {res['rate']:g} req/s in {res['wall_s']:.0f} s"
          + (f" (+ summary {res['summary_s']:.1f} s, peak RSS {res['peak_rss_mib']:.0f} MiB)" if 'summary_s' in res
             else ""))
    print(f"  {'process':<10} {'RSS after warm-up':>18} {'RSS end':>9} {'slope MiB/1k req':>17} {'+- s.e.':>8}")
    for name, p in res["processes"].items():
        if p.get("slope_mib_per_1k") is None:
            print(f"  {name:<10} (too few samples after warm-up: {p['samples']})")
            continue
        print(f"  {name:<10} {p['rss_after_warmup_mib']:>14.1f} MiB {p['rss_end_mib']:>5.1f} MiB "
              f"{p['slope_mib_per_1k']:>17.3f} {p['slope_se_mib_per_1k']:>8.3f}")
    if "ttft_ms" in res:
        print(f"  TTFT p50 {res['ttft_ms']['p50']:.0f} ms  p99 {res['ttft_ms']['p99']:.0f} ms   "
              f"TBT p50 {res['tbt_ms']['p50']:.0f} ms  p99 {res['tbt_ms']['p99']:.0f} ms")
    print(f"  finished {res['num_finished']}/{res['num_requests']}  lost {res['lost']}  "
          f"KV blocks leaked {res['kv_blocks_leaked'] or 0}")
    print(f"  per-request state left in the frontend: {res['frontend_maps']}")
    ok = (all(p.get("slope_mib_per_1k") is not None and p["slope_mib_per_1k"] < 1.0
              for p in res["processes"].values()) and not res["lost"] and not res["kv_blocks_leaked"])
    print(f"  target (every slope < 1 MiB per 1,000 requests, 0 leaked, 0 lost): {'met' if ok else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=20.0, help="req/s (Poisson)")
    ap.add_argument("--prompt-min", type=int, default=8)
    ap.add_argument("--prompt-max", type=int, default=32)
    ap.add_argument("--output-min", type=int, default=2)
    ap.add_argument("--output-max", type=int, default=4)
    ap.add_argument("--sim", type=int, default=None, metavar="N", help="N requests on runtime=sim instead")
    ap.add_argument("--sim-rate", type=float, default=200.0, help="req/s of the simulated workload")
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("soak-out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = soak_sim(args, args.out) if args.sim else soak_real(args, args.out)
    (args.out / "soak.json").write_text(json.dumps(res, indent=1))
    print_table(res)
    print(f"  -> {args.out / 'soak.json'}")


if __name__ == "__main__":
    main()
