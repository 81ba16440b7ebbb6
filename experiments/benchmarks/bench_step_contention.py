"""The real engine's step time when worker processes share this CPU:
`--procs` processes at once, each a worker of its own (testbed/profiling/
calibration.py's profiling_service: block manager, sarathi scheduler, KV
cache, tiny) stepping the batches of a decision-real probe at L = 1K with
--torch-threads torch threads: a 1,024-token prompt in chunks of 512 (slices
(512, 512) and (512, 1024)) and 8 decodes at context ~1K. Per shape: the wall
time and the thread's CPU time per step (median), against the cpu profile's
price (CostModel). Wall above CPU is waiting for a core; CPU above the price
at procs=1 is the profile's error, and CPU growing with procs is the cores
slowing each other (shared cache, memory bandwidth, the hypervisor).

    python experiments/benchmarks/bench_step_contention.py [--procs 1] [--seconds 20] [--torch-threads 1]

Timing: under `flock /tmp/s26_timing.lock` on a shared machine."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time


def worker(seconds: float, threads: int, queue) -> None:
    import numpy as np
    import torch

    from testbed.model.config import load_model_preset
    from testbed.model.loader import load_model
    from testbed.profiling.calibration import _timed_steps, decode_service, profiling_service
    from testbed.request import Request
    from testbed.sim.config import load_hardware_preset
    from testbed.sim.cost_model import CostModel
    torch.set_num_threads(threads)
    model = load_model_preset("tiny")
    cost = CostModel(model, load_hardware_preset("cpu"))
    weights, _ = load_model(model)
    seq = 0

    def prompt(length: int) -> list[int]:
        nonlocal seq
        seq += 1
        return [(7 * seq + i) % model.vocab_size for i in range(length)]

    chunker, rec = profiling_service(model, num_blocks=1024 // 16 + 8, token_budget=512, weights=weights)
    decoder, drec = decode_service(model, 8, weights, prompt, max_tokens=1 << 20)
    samples: dict[str, list[tuple[float, float, float]]] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        chunker.engine.add_request(Request(f"p{seq}", prompt(1024), max_tokens=1))
        for _ in range(2):
            c0 = time.thread_time()
            (pairs, wall), = _timed_steps(chunker, rec, 1)
            samples.setdefault(str(pairs), []).append((wall, time.thread_time() - c0, cost.iteration_time_s(pairs)))
        for _ in range(10):
            c0 = time.thread_time()
            (pairs, wall), = _timed_steps(decoder, drec, 1)
            samples.setdefault("8 decodes", []).append((wall, time.thread_time() - c0,
                                                        cost.iteration_time_s(pairs)))
    out = {}
    for shape, xs in samples.items():
        wall, cpu, priced = (np.median([x[i] for x in xs[1:]]) * 1e3 for i in range(3))
        out[shape] = {"n": len(xs) - 1, "wall_ms": round(wall, 2), "cpu_ms": round(cpu, 2),
                      "priced_ms": round(priced, 2), "wall_over_priced": round(wall / priced, 2),
                      "cpu_over_priced": round(cpu / priced, 2)}
    queue.put(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--torch-threads", type=int, default=1)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    load0 = os.getloadavg()[0]
    procs = [ctx.Process(target=worker, args=(args.seconds, args.torch_threads, queue)) for _ in range(args.procs)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    print(json.dumps({"procs": args.procs, "torch_threads": args.torch_threads, "load_1m_start": round(load0, 2),
                      "load_1m_end": round(os.getloadavg()[0], 2), "per_process": results}, indent=1))


if __name__ == "__main__":
    main()
