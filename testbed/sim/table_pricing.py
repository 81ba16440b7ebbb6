"""GEMM and elementwise seconds for any shape, from measured operator tables
(operator_table.py): the GPU presets' replacement for a roofline with one
efficiency per chip.

GEMMs. Each profiled (n, k) is a curve of seconds over m. A shape never
profiled is priced at every m of the tables' grid by a locally weighted
regression of log seconds on (log n, log k) over the profiled shapes, nearer
shapes weighing more (a Gaussian kernel in log space), with the slopes pulled
towards seconds ∝ n·k (what both the memory-bound and the compute-bound
limits predict) where few neighbours constrain them. This carries what a
roofline misses: small-m GEMMs below peak bandwidth, fixed launch latency,
tile and wave quantisation, each as measured on shapes of similar size.

Elementwise ops (norms, rope, activation, residual add, embedding) are the
same, per op and kernel kind, keyed by the width of one token's row instead
of (n, k); a kernel kind no profiled model ran is priced by the bytes it moves.

Past the tables' largest m, a GEMM grows linearly at the throughput of its
largest profiled rows (compute-bound), an elementwise op linearly too
(bandwidth-bound). Times are for the tables' dtype (bf16/fp16) on
the tables' GPU; `RooflineRatio` transfers them to another chip or dtype."""
from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from testbed.sim.elementwise_kernels import KERNELS, bytes_moved_per_token
from testbed.sim.layer_shapes import Gemm
from testbed.sim.operator_table import ElementwiseSample, GemmSample

Curve = Callable[[float], float]

# Kernel width in natural log units (0.35: shapes within ~1.4x weigh most)
# and the pull of the slopes towards 1 (a fraction of the total weight).
# Chosen once by reasoning about the tables' spacing (shapes of neighbouring
# TP degrees differ by 2x); experiments/benchmarks/bench_gpu_presets.py --bandwidth prints
# the leave-one-model-out error at other widths.
BANDWIDTH = 0.35
SLOPE_PRIOR = 0.05


