"""Where a decode iteration's time goes on the real engine: the model forward
against everything around it.

32 requests decode together on `tiny` (one torch thread), each with a
`--context`-token prompt already prefilled. Every iteration is split into:

  schedule   Scheduler.schedule() (with its invariant check)
  prepare    ModelExecutor._prepare: token ids, positions, slot mapping, metadata tensors
  forward    the model's layers (attention backend included) and the LM head
  sample     sampling.sample() on the logits
  update     Engine._update: computed tokens, outputs, prefix-cache commits
  other      the rest of Engine.step and ModelExecutor.execute (row selection, dict building)

Target (issue 3): time outside the forward <= 10% of the iteration. Timers
wrap the real methods (a few us per iteration, counted in "other"); medians
over iterations.

    python experiments/benchmarks/bench_overhead.py [--batch 32] [--context 512] [--iters 100] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import testbed.model_executor as model_executor
from testbed.block_manager import BlockManager
from testbed.engine import Engine, WallClock
from testbed.model.config import load_model_preset
from testbed.model_executor import ModelExecutor
from testbed.request import Request
from testbed.schedulers import SchedulerConfig, make_scheduler

BLOCK_SIZE = 16
PARTS = ("schedule", "prepare", "forward", "sample", "update")


class Timers:
    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        ns = self.ns

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[name] += time.perf_counter_ns() - t0
        return timed


def build(batch: int, context: int, iters: int, scheduler: str) -> tuple[Engine, Timers]:
    num_blocks = batch * (-(-(context + iters + 64) // BLOCK_SIZE)) + 8
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    sched = make_scheduler(scheduler, SchedulerConfig(token_budget=max(2048, batch), max_num_seqs=batch,
                                                      max_num_batched_tokens=max(2048, context)), bm)
    ex = ModelExecutor(load_model_preset("tiny"), num_blocks, BLOCK_SIZE, bm.block_table)
    engine = Engine(sched, ex, WallClock())
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(0, ex.model_cfg.vocab_size, (context,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", prompt, max_tokens=iters + 64))
    while any(r.is_prefill for r in sched.running) or sched.waiting:      # prefill, not timed
        engine.step()

    t = Timers()
    sched.schedule = t.wrap("schedule", sched.schedule)
    ex._prepare = t.wrap("prepare", ex._prepare)
    model = ex.model
    model_forward = model.forward
    model.forward = t.wrap("forward", model_forward)           # nn.Module.__call__ -> forward
    model.compute_logits = t.wrap("forward", model.compute_logits)
    model_executor.sample = t.wrap("sample", model_executor.sample)
    engine._update = t.wrap("update", engine._update)
    return engine, t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--scheduler", default="sarathi")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine, timers = build(args.batch, args.context, args.iters, args.scheduler)
    per_iter: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.iters):
        timers.ns.clear()
        t0 = time.perf_counter_ns()
        out = engine.step()
        total = time.perf_counter_ns() - t0
        assert out is not None and out.iteration.num_decode_tokens == args.batch, out and out.iteration
        for name in PARTS:
            per_iter[name].append(timers.ns[name] / 1e6)
        per_iter["other"].append((total - sum(timers.ns[n] for n in PARTS)) / 1e6)
        per_iter["total"].append(total / 1e6)
    med = {k: statistics.median(v) for k, v in per_iter.items()}
    total = med["total"]
    outside = [statistics.median(t - f for t, f in zip(per_iter["total"], per_iter["forward"]))]
    print(f"tiny, {args.batch} decodes at ~{args.context} tokens of context, {args.threads} thread(s), "
          f"{args.iters} iterations; median ms per iteration")
    for name in (*PARTS, "other"):
        print(f"  {name:<9} {med[name]:8.3f}  {100 * med[name] / total:5.1f}%")
    print(f"  {'total':<9} {total:8.3f}")
    frac = outside[0] / total
    print(f"outside the forward: {outside[0]:.3f} ms = {100 * frac:.1f}% of the iteration "
          f"(target <= 10%: {'ok' if frac <= 0.10 else 'MISS'})")


if __name__ == "__main__":
    main()
