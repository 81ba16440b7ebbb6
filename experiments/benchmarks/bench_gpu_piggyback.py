"""The chunk tax on one GPU, measured beside the simulator's preset for it:
whole against chunked prefill of a prompt alone (the isolated tax), and the
same chunks riding in iterations of B running decodes (the piggyback tax,
testbed/sim/crossover.py: piggyback_tax_s), for llama3-8b-shaped layers.

For each prompt length L and chunk size C:
- whole: one step of the L-token prompt alone (timed once per L);
- chunked: ceil(L/C) steps of C tokens alone, each attending over the KV the
  previous ones wrote;
- piggyback_bB: the sum over chunks of [t(B decodes + chunk) - t(B decodes)]
  minus whole, for B in --decodes, every decode at context --decode-context;
  `base_ms` is t(B decodes) and `added_mean_ms` the mean bracket per chunk.
Times are the engine's wall clock per step (host work included, as a server
sees it): where the host sets the pace of a small decode batch, a chunk's GPU
work hides in the GPU's idle time and the tax can come out negative.
Long prompts have many chunks; at most --max-chunk-samples evenly spaced chunk
positions are timed and the rest interpolated linearly between them (a
chunk's time is smooth in its offset: weights plus a prefix read growing
linearly), and `chunks_timed` says how many were. Every step time is the
median of --repeats runs after a warm-up. The simulator prices the same shapes
with --hardware (CostModel.iteration_time_s; a preset name or a .yaml path,
e.g. the one `testbed profile --device cuda` wrote) and, with --engine, the
engine preset's terms (engine=, testbed/sim/engine_config.py); `sim_over_measured` is the
ratio of the two taxes in ms. With --cuda-graph-sizes the decode-only steps
(t(B decodes)) replay CUDA graphs, as the engine serves them; steps with a
chunk run eagerly either way.

    python experiments/benchmarks/bench_gpu_piggyback.py --out DIR [--budget-s 120]
    python experiments/benchmarks/bench_gpu_piggyback.py --out DIR --hardware OUT/h200-measured.yaml \
        --engine OUT/engine-testbed.yaml --cuda-graph-sizes 8,32,128 --backend triton     # graphs vs engine=testbed
    python experiments/benchmarks/bench_gpu_piggyback.py --out DIR --device cpu --model tiny \\
        --prompts 512,1024 --chunks 128 --decodes 0,4 --decode-context 128 --hardware cpu   # smoke check here

writes DIR/piggyback.csv, a row after each measurement (a timeout keeps what
ran); lengths run shortest first and a point predicted to overrun the budget
is written as skipped."""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

from testbed.batch import Batch, ScheduledSlice
from testbed.experiments.prefill import RealBench
from testbed.sim.config import load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.crossover import chunk_slices, piggyback_tax_s
from testbed.sim.engine_config import load_engine_preset

FIELDS = ["model", "layers", "device", "hardware", "engine", "graphs", "prompt_len", "chunk", "decodes", "decode_context",
          "chunks_timed", "whole_ms", "base_ms", "added_mean_ms", "tax_ms", "sim_whole_ms", "sim_tax_ms", "sim_over_measured", "status"]


def sampled_positions(num_chunks: int, max_samples: int) -> list[int]:
    """Chunk indices to time: all of them, or max_samples spread evenly from the first to the last."""
    if num_chunks <= max_samples:
        return list(range(num_chunks))
    step = (num_chunks - 1) / (max_samples - 1)
    return sorted({round(i * step) for i in range(max_samples)})


def interpolated_sum(positions: list[int], values: list[float]) -> float:
    """The sum over every chunk index from the first timed position to the
    last (sampled_positions: 0 and the last chunk) of the values, linear
    between the timed positions."""
    total = values[-1]
    for (i0, v0), (i1, v1) in zip(zip(positions, values), zip(positions[1:], values[1:])):
        total += sum(v0 + (v1 - v0) * (k - i0) / (i1 - i0) for k in range(i0, i1))
    return total


class Timer:
    def __init__(self, bench: RealBench, repeats: int):
        self.bench, self.repeats = bench, repeats

    def __call__(self, slices: list[ScheduledSlice]) -> float:
        if not slices:
            return 0.0
        times = [self.bench.executor.execute(Batch(slices)).duration_s for _ in range(self.repeats)]
        return statistics.median(times)


def time_whole(bench: RealBench, timer: Timer, prompt_len: int) -> float:
    """Seconds of one step prefilling the whole prompt alone (the same for every chunk size and B)."""
    req = bench.request(prompt_len, 0)
    try:
        req.num_computed_tokens = 0
        return timer([ScheduledSlice(req, prompt_len)])
    finally:
        bench.bm.free(req.request_id)


