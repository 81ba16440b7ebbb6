"""How long a worker's token takes to reach the frontend on the real runtime:
from the end of the iteration that sampled it to the frontend receiving it.

A request's first token is counted apart, by whether the request found its
worker idle (no iteration running when it arrived) or busy, and so are the
later tokens. Runs `workload=chat` (tiny model) on `runtime=real` --repeats
times and prints the medians, the 75th percentile and the share of tokens
later than 1.5 ms.

Why: on this 2-core VM, 20-30% of the first tokens of requests that found
their worker idle reached the frontend 3-4 ms late (a CFS time slice: ZMQ's
I/O thread, woken on the worker's own core, waited for the next step to
yield it), against 0-1% for requests that found it busy; chat TTFT p50
carried it, and the simulator, whose hop is one number, priced chat TTFT
p50 8-15% low with every profile. The worker now yields its core after
every step (runtime/worker_process.py): 0-5% late (2026-11-30, two runs of
two repeats with it, 30% over 12 runs and 20% over two without).

    python experiments/benchmarks/bench_event_latency.py [--repeats 2] [--out /tmp/bench_event_latency] [override ...]
"""
from __future__ import annotations

import argparse
import bisect
import json
import statistics
import subprocess
import sys
from pathlib import Path


def way_out_ms(run_dir: Path) -> dict[str, list[float]]:
    """Per token, ms from its iteration's end to the frontend, by kind."""
    records = [json.loads(line) for line in (run_dir / "requests.jsonl").open()]
    iterations = sorted((json.loads(line) for line in (run_dir / "iterations.jsonl").open()),
                        key=lambda it: it["start_s"])
    ends = [it["start_s"] + it["duration_s"] for it in iterations]
    index = {it["start_s"]: i for i, it in enumerate(iterations)}
    out: dict[str, list[float]] = {"first token, worker idle": [], "first token, worker busy": [], "later tokens": []}
    for r in records:
        i = index.get(r["first_scheduled_s"])
        if i is not None and r["token_times_s"]:
            idle = i == 0 or ends[i - 1] < r["arrival_s"]
            kind = "first token, worker idle" if idle else "first token, worker busy"
            out[kind].append((r["token_times_s"][0] - ends[i]) * 1e3)
        for t in r["token_times_s"][1:]:
            k = bisect.bisect_right(ends, t)
            if k:
                out["later tokens"].append((t - ends[k - 1]) * 1e3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="/tmp/bench_event_latency")
    p.add_argument("override", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args()
    pooled: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        run_dir = Path(args.out) / f"chat-{rep}"
        subprocess.run([sys.executable, "-m", "testbed.cli", "run", "runtime=real", "workload=chat", "model=tiny",
                        "wandb.mode=disabled", "progress=false", *args.override, f"hydra.run.dir={run_dir}"],
                       check=True, stdout=subprocess.DEVNULL)
        for kind, xs in way_out_ms(run_dir).items():
            pooled.setdefault(kind, []).extend(xs)
    print(f"{'token':<26} {'count':>6} {'median ms':>10} {'p75 ms':>8} {'> 1.5 ms':>9}")
    for kind, xs in pooled.items():
        if xs:
            xs.sort()
            print(f"{kind:<26} {len(xs):6d} {statistics.median(xs):10.2f} {xs[3 * len(xs) // 4]:8.2f} "
                  f"{sum(x > 1.5 for x in xs) / len(xs):9.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
