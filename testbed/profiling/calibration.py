"""Calibrating the cost model to the real engine on this machine: what an
iteration costs besides what the GEMM and attention tables price
(scheduling, building the inputs, sampling, updating the requests, packing
the events), and how much slower the kernels run inside the engine than
alone in the profiler, so that `runtime=sim hardware=cpu` predicts the real
engine's iteration times, not just its kernels.

Method: real WorkerServices (engine, scheduler, ModelExecutor, events
encoded as a worker process does) step batches of known shapes (decode
batches of spread and of like contexts, whole prefills, a chunk beside
decodes), a few steps of each shape in a row per round, rounds interleaved
so that whatever else runs on the machine spreads over all shapes alike.
Each shape's median step time is fitted to
    overhead_ms + overhead_per_seq_ms · num_seqs + overhead_per_token_ms · num_tokens
        + calibration_scale · modeled
where `modeled` is the cost model's time without overhead; all four >= 0,
minimising relative error (a 1-decode step and a 512-token prefill count
alike). Three real serving runs (worker process, frontend, ZMQ;
measure_serving), spread over the rounds, add their iterations, batches
recovered from the records, to the fit: the rounds pin how a step's time
depends on its shape, the serving runs what serving costs. The same runs give
the frontend <-> worker hop and the step jitter (jitter.py); last, the
frontend's own time per command. experiments/README.md ("Calibration notes")
has the measurements that shaped this method."""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Callable

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
from testbed.sim.engine_config import EngineConfig
from testbed.runtime.wire import encode
from testbed.worker import WorkerService

# the engine while its terms are being measured: no host time, no launches
UNMEASURED_ENGINE = EngineConfig(name="testbed-unmeasured")


@dataclass
class OverheadFit:
    overhead_ms: float
    overhead_per_seq_ms: float
    overhead_per_token_ms: float
    calibration_scale: float
    # (num_seqs, num_tokens, median step s, median modeled s, number of steps)
    rows: list[tuple[int, int, float, float, int]]
    serving_rows: list[tuple[int, int, float, float, int]] = dataclasses.field(default_factory=list)  # served
    serving: ServingRun | None = None        # the serving runs the fit saw, merged

    def predict_ms(self, num_seqs: int, num_tokens: int, modeled_s: float) -> float:
        return (self.overhead_ms + self.overhead_per_seq_ms * num_seqs + self.overhead_per_token_ms * num_tokens
                + self.calibration_scale * modeled_s * 1e3)


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
    return WorkerService("profile", engine, encode), executor


def decode_service(model: ModelConfig, num_seqs: int, weights, prompt: Callable[[int], list[int]],
                   token_budget: int = 4096, max_tokens: int = 1 << 20,
                   spread: bool = True) -> tuple[WorkerService, _Recording]:
    """A worker with `num_seqs` requests decoding, their contexts spread over
    64..512 tokens as in serving (or all 128 with spread=False: a burst of
    like prompts, one SDPA call for all), with room to grow by 512 more:
    prompts prefilled in chunks of the budget, then two decode steps to warm up."""
    svc, rec = profiling_service(model, num_blocks=num_seqs * 64 + 80, token_budget=token_budget, weights=weights)
    for i in range(num_seqs):
        length = 64 + 448 * i // num_seqs if spread else 128
        svc.engine.add_request(Request(f"d{i}", prompt(length), max_tokens=max_tokens))
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


