"""Where one step's wall time goes on a GPU: the engine's host work against the
GPU's busy time, for llama3-8b-shaped layers (the eager engine, no CUDA graphs).

bench_gpu_piggyback times steps by the engine's wall clock. On the H200 its
piggyback tax came out negative beside small decode batches: a chunk added
less than its time alone. This bench says why, step by step:
- wall_ms: the median of --repeats executor.execute() calls (what a server sees);
- gpu_busy_ms: the kernels' device time in one profiled step (torch.profiler);
- host_bound: wall well above gpu_busy, the GPU idles while the host launches.
Cases: B decodes at --decode-context alone, a C-token chunk over an L-token
prefix alone, and the two together.

    python experiments/benchmarks/bench_gpu_step_host.py --out DIR [--layers 8]
    python experiments/benchmarks/bench_gpu_step_host.py --out DIR --device cpu --model tiny --prompt 1024 \\
        --chunk 128 --decodes 4 --decode-context 128          # smoke check here

writes DIR/step_host.csv and prints the top host-side ops of the mixed step."""
from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from testbed.batch import Batch, ScheduledSlice
from testbed.experiments.prefill import RealBench

FIELDS = ["case", "decodes", "prompt_len", "chunk", "wall_ms", "gpu_busy_ms", "host_bound"]


def wall_ms(bench: RealBench, slices: list[ScheduledSlice], repeats: int) -> float:
    return statistics.median(bench.executor.execute(Batch(slices)).duration_s for _ in range(repeats)) * 1e3


def profiled(bench: RealBench, slices: list[ScheduledSlice]) -> tuple[float, profile]:
    """(the kernels' device time in ms, the profile) of one step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        bench.executor.execute(Batch(slices))
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return device_us / 1e3, prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--prompt", type=int, default=65536, help="the chunk's prefix plus the chunk")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--decodes", default="8,128")
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    decodes = [int(x) for x in args.decodes.split(",")]
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    bench = RealBench(args.model, args.prompt + max(decodes) * (args.decode_context + 16), 16, 0, dtype,
                      args.device, args.backend, num_layers=args.layers)
    req = bench.request(args.prompt, args.prompt - args.chunk)
    chunk = [ScheduledSlice(req, args.chunk)]
    running = bench.decodes(max(decodes), args.decode_context)
    cases = [("chunk", 0, chunk)] + [(kind, b, s) for b in decodes
                                     for kind, s in (("decodes", running[:b]), ("mixed", running[:b] + chunk))]
    rows, last = [], None
    for kind, b, slices in cases:
        wall_ms(bench, slices, 2)                                             # warm-up (compiles)
        wall = wall_ms(bench, slices, args.repeats)
        busy, last = profiled(bench, slices)
        rows.append({"case": kind, "decodes": b, "prompt_len": args.prompt if kind != "decodes" else "",
                     "chunk": args.chunk if kind != "decodes" else "", "wall_ms": round(wall, 3),
                     "gpu_busy_ms": round(busy, 3), "host_bound": wall > 1.5 * busy})
        print("  ".join(f"{k}={rows[-1][k]}" for k in FIELDS), flush=True)
    with (args.out / "step_host.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(last.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)


if __name__ == "__main__":
    main()
