"""Seconds for the two kinds of work the cost model prices, each in two
flavours: a roofline from the hardware's peaks (GPU presets) and a fit to
measurements (this CPU after `testbed profile`). The cost model picks the
measured flavour when the hardware config carries a table.

GEMM timers return a curve: a function of the number of rows m, built once
per group of GEMMs so that the per-iteration call is a few float operations.
Attention timers take the whole batch's query and context lengths as arrays."""
from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Callable, Sequence

import numpy as np

from testbed.kernels.decode_groups import attention_calls
from testbed.sim.layer_shapes import AttentionShape, Gemm

Curve = Callable[[float], float]


class RooflineGemms:
    """max(FLOPs / (peak·eff·m/(m+ramp)), bytes / (bw·eff)) per GEMM, with the
    weights read once per iteration and the activations read and written."""

    def __init__(self, s_per_flop: float, s_per_byte: float, ramp_tokens: float, dtype_bytes: int,
                 weight_bytes: int = 0):
        self.s_per_flop, self.s_per_byte = s_per_flop, s_per_byte
        self.ramp, self.dtype_bytes = ramp_tokens, dtype_bytes
        self.weight_bytes = weight_bytes or dtype_bytes    # W8A8: the weights and the quantized input

    def curve(self, gemms: Sequence[Gemm]) -> Curve:
        b, wb, ramp = self.dtype_bytes, self.weight_bytes, self.ramp
        consts = [(2.0 * g.n * g.k * g.layers * self.s_per_flop,       # s per (row + ramp)
                   g.n * g.k * g.layers * wb * self.s_per_byte,         # s to stream the weights
                   ((g.n + g.k) * b if wb == b else g.n * b + g.k * wb)  # s per row of activations
                   * g.layers * self.s_per_byte)
                  for g in gemms]

        def seconds(m: float) -> float:
            total = 0.0
            for per_row, weights, act in consts:
                compute, memory = per_row * (m + ramp), weights + act * m
                total += compute if compute > memory else memory
            return total
        return seconds


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear through (xs, ys), extended linearly past both ends."""
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class ProfiledGemms:
    """GEMM seconds interpolated over m from rows [m, n, k, seconds]. A shape
    that was not profiled borrows the curve of the profiled shape nearest in
    n·k, scaled by the ratio of n·k (same throughput for similar sizes)."""

    def __init__(self, rows: Sequence[Sequence[float]]):
        points: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
        for m, n, k, s in rows:
            points[(int(n), int(k))].append((float(m), float(s)))
        self._curves = {}
        for shape, pts in points.items():
            pts.sort()
            if len(pts) < 2:
                raise ValueError(f"hardware.gemm_profile: shape n,k={shape} has {len(pts)} row(s); "
                                 "need at least two token counts to interpolate; rerun `testbed profile`")
            self._curves[shape] = ([p[0] for p in pts], [p[1] for p in pts])

    def _seconds_on(self, g: Gemm, ms: list[float]) -> list[float]:
        nk = g.n * g.k
        n, k = min(self._curves, key=lambda s: abs(np.log(s[0] * s[1] / nk)))
        xs, ys = self._curves[(n, k)]
        scale = g.layers * nk / (n * k)
        return [scale * _interp(m, xs, ys) for m in ms]

    def curve(self, gemms: Sequence[Gemm]) -> Curve:
        grid = sorted({m for xs, _ in self._curves.values() for m in xs})
        totals = [sum(col) for col in zip(*(self._seconds_on(g, grid) for g in gemms))] or [0.0] * len(grid)
        return lambda m: _interp(m, grid, totals)


class RooflineAttention:
    """Per slice max(FLOPs / (peak·eff), KV and q/o bytes / (bw·eff)), summed
    over the batch's slices and the layers."""

    def __init__(self, shape: AttentionShape, num_layers: int, s_per_flop: float, s_per_byte: float):
        self.shape, self.num_layers = shape, num_layers
        self.s_per_flop, self.s_per_byte = s_per_flop, s_per_byte

    def seconds(self, q: np.ndarray, ctx: np.ndarray) -> float:
        compute = self.shape.flops(q, ctx)
        compute *= self.s_per_flop
        memory = self.shape.bytes(q, ctx)
        memory *= self.s_per_byte
        return self.num_layers * float(np.maximum(compute, memory, out=compute).sum())

    def seconds_pairs(self, slices: Sequence[tuple[int, int]]) -> float:
        """`seconds` for a short batch in plain Python: a few slices cost less
        than numpy's per-call overhead."""
        shape, s_per_flop, s_per_byte = self.shape, self.s_per_flop, self.s_per_byte
        kv, io = shape.kv_bytes_per_token, shape.io_bytes_per_token
        total = 0.0
        for q, ctx in slices:
            compute = shape.flops(q, ctx) * s_per_flop
            memory = (kv * ctx + io * q) * s_per_byte
            total += compute if compute > memory else memory
        return self.num_layers * total


