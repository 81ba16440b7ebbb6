"""CUDA-graph decode against eager decode on the real executor: the same tokens,
and what a decode step costs with and without graphs (testbed/model/cuda_graphs.py).

- tokens: --prompts requests of spread lengths generated greedily through the
  whole engine (sarathi: chunked prefills, then decode-only steps of a batch
  that is no captured size, so padding is exercised), once eager and once
  replaying graphs; equal or not, and the smallest top-2 logit margin seen
  (a divergence where that margin is at the rounding level is a tie, not a bug).
- steps: B decodes at --decode-context for B in --batches, each mode: wall_ms
  (median of --repeats executor.execute calls: what a server sees),
  gpu_busy_ms (the kernels' device time in one profiled step, torch.profiler)
  and, for graphs, replay_gpu_ms (CUDA events over --repeats graph replays
  queued back to back: the GPU time alone). `speedup` on a graph row is the
  eager wall over the graph wall, `wall_over_busy` whether the host or the
  GPU sets the pace.

    python experiments/benchmarks/bench_gpu_graphs.py --out DIR                  # llama3-8b, all 32 layers
    python experiments/benchmarks/bench_gpu_graphs.py --out DIR --device cpu --model tiny \\
        --batches 1,3 --decode-context 64 --prompts 5 --repeats 2                 # smoke check here

On the CPU "graphs" runs the same padded forward eagerly (nothing is
captured): the smoke check exercises the code, its timings mean nothing.
Writes DIR/graphs.csv and DIR/graphs_tokens.json."""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from testbed.batch import Batch, ScheduledSlice
from testbed.engine import Engine, WallClock
from testbed.experiments.prefill import RealBench
from testbed.request import Request
from testbed.schedulers import SchedulerConfig, make_scheduler

FIELDS = ["model", "layers", "device", "backend", "decodes", "decode_context", "mode", "wall_ms", "gpu_busy_ms",
          "replay_gpu_ms", "wall_over_busy", "speedup"]


class MarginSpy:
    """Wraps model.compute_logits: remembers the smallest top-2 margin of any sampled row."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.inner, self.smallest = model, model.compute_logits, float("inf")
        model.compute_logits = self

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.inner(hidden)
        top2 = logits.topk(2, dim=-1).values
        self.smallest = min(self.smallest, float((top2[:, 0] - top2[:, 1]).min()))
        return logits


def greedy_tokens(bench: RealBench, prompt_lens: list[int], max_tokens: int) -> dict[str, list[int]]:
    """Greedy outputs of fresh requests through the engine over the bench's blocks (all freed after)."""
    sched = make_scheduler("sarathi", SchedulerConfig(token_budget=2048, max_num_seqs=256,
                                                      max_num_batched_tokens=8192), bench.bm)
    engine = Engine(sched, bench.executor, WallClock())
    gen = torch.Generator().manual_seed(11)
    requests = [Request(f"g{i}", torch.randint(0, bench.model_cfg.vocab_size, (n,), generator=gen).tolist(),
                        max_tokens=max_tokens) for i, n in enumerate(prompt_lens)]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    if not bench.bm.all_free():
        raise RuntimeError("bench_gpu_graphs: blocks left allocated after the token check")
    return {r.request_id: r.output_token_ids for r in requests}


def wall_ms(bench: RealBench, batch: Batch, repeats: int) -> float:
    return statistics.median(bench.executor.execute(batch).duration_s for _ in range(repeats)) * 1e3


def busy_ms(bench: RealBench, batch: Batch) -> float:
    """The kernels' device time of one step (0 without a GPU)."""
    if not torch.cuda.is_available():
        return 0.0
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        bench.executor.execute(batch)
    return sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 1e3


def replay_ms(bench: RealBench, size: int, repeats: int) -> float | str:
    """GPU ms per replay of the graph of `size`, replays queued back to back ('' without graphs)."""
    graphs = bench.executor.graphs
    if graphs is None or size not in graphs.graphs:
        return ""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graphs.graphs[size].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (same shapes per layer)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=12, help="requests in the token check (12: padded to 16)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_gpu_graphs: --device cuda needs a CUDA GPU (use --device cpu --model tiny for a smoke check)")
    args.out.mkdir(parents=True, exist_ok=True)
    batches = sorted(int(x) for x in args.batches.split(","))
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    overrides = {} if args.layers is None else {"num_layers": args.layers}
    prompt_lens = [32 + 97 * i % 400 for i in range(args.prompts)]
    sizes = sorted({1, 2, 4, 8, 16, *batches, args.prompts})
    capacity = max(batches) * (args.decode_context + args.block_size) + sum(prompt_lens) \
        + args.prompts * (args.max_tokens + args.block_size)

    t0 = time.perf_counter()
    bench = RealBench(args.model, capacity, args.block_size, 0, dtype, args.device, args.backend,
                      cuda_graph_sizes=sizes, **overrides)
    runner = bench.executor.graphs
    cfg = bench.model_cfg
    print(f"{cfg.name} x{cfg.num_layers} layers on {args.device} ({dtype}, {args.backend}): built and "
          f"{'captured' if runner.graphs else 'set up (no capture off CUDA)'} {len(sizes)} sizes in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)

    spy = MarginSpy(bench.executor.model)
    bench.executor.graphs = None
    eager = greedy_tokens(bench, prompt_lens, args.max_tokens)
    bench.executor.graphs = runner
    graphs = greedy_tokens(bench, prompt_lens, args.max_tokens)
    differ = sorted(rid for rid in eager if eager[rid] != graphs[rid])
    tokens = {"requests": len(prompt_lens), "max_tokens": args.max_tokens, "equal": not differ,
              "differing_requests": differ, "min_top2_margin": round(spy.smallest, 4),
              "first_divergence": {rid: next(i for i, (a, b) in enumerate(zip(eager[rid], graphs[rid])) if a != b)
                                   for rid in differ}}
    (args.out / "graphs_tokens.json").write_text(json.dumps(tokens, indent=1) + "\n")
    print(f"tokens: graphs == eager: {tokens['equal']} ({len(prompt_lens)} requests x {args.max_tokens}; "
          f"smallest top-2 margin {spy.smallest:.4f})", flush=True)

    running = bench.decodes(max(batches), args.decode_context)
    rows: list[dict] = []
    for b in batches:
        batch = Batch(running[:b])
        eager_wall = None
        for mode in ("eager", "graphs"):
            bench.executor.graphs = runner if mode == "graphs" else None
            wall_ms(bench, batch, 3)                                              # warm-up
            wall = wall_ms(bench, batch, args.repeats)
            busy = busy_ms(bench, batch)
            row = {"model": cfg.name, "layers": cfg.num_layers, "device": args.device, "backend": args.backend,
                   "decodes": b, "decode_context": args.decode_context, "mode": mode, "wall_ms": round(wall, 3),
                   "gpu_busy_ms": round(busy, 3), "wall_over_busy": round(wall / busy, 3) if busy else "",
                   "replay_gpu_ms": "" if mode == "eager" else replay_ms(bench, b, args.repeats)}
            if mode == "eager":
                eager_wall = wall
            else:
                row["speedup"] = round(eager_wall / wall, 3)
            if isinstance(row["replay_gpu_ms"], float):
                row["replay_gpu_ms"] = round(row["replay_gpu_ms"], 3)
            rows.append(row)
            print("  ".join(f"{k}={row.get(k, '')}" for k in FIELDS[4:]), flush=True)
    bench.executor.graphs = runner
    with (args.out / "graphs.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