def measure(bench: RealBench, timer: Timer, prompt_len: int, chunk: int, running: list[ScheduledSlice],
            max_samples: int, whole: float) -> tuple[float, int, float, float]:
    """(tax s, chunks timed, t(decodes alone) s, mean added s per chunk) of one prompt riding on
    `running` decodes, against its whole prefill's `whole` s."""
    req = bench.request(prompt_len, 0)
    try:
        base = timer(running)
        chunks = chunk_slices(prompt_len, chunk)
        positions = sampled_positions(len(chunks), max_samples)
        added = []
        for j in positions:
            n, end = chunks[j]
            req.num_computed_tokens = end - n
            added.append(timer(running + [ScheduledSlice(req, n)]) - base)
        total = interpolated_sum(positions, added)
        return total - whole, len(positions), base, total / len(chunks)
    finally:
        bench.bm.free(req.request_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (same shapes per layer)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--backend", default="torch", help="the attention backend (torch, triton, flash_attn)")
    ap.add_argument("--hardware", default="h200", help="the simulator's preset to compare against (name or .yaml)")
    ap.add_argument("--engine", default=None, help="an engine preset .yaml whose terms the simulator adds")
    ap.add_argument("--cuda-graph-sizes", default="", help="decode batch sizes replayed as CUDA graphs ('': eager)")
    ap.add_argument("--prompts", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--chunks", default="2048,512")
    ap.add_argument("--decodes", default="0,8,32,128")
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--max-chunk-samples", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=120.0, help="measurement time, model build excluded")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_gpu_piggyback: --device cuda needs a CUDA GPU (use --device cpu --model tiny for a smoke check)")
    if args.max_chunk_samples < 2:
        sys.exit("bench_gpu_piggyback: --max-chunk-samples must be >= 2")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = sorted(int(x) for x in args.prompts.split(","))
    chunks = [int(x) for x in args.chunks.split(",")]
    decodes = sorted(int(x) for x in args.decodes.split(","))
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    overrides = {} if args.layers is None else {"num_layers": args.layers}

    t0 = time.perf_counter()
    capacity = max(prompts) + max(max(decodes), 1) * (args.decode_context + args.block_size)
    graph_sizes = tuple(int(x) for x in args.cuda_graph_sizes.split(",") if x)
    bench = RealBench(args.model, capacity, args.block_size, 0, dtype, args.device, args.backend, graph_sizes,
                      **overrides)
    hardware = load_hardware_preset(args.hardware)
    engine = load_engine_preset(args.engine) if args.engine else None      # None: the hardware's default
    cost = CostModel(bench.model_cfg, hardware, engine=engine)
    engine_name = cost.engine.name
    running = bench.decodes(max(max(decodes), 1), args.decode_context)
    timer = Timer(bench, args.repeats)
    warm = Timer(bench, 1)                                                            # warm-up off the clock
    measure(bench, warm, min(prompts), min(chunks), running, 2, time_whole(bench, warm, min(prompts)))
    print(f"{bench.model_cfg.name} x{bench.model_cfg.num_layers} layers on {args.device} ({dtype}, {args.backend}): "
          f"built and warmed in {time.perf_counter() - t0:.1f}s", flush=True)

    rows: list[dict] = []
    out_csv = args.out / "piggyback.csv"

    def write() -> None:
        with out_csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)

    start, last, wholes = time.perf_counter(), {}, {}
    for L in prompts:
        for c in chunks:
            for b in decodes:
                row = {"model": bench.model_cfg.name, "layers": bench.model_cfg.num_layers, "device": args.device,
                       "hardware": hardware.name, "engine": engine_name, "graphs": args.cuda_graph_sizes,
                       "prompt_len": L, "chunk": c, "decodes": b,
                       "decode_context": args.decode_context}
                predicted = last[(c, b)][1] * (L / last[(c, b)][0]) ** 2 if (c, b) in last else 0.0
                elapsed = time.perf_counter() - start
                if c >= L:
                    row["status"] = "skipped: chunk >= prompt"
                elif elapsed + predicted > args.budget_s:
                    row["status"] = f"skipped: predicted {predicted:.0f}s, {args.budget_s - elapsed:.0f}s left"
                else:
                    t = time.perf_counter()
                    try:
                        if L not in wholes:
                            wholes[L] = time_whole(bench, timer, L)
                        whole = wholes[L]
                        tax, timed, base, added = measure(bench, timer, L, c, running[:b], args.max_chunk_samples, whole)
                    except torch.cuda.OutOfMemoryError as e:
                        row["status"] = f"out of memory: {str(e)[:100]}"
                    else:
                        last[(c, b)] = (L, time.perf_counter() - t)
                        sim_whole = cost.iteration_time_s([(L, L)], num_sampled=1)
                        sim_tax = piggyback_tax_s(cost, L, c, b, args.decode_context)
                        row.update(chunks_timed=timed, whole_ms=round(whole * 1e3, 3), base_ms=round(base * 1e3, 3),
                                   added_mean_ms=round(added * 1e3, 3), tax_ms=round(tax * 1e3, 3),
                                   sim_whole_ms=round(sim_whole * 1e3, 3), sim_tax_ms=round(sim_tax * 1e3, 3),
                                   sim_over_measured=round(sim_tax / tax, 3) if tax else "", status="ok")
                rows.append(row)
                print("  ".join(f"{k}={row.get(k, '')}" for k in FIELDS[6:]), flush=True)
                write()
    write()


if __name__ == "__main__":
    main()