def measure_overhead(model: ModelConfig, hardware: HardwareConfig, quick: bool = False,
                     serve: Callable[[], ServingRun] | None = None) -> OverheadFit:
    """Fit the overhead terms and the calibration scale for `hardware` (whose
    tables were just measured on this machine) from real steps of `model`:
    the rounds below, and the iterations of real serving runs if `serve` is
    given: one before the rounds, one halfway and one after (quick: one), so
    that the fit, whose two kinds of rows otherwise come from two different
    stretches of time, sees this machine over a minute or two."""
    bare = dataclasses.replace(hardware, calibration_scale=1.0, frontend_hop_ms=0.0, frontend_message_ms=0.0)
    cost = CostModel(model, bare, engine=UNMEASURED_ENGINE)
    decode_batches = (1, 4, 16) if quick else (1, 2, 3, 4, 6, 8, 16, 32)
    like_batches = (8,) if quick else (4, 8, 16)          # decodes of one length: one SDPA call, no mask
    prefills = (32, 256) if quick else (16, 64, 256, 512, 1024, 2048)
    hybrid_decodes = (2,) if quick else (1, 2, 4, 8)
    # every round steps each shape `burst` times in a row and keeps all but the
    # first, as serving runs the same batch step after step: stepped once per
    # round between 20 other shapes, a 1-decode step found the weights gone
    # from cache and took 3.7 ms where serving takes 2.8-3.1 (2.8 back to back)
    rounds, burst = (3, 3) if quick else (8, 4)
    samples: dict[tuple, list[tuple[float, float]]] = {}     # by (served, num_seqs, num_tokens, kind)
    seq = 0
    from testbed.model.loader import load_model
    weights, _ = load_model(model)           # one model for every shape's worker

    def prompt(length: int) -> list[int]:
        nonlocal seq
        seq += 1
        return [(7 * seq + i) % model.vocab_size for i in range(length)]

    steps = rounds * burst + 8
    decoders = [("spread", *decode_service(model, b, weights, prompt, max_tokens=steps)) for b in decode_batches]
    decoders += [("like", *decode_service(model, b, weights, prompt, max_tokens=steps, spread=False))
                 for b in like_batches]
    # sarathi's hybrid iterations: a 64-token prefill chunk beside b decodes
    prefillers = [(length, *profiling_service(model, num_blocks=length // 16 + 8, token_budget=length,
                                              weights=weights))
                  for length in prefills]
    prefillers += [(64, *decode_service(model, b, weights, prompt, token_budget=64 + b, max_tokens=steps))
                   for b in hybrid_decodes]

    def record(kind: str, timed: list[tuple[list[tuple[int, int]], float]]) -> None:
        for pairs, wall in timed:
            key = (kind == "serving", len(pairs), sum(q for q, _ in pairs), kind)
            samples.setdefault(key, []).append((wall, cost.iteration_time_s(pairs)))

    # the rounds after which to serve (-1: before the first)
    serve_after = ({-1} if quick else {-1, (rounds - 1) // 2, rounds - 1}) if serve else set()
    runs = [serve()] if -1 in serve_after else []
    for round_index in range(rounds):
        for kind, svc, rec in decoders:
            record(kind, _timed_steps(svc, rec, burst)[1:])
        for length, svc, rec in prefillers:
            for i in range(burst):
                svc.engine.add_request(Request(f"p{seq}", prompt(length), max_tokens=1))
                step = _timed_steps(svc, rec, 1)
                record("prefill", step if i else [])
        if round_index in serve_after:
            runs.append(serve())
    serving = ServingRun.merge(runs) if runs else None
    record("serving", serving.steps if serving else [])
    rows, serving_rows = [], []
    for (served, num_seqs, num_tokens, _), xs in sorted(samples.items()):
        walls, modeled = zip(*xs)
        (serving_rows if served else rows).append(
            (num_seqs, num_tokens, float(np.median(walls)), float(np.median(modeled)), len(xs)))
    return dataclasses.replace(_fit(rows, serving_rows), serving=serving)


def _fit(rows: list[tuple[int, int, float, float, int]],
         serving_rows: list[tuple[int, int, float, float, int]]) -> OverheadFit:
    """wall = a + b·num_seqs + c·num_tokens + k·modeled, all >= 0, least
    relative error over both kinds of rows, one vote per shape (weighting by
    the number of steps let the few decode shapes a serving run repeats
    hundreds of times decide alone, and priced 2K prefills 19% high): the best
    fit over every subset of the four terms whose coefficients all come out
    non-negative."""
    both = rows + serving_rows
    seqs = np.array([r[0] for r in both], dtype=np.float64)
    tokens = np.array([r[1] for r in both], dtype=np.float64)
    wall = np.array([r[2] for r in both])
    modeled = np.array([r[3] for r in both])
    features = np.column_stack([np.ones_like(seqs), seqs, tokens, modeled]) / wall[:, None]
    target = np.ones_like(wall)
    best, best_err = np.zeros(4), np.inf
    for size in range(4, 0, -1):
        for active in itertools.combinations(range(4), size):
            coef, *_ = np.linalg.lstsq(features[:, list(active)], target, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(4)
            full[list(active)] = coef
            err = float(np.sum((features @ full - target) ** 2))
            if err < best_err:
                best, best_err = full, err
    return OverheadFit(float(best[0]) * 1e3, float(best[1]) * 1e3, float(best[2]) * 1e3,
                       float(best[3]) if best[3] > 0 else 1.0, rows, serving_rows)


@dataclass
class ServingRun:
    """A real serving run, as calibration uses it."""
    steps: list[tuple[list[tuple[int, int]], float]]   # (batch as (new tokens, context) pairs, seconds)
    step_deviations_ms: list[float]   # each decode-only step minus the median step with as many decodes
    hop_ms: float                # one way, frontend <-> worker process

    @staticmethod
    def merge(runs: list[ServingRun]) -> ServingRun:
        """Several runs as one: every step (a shape's median is then over all
        runs), every deviation (each from its own run's medians, so the
        machine's speed moving between runs is not counted as step noise),
        the median hop."""
        return ServingRun([s for r in runs for s in r.steps], [d for r in runs for d in r.step_deviations_ms],
                          float(np.median([r.hop_ms for r in runs])))


def measure_serving(model: ModelConfig, hardware: HardwareConfig, quick: bool = False,
                    min_steps: int = 30) -> ServingRun:
    """Serve a workload on the real runtime (worker process, frontend, ZMQ)
    and recover each iteration's batch: Poisson arrivals of prompts of 16 to
    384 tokens with answers of 16 to 96 tokens, and three long prompts
    (1024 to 2048 tokens) landing among them, each prefilled whole (the
    budget holds any prompt beside the decodes). A prefill slice is (P, P) for
    every request first scheduled in that iteration; a decode slice is
    (1, P + j) for a request's token j > 0, which the iteration sampled (the
    last iteration to end before the frontend received it). An iteration
    whose slices do not add up to its prefill and decode tokens and its KV
    read (Executor.kv_bytes_read: every slice's context) is left out.
    (Sharing the iteration's KV read evenly among its decodes instead priced
    2 to 5 decodes of different lengths as one unmasked SDPA call of like
    ones, 20-45% below what they cost.) Decode-only steps with as many
    decodes, in groups of >= `min_steps`, give the step deviations. The hop
    is the mean of the median way in (arrival to first scheduled, for
    requests that found the worker idle; one clock) and the median way out
    (the end of the iteration that sampled a token to the frontend receiving
    it)."""
    from testbed.config import RunConfig, WandbConfig
    from testbed.runtime.real import RealRuntime
    from testbed.workloads.build import build_workload
    from testbed.workloads.config import WorkloadConfig
    num_requests = 16 if quick else 64
    long_prompts = [512] if quick else [1024, 1536, 2048]
    workload = WorkloadConfig(name="serving_calibration", num_requests=num_requests, arrival="poisson", rate=5.0,
                              prompt_dist="uniform", prompt_len=16, prompt_max=384,
                              output_dist="uniform", output_len=16, output_max=96,
                              inject_arrival_s=[3.0 * (i + 1) for i in range(len(long_prompts))],
                              inject_prompt_len=long_prompts, inject_output_len=[16] * len(long_prompts))
    budget = max(long_prompts) + 512         # any prompt whole beside the decodes
    # `hardware` only so that RunConfig does not load the cpu preset this run is about to replace
    cfg = RunConfig(model=model, workload=workload, hardware=hardware, engine=UNMEASURED_ENGINE,
                    wandb=WandbConfig(mode="disabled"),
                    progress=False, token_budget=budget, max_num_batched_tokens=budget,
                    num_kv_blocks=num_requests * 32 + sum(long_prompts) // 16 + 16)
    result = RealRuntime(cfg).run(build_workload(workload, model.vocab_size, 0))
    ends = [it.start_s + it.duration_s for it in result.iterations]
    order = sorted(range(len(ends)), key=ends.__getitem__)
    sorted_ends = [ends[i] for i in order]
    slices: dict[int, list[tuple[int, int]]] = {}          # iteration index -> (new tokens, context)
    start_index = {it.start_s: i for i, it in enumerate(result.iterations)}
    for r in result.records:
        if r.first_scheduled_s in start_index:
            slices.setdefault(start_index[r.first_scheduled_s], []).append((r.prompt_len, r.prompt_len))
        for j, t in enumerate(r.token_times_s[1:], start=1):
            k = bisect.bisect_right(sorted_ends, t)
            if k:
                slices.setdefault(order[k - 1], []).append((1, r.prompt_len + j))
    steps, by_decodes = [], {}
    for i, it in enumerate(result.iterations):
        pairs = slices.get(i, [])
        if (sum(q for q, _ in pairs if q > 1) != it.num_prefill_tokens
                or sum(q == 1 for q, _ in pairs) != it.num_decode_tokens
                or sum(ctx for _, ctx in pairs) * model.kv_bytes_per_token != it.kv_bytes_read):
            continue
        if not it.num_prefill_tokens:
            by_decodes.setdefault(it.num_decode_tokens, []).append(it.duration_s)
        steps.append((pairs, it.duration_s))
    deviations = []
    for secs in by_decodes.values():
        if len(secs) >= min_steps:
            median = float(np.median(secs))
            deviations += [(s - median) * 1e3 for s in secs]
    starts = sorted(it.start_s for it in result.iterations)
    way_out = [t - sorted_ends[i - 1] for r in result.records for t in r.token_times_s
               if (i := bisect.bisect_right(sorted_ends, t)) > 0]
    way_in = []
    for r in result.records:
        i = bisect.bisect_left(starts, r.arrival_s)      # the first iteration starting after the arrival
        idle = i == 0 or sorted_ends[i - 1] <= r.arrival_s       # nothing ran when it arrived
        if idle and i < len(starts) and starts[i] == r.first_scheduled_s:
            way_in.append(r.first_scheduled_s - r.arrival_s)
    if len(steps) < num_requests or len(deviations) < 2 * min_steps or len(way_in) < 3:
        raise RuntimeError(f"serving calibration: the real run gave {len(steps)} iterations, {len(deviations)} "
                           f"decode steps in groups of >= {min_steps} and {len(way_in)} arrivals at an idle "
                           "worker; check `testbed run` works here")
    return ServingRun(steps, deviations, 1e3 * (float(np.median(way_in)) + float(np.median(way_out))) / 2)


def measure_frontend_message(model: ModelConfig, host: str, num_requests: int = 500, repeats: int = 5) -> float:
    """The frontend's time per command, in ms: the colocated controller routing
    short requests, each command packed with msgpack and sent over a loopback
    ZMQ socket, as the real runtime's frontend does; the best of `repeats`
    (right after a real run its worker process may still be exiting)."""
    import zmq

    from testbed.modes.base import WorkerInfo
    from testbed.modes.colocated import ColocatedController
    from testbed.modes.routers import RoundRobin
    from testbed.workloads.build import build_workload
    from testbed.workloads.config import WorkloadConfig
    workload = WorkloadConfig(name="frontend_message", num_requests=num_requests, prompt_dist="fixed",
                              prompt_len=64, output_dist="fixed", output_len=16)
    requests = build_workload(workload, model.vocab_size, 0)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        push.connect(f"tcp://{host}:{pull.bind_to_random_port(f'tcp://{host}')}")
        best = float("inf")
        for _ in range(repeats):
            ctl = ColocatedController([WorkerInfo("w", "colocated", 1 << 20, 16)],
                                      lambda _w, msg: push.send(encode(msg)), RoundRobin())
            t0 = time.perf_counter()
            for req in requests:
                ctl.on_arrival(req, 0.0)
            best = min(best, (time.perf_counter() - t0) / num_requests * 1e3)
        return best
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
