"""Calibrating the cost model to the real engine on this machine: what an
iteration costs besides what the cost model prices from the GEMM and
attention tables (scheduling, building the inputs, sampling, updating the
requests, packing the events), and how much slower the kernels run inside the
engine than alone in the profiler (cold caches, other processes), measured so
`runtime=sim hardware=cpu` predicts the real engine's iteration times, not
just its kernels.

Method: real WorkerServices (engine, scheduler, ModelExecutor, events packed
with msgpack as a worker process does) step batches of known shapes: decode
batches of 1 to 32 requests (contexts spread over 64..512), whole prefills of
16 to 2048 tokens, and a 64-token chunk beside 1 to 8 decodes; one step of each
shape per round, so that whatever else runs on the machine spreads over all
shapes alike. (Steps timed inside a real runtime's burst were fitted too once:
the frontend busy sending the burst on the other core slowed them 20-30%,
which raised calibration_scale and overpriced every quiet step and long
prefill by 10-40%.) Each shape's median step time is fitted to
    overhead_ms + overhead_per_seq_ms · num_seqs + calibration_scale · modeled
where `modeled` is the cost model's time without overhead; all three >= 0,
minimising relative error (a 1-decode step and a 512-token prefill count
alike).

The same rounds give the machine's noise: every step's time over the median
of its shape, whose quantiles become hardware.step_jitter (jitter.py).

Two frontend figures complete it: the one-way frontend <-> worker hop, from a
short real run, and the frontend's own time per command it sends."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np

from testbed.batch import Batch, StepResult
from testbed.block_manager import BlockManager
from testbed.engine import Engine, WallClock
from testbed.executor import Executor, LayerHook
from testbed.model.config import ModelConfig
from testbed.request import Request
from testbed.schedulers import SchedulerConfig, make_scheduler
from testbed.sim.config import HardwareConfig
from testbed.sim.cost_model import CostModel
from testbed.worker import WorkerService


@dataclass
class OverheadFit:
    overhead_ms: float
    overhead_per_seq_ms: float
    calibration_scale: float
    rows: list[tuple[int, int, float, float]]   # (num_seqs, num_tokens, median step s, median modeled s)
    step_ratios: list[float]                     # every repeated step's time over its shape's median


class _Recording(Executor):
    """Delegates to the real executor and remembers each batch's (new tokens,
    context) pairs, which is what the cost model prices."""

    def __init__(self, inner: Executor):
        self.inner = inner
        self.kv_bytes_per_token = inner.kv_bytes_per_token
        self.num_layers = inner.num_layers
        self.pairs: list[tuple[int, int]] = []

    def execute(self, batch: Batch, on_layer_done: LayerHook | None = None) -> StepResult:
        self.pairs = [(s.num_tokens, s.end) for s in batch.slices]
        return self.inner.execute(batch, on_layer_done)


def profiling_service(model: ModelConfig, num_blocks: int, token_budget: int,
                      weights=None) -> tuple[WorkerService, _Recording]:
    """A worker of its own (block manager, scheduler, KV cache) for one batch
    shape. `weights`: another service's model module to run instead of a
    fresh copy, as a real worker runs one model whatever it batches: thirty
    copies would never be in cache and every step would read its weights from
    DRAM, which a serving worker does not."""
    from testbed.model_executor import ModelExecutor
    bm = BlockManager(num_blocks, 16, enable_prefix_caching=True)
    scheduler = make_scheduler("sarathi", SchedulerConfig(token_budget=token_budget, max_num_seqs=256,
                                                          max_num_batched_tokens=token_budget), bm)
    inner = ModelExecutor(model, num_blocks, 16, bm.block_table)
    if weights is not None:
        inner.model = weights
    executor = _Recording(inner)
    engine = Engine(scheduler, executor, WallClock())
    return WorkerService("profile", "colocated", engine, msgpack.packb), executor


def decode_service(model: ModelConfig, num_seqs: int, weights, prompt: Callable[[int], list[int]],
                   token_budget: int = 4096, max_tokens: int = 1 << 20) -> tuple[WorkerService, _Recording]:
    """A worker with `num_seqs` requests decoding, their contexts spread over
    64..512 tokens as in serving (room to grow by 512 more): prompts prefilled
    in chunks of the budget, then two decode steps to warm up."""
    svc, rec = profiling_service(model, num_blocks=num_seqs * 64 + 80, token_budget=token_budget, weights=weights)
    for i in range(num_seqs):
        svc.engine.add_request(Request(f"d{i}", prompt(64 + 448 * i // num_seqs), max_tokens=max_tokens))
    sched = svc.engine.scheduler
    while sched.waiting or any(r.is_prefill for r in sched.running):
        _timed_steps(svc, rec, 1)
    _timed_steps(svc, rec, 2)
    return svc, rec


def _timed_steps(svc: WorkerService, rec: _Recording, n: int) -> list[tuple[list[tuple[int, int]], float]]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        if svc.step() is None:
            break
        out.append((rec.pairs, time.perf_counter() - t0))
    return out


def measure_overhead(model: ModelConfig, hardware: HardwareConfig, quick: bool = False) -> OverheadFit:
    """Fit the overhead terms and the calibration scale for `hardware` (whose
    tables were just measured on this machine) from real steps of `model`."""
    bare = dataclasses.replace(hardware, overhead_ms=0.0, overhead_per_seq_ms=0.0, calibration_scale=1.0,
                               frontend_hop_ms=0.0, frontend_message_ms=0.0)
    cost = CostModel(model, bare)
    decode_batches = (1, 4, 16) if quick else (1, 2, 3, 4, 6, 8, 16, 32)
    prefills = (32, 256) if quick else (16, 64, 256, 512, 1024, 2048)
    hybrid_decodes = (2,) if quick else (1, 2, 4, 8)
    rounds = 6 if quick else 24
    samples: dict[tuple[int, int], list[tuple[float, float]]] = {}
    seq = 0
    from testbed.model.loader import load_model
    weights, _ = load_model(model)           # one model for every shape's worker

    def prompt(length: int) -> list[int]:
        nonlocal seq
        seq += 1
        return [(7 * seq + i) % model.vocab_size for i in range(length)]

    decoders = [decode_service(model, b, weights, prompt, max_tokens=rounds + 8) for b in decode_batches]
    # sarathi's hybrid iterations: a 64-token prefill chunk beside b decodes
    prefillers = [(length, *profiling_service(model, num_blocks=length // 16 + 8, token_budget=length,
                                              weights=weights))
                  for length in prefills]
    prefillers += [(64, *decode_service(model, b, weights, prompt, token_budget=64 + b, max_tokens=rounds + 8))
                   for b in hybrid_decodes]
    for _ in range(rounds):
        timed = []
        for svc, rec in decoders:
            timed += _timed_steps(svc, rec, 1)
        for length, svc, rec in prefillers:
            svc.engine.add_request(Request(f"p{seq}", prompt(length), max_tokens=1))
            timed += _timed_steps(svc, rec, 1)
        for pairs, wall in timed:
            key = (len(pairs), sum(q for q, _ in pairs))
            samples.setdefault(key, []).append((wall, cost.iteration_time_s(pairs)))
    # the spread of repeated steps of one shape
    ratios = []
    for xs in samples.values():
        if len(xs) >= rounds // 2:
            walls = [w for w, _ in xs]
            median = float(np.median(walls))
            ratios += [w / median for w in walls]
    rows = []
    for (num_seqs, num_tokens), xs in sorted(samples.items()):
        walls, modeled = zip(*xs)
        rows.append((num_seqs, num_tokens, float(np.median(walls)), float(np.median(modeled))))
    return _fit(rows, ratios)


def _fit(rows: list[tuple[int, int, float, float]], step_ratios: list[float]) -> OverheadFit:
    """wall = a + b·num_seqs + k·modeled, a, b, k >= 0, least relative error:
    the best fit over every subset of the three terms whose coefficients all
    come out non-negative."""
    seqs = np.array([r[0] for r in rows], dtype=np.float64)
    wall = np.array([r[2] for r in rows])
    modeled = np.array([r[3] for r in rows])
    features = np.column_stack([np.ones_like(seqs), seqs, modeled]) / wall[:, None]
    target = np.ones_like(wall)
    best, best_err = np.zeros(3), np.inf
    for active in ([0, 1, 2], [0, 2], [1, 2], [2], [0, 1], [0], [1]):
        coef, *_ = np.linalg.lstsq(features[:, active], target, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[active] = coef
        err = float(np.sum((features @ full - target) ** 2))
        if err < best_err:
            best, best_err = full, err
    return OverheadFit(float(best[0]) * 1e3, float(best[1]) * 1e3, float(best[2]) if best[2] > 0 else 1.0, rows,
                       step_ratios)


def measure_frontend_hop(model: ModelConfig, num_requests: int = 8) -> float:
    """One-way frontend <-> worker latency of the real runtime, in ms: a real
    run of short requests that each find the worker idle; the mean of the
    request's way in (arrival to first scheduled, on one clock) and its first
    token's way out (end of the iteration that sampled it to the frontend
    receiving it)."""
    from testbed.config import RunConfig, WandbConfig
    from testbed.runtime.real import RealRuntime
    from testbed.workloads.build import build_workload
    from testbed.workloads.config import WorkloadConfig
    workload = WorkloadConfig(name="frontend_hop", num_requests=num_requests, arrival="constant", rate=10.0,
                              prompt_dist="fixed", prompt_len=16, output_dist="fixed", output_len=2)
    cfg = RunConfig(model=model, workload=workload, wandb=WandbConfig(mode="disabled"), progress=False,
                    num_kv_blocks=64)
    result = RealRuntime(cfg).run(build_workload(workload, model.vocab_size, 0))
    ends = {it.start_s: it.start_s + it.duration_s for it in result.iterations if it.num_prefill_tokens}
    way_in = [r.first_scheduled_s - r.arrival_s for r in result.records if r.first_scheduled_s is not None]
    way_out = [r.first_token_s - ends[r.first_scheduled_s] for r in result.records
               if r.first_token_s is not None and r.first_scheduled_s in ends]
    if not way_in or not way_out:
        raise RuntimeError("frontend hop: the real run served no request; check `testbed run` works here")
    return 1e3 * (float(np.median(way_in)) + float(np.median(way_out))) / 2


def measure_frontend_message(model: ModelConfig, num_requests: int = 500) -> float:
    """The frontend's time per command, in ms: the colocated controller routing
    short requests, each command packed with msgpack and sent over a loopback
    ZMQ socket, as the real runtime's frontend does."""
    import zmq

    from testbed.modes.base import WorkerInfo
    from testbed.modes.colocated import ColocatedController
    from testbed.workloads.build import build_workload
    from testbed.workloads.config import WorkloadConfig
    workload = WorkloadConfig(name="frontend_message", num_requests=num_requests, prompt_dist="fixed",
                              prompt_len=64, output_dist="fixed", output_len=16)
    requests = build_workload(workload, model.vocab_size, 0)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
        ctl = ColocatedController([WorkerInfo("w", "colocated", 1 << 20, 16)],
                                  lambda _w, msg: push.send(msgpack.packb(msg)))
        t0 = time.perf_counter()
        for req in requests:
            ctl.on_arrival(req, 0.0)
        return (time.perf_counter() - t0) / num_requests * 1e3
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