def local_loglinear(x_train: np.ndarray, y_train: np.ndarray, x_query: np.ndarray,
                    bandwidth: float = BANDWIDTH, prior: float = SLOPE_PRIOR) -> np.ndarray:
    """Fit y ≈ a + Σ b_j·x_j around one query point and evaluate it there.

    x_train [num_points, dims] and x_query [dims] are log features; y_train
    [num_points, num_outputs] log values (one column per output sharing the
    weights, e.g. one per m). Slopes are pulled towards 1 with strength
    `prior` x the total weight. Returns [num_outputs]."""
    d2 = ((x_train - x_query) ** 2).sum(axis=1)
    w = np.exp(-0.5 * d2 / bandwidth ** 2)
    w /= w.sum()
    centred = x_train - x_query            # the intercept is then the value at the query
    design = np.column_stack([np.ones(len(w)), centred])
    lhs = design.T @ (design * w[:, None])
    rhs = design.T @ (y_train * w[:, None])
    penalty = np.diag([0.0] + [prior] * centred.shape[1])
    target = np.zeros((design.shape[1], y_train.shape[1]))
    target[1:] = 1.0
    coef = np.linalg.solve(lhs + penalty, rhs + penalty @ target)
    return coef[0]


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Linear through (xs, ys) inside, proportional to x past the end (the
    last point's throughput); xs ascending from > 0."""
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _median_curve(points: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """x ascending and the median y of repeated x."""
    by_x: dict[float, list[float]] = defaultdict(list)
    for x, y in points:
        by_x[x].append(y)
    xs = sorted(by_x)
    # statistics.median: np.median's value (the middle one, or the mean of the two) at ~1/20 of
    # its per-call cost, which made this most of a GPU preset's start-up (~30K groups)
    return np.array(xs), np.array([float(statistics.median(by_x[x])) for x in xs])


def _extend(xs: np.ndarray, ys: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """A shape's curve on the whole grid: interpolated inside its range, past
    it at the mean throughput of its rows within the top quarter of x."""
    tail = xs >= 0.75 * xs[-1]
    per_x = float(np.mean(ys[tail] / xs[tail]))
    inside = np.interp(grid, xs, ys)
    return np.where(grid > xs[-1], per_x * grid, inside)


class CurveFamily:
    """Seconds over m for any shape key (a tuple of positive sizes), from the
    profiled keys' curves: the profiled grid of m, and at each m the local
    log-linear regression over the keys (local_loglinear)."""

    def __init__(self, points: dict[tuple[int, ...], list[tuple[float, float]]], bandwidth: float = BANDWIDTH):
        if not points:
            raise ValueError("CurveFamily: no samples (an empty operator table?)")
        self.grid = np.array(sorted({m for pts in points.values() for m, _ in pts}), dtype=np.float64)
        keys = sorted(points)
        self._x = np.log(np.array(keys, dtype=np.float64))                      # [num_keys, dims]
        self._y = np.log(np.array([_extend(*_median_curve(points[key]), self.grid)
                                   for key in keys]))                           # [num_keys, len(grid)]
        self.bandwidth = bandwidth
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    def seconds_on_grid(self, key: tuple[int, ...]) -> np.ndarray:
        """[len(grid)] seconds of one shape at the grid's m."""
        key = tuple(int(v) for v in key)
        if key not in self._cache:
            q = np.log(np.array(key, dtype=np.float64))
            self._cache[key] = np.exp(local_loglinear(self._x, self._y, q, self.bandwidth))
        return self._cache[key]

    def seconds(self, m: float, key: tuple[int, ...]) -> float:
        return _interp(m, self.grid, self.seconds_on_grid(key))


class TableGemms:
    """Seconds of y[m, n] = x[m, k] @ W[k, n] for any (m, n, k) from GEMM samples."""

    def __init__(self, samples: Sequence[GemmSample], bandwidth: float = BANDWIDTH):
        points: dict[tuple[int, ...], list[tuple[float, float]]] = defaultdict(list)
        for s in samples:
            points[(s.n, s.k)].append((float(s.m), s.seconds))
        self.family = CurveFamily(points, bandwidth)
        self.grid = self.family.grid

    def seconds(self, m: float, n: int, k: int) -> float:
        return self.family.seconds(m, (n, k))

    def curve(self, gemms: Sequence[Gemm], scale: Callable[[Gemm, np.ndarray], np.ndarray] | None = None) -> Curve:
        """Seconds of every GEMM in `gemms` (x its layers) as a function of m;
        `scale(gemm, grid)` multiplies each GEMM's times (chip or dtype transfer)."""
        total = np.zeros_like(self.grid)
        for g in gemms:
            t = self.family.seconds_on_grid((g.n, g.k)) * g.layers
            total += t * scale(g, self.grid) if scale else t
        xs, ys = self.grid.tolist(), total.tolist()
        return lambda m: _interp(m, xs, ys)


# The bytes price of an op whose kernel no profiled model ran: its bandwidth
# from the op's rows at m >= BYTES_FIT_MIN_M (bandwidth-bound), its launch
# floor from the rows at m <= FLOOR_MAX_M (latency-bound); fixed a priori.
BYTES_FIT_MIN_M = 1024
FLOOR_MAX_M = 16


@dataclass(frozen=True)
class BytesPrice:
    """max(launches x launch floor, bytes / bandwidth): an elementwise op
    priced by the bytes it moves, for a kernel the tables never measured."""
    bytes_per_s: float
    floor_s: float                 # per launch

    def seconds(self, m: float, bytes_per_token: float, launches: int = 1) -> float:
        return max(launches * self.floor_s, m * bytes_per_token / self.bytes_per_s)


class TableElementwise:
    """Seconds of an elementwise op over m tokens of `width` elements each,
    per (op, kernel kind). Keyed by (width,), not by m·width: vLLM's row
    kernels (norms, activation, rope) run one thread block per token, so at
    small m the time follows the width of a row, not the elements in all.
    A kernel no profiled model ran (LayerNorm where every model ran RMSNorm)
    is priced by the bytes it moves (elementwise_kernels.py) at the bandwidth
    and launch floor the op's other kernels show, never by a neighbour's curve."""

    def __init__(self, samples: Sequence[ElementwiseSample], bandwidth: float = BANDWIDTH, dtype_bytes: int = 2):
        by_kernel: dict[tuple[str, str], dict[tuple[int, ...], list[tuple[float, float]]]] = \
            defaultdict(lambda: defaultdict(list))
        for s in samples:
            by_kernel[(s.op, s.kernel)][(s.width,)].append((float(s.m), s.seconds))
        self._families = {key: CurveFamily(points, bandwidth) for key, points in by_kernel.items()}
        self.dtype_bytes = dtype_bytes
        by_op: dict[str, list[ElementwiseSample]] = defaultdict(list)
        for s in samples:
            by_op[s.op].append(s)
        self._bytes = {op: price for op, rows in by_op.items() if (price := self._bytes_price(rows))}

    def _bytes_price(self, samples: Sequence[ElementwiseSample]) -> BytesPrice | None:
        """None where the rows reach neither regime (no bandwidth-bound or no latency-bound m)."""
        rate = [s.m * bytes_moved_per_token(s.kernel, s.width, self.dtype_bytes) / s.seconds
                for s in samples if s.m >= BYTES_FIT_MIN_M]
        floor = [s.seconds / KERNELS[s.kernel].launches for s in samples if s.m <= FLOOR_MAX_M]
        if not rate or not floor:
            return None
        return BytesPrice(float(statistics.median(rate)), float(statistics.median(floor)))

    @property
    def kernels(self) -> list[tuple[str, str]]:
        return sorted(self._families)

    def seconds(self, op: str, m: float, width: int, kernel: str) -> float:
        if (op, kernel) in self._families:
            return self._families[(op, kernel)].seconds(m, (width,))
        if op not in self._bytes:
            raise ValueError(f"the operator table has no '{op}' rows at m <= {FLOOR_MAX_M} and m >= {BYTES_FIT_MIN_M} "
                             f"to price the '{kernel}' kernel by bytes; profile '{op}' on this GPU")
        return self._bytes[op].seconds(m, bytes_moved_per_token(kernel, width, self.dtype_bytes), KERNELS[kernel].launches)

    def curve(self, ops: Sequence[tuple[str, str, int, int]], scale: float = 1.0) -> Curve:
        """Seconds of (op, kernel, width, layers) as a function of m."""
        # every family's grid: a kernel seen in fewer models may stop at a smaller m
        grid = np.array(sorted({float(m) for fam in self._families.values() for m in fam.grid}))
        total = np.zeros_like(grid)
        for op, kernel, width, layers in ops:
            total += np.array([self.seconds(op, m, width, kernel) for m in grid]) * layers
        xs, ys = grid.tolist(), (total * scale).tolist()
        return lambda m: _interp(m, xs, ys)


@dataclass(frozen=True)
class RooflineRatio:
    """Transfers a time measured on one chip in one dtype to another chip or
    dtype by the ratio of their rooflines for the same GEMM:
    max(2mnk / peak, bytes / bandwidth), without efficiencies. 1 where source
    and target are the same; a memory-bound GEMM moves with the bandwidth, a
    compute-bound one with the peak. The fixed latencies the table carries
    are scaled too (a stated approximation). A target whose weights are
    narrower than its activations (W8A8: fp8 weights, bfloat16 model) reads
    the weights and the quantized input at target_weight_bytes and writes the
    output at target_dtype_bytes, at the peak of target_flops."""
    source_flops: float            # FLOP/s of the table's chip in its dtype
    source_bytes_per_s: float
    source_dtype_bytes: int
    target_flops: float
    target_bytes_per_s: float
    target_dtype_bytes: int
    target_weight_bytes: int = 0   # 0: target_dtype_bytes

    @property
    def identity(self) -> bool:
        return (self.source_flops, self.source_bytes_per_s, self.source_dtype_bytes) == \
            (self.target_flops, self.target_bytes_per_s, self.target_dtype_bytes) and \
            self.target_weight_bytes in (0, self.target_dtype_bytes)

    def gemm(self, g: Gemm, m: np.ndarray) -> np.ndarray:
        def roof(flops, bw, b, wb):
            if wb in (0, b):
                nbytes = (g.n * g.k + m * (g.n + g.k)) * b
            else:
                nbytes = (g.n * g.k + m * g.k) * wb + m * g.n * b
            return np.maximum(2.0 * m * g.n * g.k / flops, nbytes / bw)
        return (roof(self.target_flops, self.target_bytes_per_s, self.target_dtype_bytes, self.target_weight_bytes)
                / roof(self.source_flops, self.source_bytes_per_s, self.source_dtype_bytes, 0))

    def streaming(self) -> float:
        """For a bandwidth-bound op: source over target bytes per second, per element."""
        return (self.target_dtype_bytes / self.target_bytes_per_s) / (self.source_dtype_bytes / self.source_bytes_per_s)