ATTENTION_COLUMNS = ("single_calls", "batched_calls", "masked_batched_calls", "num_seqs", "causal_flops",
                     "masked_flops", "bytes", "seconds")


def attention_features(shape: AttentionShape, slices: Sequence[tuple[int, int]], block_size: int,
                       budget_tokens: int) -> list[float]:
    """A row of ATTENTION_COLUMNS without the seconds, for one forward of the
    torch backend over (new tokens, context) slices: the SDPA calls
    (kernels/decode_groups.attention_calls); causal_flops of the whole
    prompts (is_causal: the causal half, AttentionShape.flops);
    masked_flops of the chunks on a cached prefix (explicit mask: the whole
    q x ctx rectangle, AttentionShape.masked_flops); bytes of K/V read and
    q/o moved, counting the padding of batched decodes. A decode is priced
    by its bytes: its FLOPs grow with them."""
    calls = attention_calls(slices, block_size, budget_tokens)
    causal = masked = 0.0
    sum_q = sum_ctx = 0
    for q, ctx in slices:
        if q > 1:
            if q == ctx:
                causal += shape.flops(q, ctx)
            else:
                masked += shape.masked_flops(q, ctx)
        sum_q += q
        sum_ctx += ctx
    nbytes = shape.kv_bytes_per_token * (sum_ctx + calls.padding) + shape.io_bytes_per_token * sum_q
    return [float(calls.single), float(calls.batched), float(calls.masked), float(len(slices)),
            float(causal), float(masked), float(nbytes)]


def fit_attention(rows: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Fit rows of ATTENTION_COLUMNS (attention_features and the measured
    seconds of one attention forward) to
    seconds = per_forward + per_single_call·single_calls + per_batched_call·batched_calls
              + per_masked_call·masked_batched_calls + per_seq·num_seqs
              + per_causal_flop·causal_flops + per_masked_flop·masked_flops + per_byte·bytes,
    minimising relative error, every coefficient >= 0 (a term that would come
    out negative is dropped and the rest refitted)."""
    data = np.asarray(rows, dtype=np.float64)
    width = len(ATTENTION_COLUMNS)
    if data.ndim != 2 or data.shape[1] != width or data.shape[0] < width:
        raise ValueError(f"hardware.attention_profile: need at least {width} rows [{', '.join(ATTENTION_COLUMNS)}]; "
                         "rerun `testbed profile`")
    features = np.column_stack([np.ones(len(data)), data[:, :-1]])
    weight = 1.0 / data[:, -1]
    active = list(range(width))
    while True:
        coef, *_ = np.linalg.lstsq(features[:, active] * weight[:, None], data[:, -1] * weight, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(width)
    full[active] = np.maximum(coef, 0.0)
    return tuple(float(c) for c in full)


class ProfiledAttention:
    """The fitted linear model of one measured attention forward per layer of
    the CPU's torch backend (fit_attention over attention_features), which
    carries its fixed per-forward, per-SDPA-call and per-sequence costs
    (decodes of unlike lengths split into several calls, padded and masked;
    like ones share one unmasked call), and prices a chunk on a cached
    prefix (explicit mask: the whole q x ctx rectangle) apart from whole
    prompts (is_causal: the causal half). `block_size`: the KV block size
    the decodes are padded to (16, the default; only group edges depend on
    it)."""

    def __init__(self, shape: AttentionShape, num_layers: int, rows: Sequence[Sequence[float]],
                 block_size: int = 16):
        from testbed.kernels.torch_backend import TorchAttentionBackend     # torch: only for a profiled CPU
        self.shape, self.num_layers, self.block_size = shape, num_layers, block_size
        self._per_forward, *self._coef = fit_attention(rows)
        self.budget_tokens = TorchAttentionBackend.cpu_decode_group_bytes // shape.kv_bytes_per_token

    def seconds_pairs(self, slices: Sequence[tuple[int, int]]) -> float:
        features = attention_features(self.shape, slices, self.block_size, self.budget_tokens)
        return self.num_layers * (self._per_forward + sum(c * x for c, x in zip(self._coef, features)))

    def seconds(self, q: np.ndarray, ctx: np.ndarray) -> float:
        return self.seconds_pairs(list(zip(q.astype(int).tolist(), ctx.astype(int).tolist())))
