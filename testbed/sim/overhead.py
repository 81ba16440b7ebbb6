"""The real engine's per-iteration overhead on this machine: everything an
iteration costs besides what the cost model prices from the GEMM and
attention tables (scheduling, building the inputs, sampling, updating the
requests, packing the events), measured so `runtime=sim hardware=cpu`
predicts the real engine's iteration times, not just its kernels.

Method: a real WorkerService (engine, scheduler, ModelExecutor, events packed
with msgpack as a worker process does) steps batches of known shapes: decode
batches of 1 to 32 requests and whole prefills. Each step's wall time minus
the cost model's prediction with zero overhead is a residual; the residuals
are fitted to overhead_ms + overhead_per_seq_ms · num_seqs (the per-sequence
term is the Python work per scheduled request), both >= 0, on the median
residual of each shape, so a noisy step does not move the fit."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

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
    rows: list[tuple[int, int, float, float]]   # (num_seqs, num_tokens, median step s, median modeled compute s)


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


def _service(model: ModelConfig, num_blocks: int, token_budget: int) -> tuple[WorkerService, _Recording]:
    from testbed.model_executor import ModelExecutor
    bm = BlockManager(num_blocks, 16, enable_prefix_caching=True)
    scheduler = make_scheduler("sarathi", SchedulerConfig(token_budget=token_budget, max_num_seqs=256,
                                                          max_num_batched_tokens=token_budget), bm)
    executor = _Recording(ModelExecutor(model, num_blocks, 16, bm.block_table))
    engine = Engine(scheduler, executor, WallClock())
    return WorkerService("profile", "colocated", engine, msgpack.packb), executor


def _timed_steps(svc: WorkerService, rec: _Recording, n: int) -> list[tuple[list[tuple[int, int]], float]]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        if svc.step() is None:
            break
        out.append((rec.pairs, time.perf_counter() - t0))
    return out


def measure_overhead(model: ModelConfig, hardware: HardwareConfig, quick: bool = False) -> OverheadFit:
    """Fit the overhead terms for `hardware` (whose tables were just measured
    on this machine) from real steps of `model`."""
    bare = dataclasses.replace(hardware, overhead_ms=0.0, overhead_per_seq_ms=0.0)
    cost = CostModel(model, bare)
    decode_batches = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32)
    prefills = (32, 256) if quick else (16, 64, 256, 512)
    steps = 8 if quick else 24
    samples: dict[tuple[int, int], list[tuple[float, float]]] = {}
    seq = 0

    def record(timed):
        for pairs, wall in timed:
            key = (len(pairs), sum(q for q, _ in pairs))
            samples.setdefault(key, []).append((wall, cost.iteration_time_s(pairs)))

    for b in decode_batches:
        svc, rec = _service(model, num_blocks=b * 64 + 64, token_budget=4096)
        for _ in range(b):
            svc.engine.add_request(Request(f"d{seq}", [(7 * seq + i) % model.vocab_size for i in range(200)],
                                           max_tokens=steps + 8))
            seq += 1
        _timed_steps(svc, rec, 2)                    # the prefill, one decode to warm up
        record(_timed_steps(svc, rec, steps))
    for length in prefills:
        svc, rec = _service(model, num_blocks=length // 16 + 8, token_budget=length)
        for _ in range(max(3, steps // 4)):
            svc.engine.add_request(Request(f"p{seq}", [(3 * seq + i) % model.vocab_size for i in range(length)],
                                           max_tokens=1))
            seq += 1
            record(_timed_steps(svc, rec, 1))
    rows = []
    for (num_seqs, num_tokens), xs in sorted(samples.items()):
        walls, modeled = zip(*xs)
        rows.append((num_seqs, num_tokens, float(np.median(walls)), float(np.median(modeled))))
    return _fit(rows)


def _fit(rows: list[tuple[int, int, float, float]]) -> OverheadFit:
    """Residual = a + b·num_seqs with a, b >= 0, minimising relative error
    (a 1-decode step and a 32-decode step count alike)."""
    seqs = np.array([r[0] for r in rows], dtype=np.float64)
    residual = np.array([r[2] - r[3] for r in rows])
    weight = 1.0 / np.array([r[2] for r in rows])
    features = np.column_stack([np.ones_like(seqs), seqs])
    coef, *_ = np.linalg.lstsq(features * weight[:, None], residual * weight, rcond=None)
    if coef[1] < 0:
        coef = np.array([max(0.0, float(np.sum(residual * weight**2) / np.sum(weight**2))), 0.0])
    elif coef[0] < 0:
        coef = np.array([0.0, max(0.0, float(np.sum(residual * seqs * weight**2) / np.sum((seqs * weight)**2)))])
    return OverheadFit(float(coef[0]) * 1e3, float(coef[1]) * 1e3, rows)
