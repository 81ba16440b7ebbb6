"""Scheduler plus engine bookkeeping per iteration, with no model.

The engine runs over an instant executor (it only names a token for each
slice that samples), so what is timed is `Engine.step()` minus the executor:
`schedule()` (decodes, preemption checks, admission), KV block growth and
prefix-hash commits in the BlockManager, and the engine's per-slice update.

Steady state of the issue's target: 256 running decodes (max_num_seqs=256)
and 1,000 requests waiting behind them; prompts of 64..575 tokens staggered so
that 1/16 of the requests fill a block (a hash) each iteration. Target: <= 0.3
ms per iteration for sarathi (median; the p90 shows GC pauses and a busy machine).

    python experiments/benchmarks/bench_scheduler.py [--iters 400] [--profile sarathi]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from testbed.batch import Batch, StepResult
from testbed.block_manager import BlockManager
from testbed.engine import Engine, VirtualClock
from testbed.executor import Executor
from testbed.request import Request
from testbed.schedulers import SCHEDULERS, SchedulerConfig, make_scheduler

BLOCK_SIZE = 16


class NullExecutor(Executor):
    """Instant: token 1 for every slice that samples; its own time is measured
    and subtracted from the step."""
    kv_bytes_per_token = 0

    def __init__(self):
        self.ns = 0

    def execute(self, batch: Batch, on_layer_done=None) -> StepResult:
        t0 = time.perf_counter_ns()
        sampled = {s.request.request_id: 1 for s in batch.slices if s.samples}
        self.ns += time.perf_counter_ns() - t0
        return StepResult(sampled=sampled, duration_s=0.0)


def build(policy: str, num_running: int, num_waiting: int, iters: int) -> Engine:
    # nobody finishes: outputs outlast the warm-up (<= 400 iterations) and the timed loop, and the
    # cache holds every running request's whole life (request_level reserves it up front)
    max_tokens = 2 * iters + 400
    num_blocks = (num_running + 1) * (-(-(576 + max_tokens) // BLOCK_SIZE))
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    cfg = SchedulerConfig(token_budget=512, max_num_seqs=num_running, max_num_batched_tokens=8192)
    engine = Engine(make_scheduler(policy, cfg, bm), NullExecutor(), VirtualClock())
    for i in range(num_running + num_waiting):
        prompt_len = 64 + (i * 37) % 512
        engine.add_request(Request(f"r{i}", [(i * 7919 + t) % 32000 for t in range(prompt_len)], max_tokens))
    return engine


def warm_up(engine: Engine, num_running: int) -> None:
    """Prefill until num_running requests are decoding (not timed)."""
    sched = engine.scheduler
    for _ in range(2000):
        if sum(1 for r in sched.running if not r.is_prefill) >= num_running:
            return
        engine.step()
    raise RuntimeError(f"{sched.name}: {num_running} requests never got to decode together")


def bench(policy: str, num_running: int, num_waiting: int, iters: int, profile: bool = False) -> dict:
    engine = build(policy, num_running, num_waiting, iters)
    warm_up(engine, num_running)
    ex: NullExecutor = engine.executor
    ex.ns = 0
    sched_ns, step_ns, cpu_ns = [], [], []
    running, waiting = [], []
    prof = cProfile.Profile() if profile else None
    schedule = engine.scheduler.schedule

    def timed_schedule():
        t0 = time.perf_counter_ns()
        batch = schedule()
        sched_ns.append(time.perf_counter_ns() - t0)
        return batch
    engine.scheduler.schedule = timed_schedule
    if prof:
        prof.enable()
    for _ in range(iters):
        running.append(len(engine.scheduler.running))
        waiting.append(len(engine.scheduler.waiting))
        before = ex.ns
        c0, t0 = time.process_time_ns(), time.perf_counter_ns()
        engine.step()
        t1, c1 = time.perf_counter_ns(), time.process_time_ns()
        step_ns.append(t1 - t0 - (ex.ns - before))
        cpu_ns.append(c1 - c0 - (ex.ns - before))
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return {"policy": policy, "running": statistics.mean(running), "waiting": statistics.mean(waiting),
            "step_ms": statistics.median(step_ns) / 1e6, "step_p90_ms": sorted(step_ns)[int(0.9 * len(step_ns))] / 1e6,
            "schedule_ms": statistics.median(sched_ns) / 1e6, "cpu_ms": statistics.median(cpu_ns) / 1e6,
            "preemptions": engine.scheduler.num_preemptions}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--waiting", type=int, default=1000)
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--policies", nargs="*", default=["sarathi", "vllm_v0", "orca", "request_level"])
    p.add_argument("--profile", default=None, metavar="POLICY", help="cProfile this policy's timed loop")
    args = p.parse_args()
    for name in args.policies:
        if name not in SCHEDULERS:
            p.error(f"--policies: '{name}' is not one of {sorted(SCHEDULERS)}")
    print(f"{args.running} running, {args.waiting} waiting, {args.iters} iterations; median over iterations, ms")
    print("step-exec: Engine.step() minus the executor, wall clock (cpu: this process's CPU time, which a\n"
          "busy machine does not inflate); p90 of step-exec shows GC pauses and other processes")
    print(f"{'policy':<14} {'running':>8} {'waiting':>8} {'schedule':>9} {'step-exec':>10} {'cpu':>7} {'p90':>7} "
          f"{'preempt':>8}  target 0.3 ms")
    for name in args.policies:
        r = bench(name, args.running, args.waiting, args.iters, profile=(name == args.profile))
        verdict = "ok" if r["step_ms"] <= 0.3 else "MISS"
        print(f"{name:<14} {r['running']:8.0f} {r['waiting']:8.0f} {r['schedule_ms']:9.3f} {r['step_ms']:10.3f} "
              f"{r['cpu_ms']:7.3f} {r['step_p90_ms']:7.3f} {r['preemptions']:8d}  {verdict}")


if __name__ == "__main__":
    main()
