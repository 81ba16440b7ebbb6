"""Attention priced per kernel on the GPU presets (hardware.attention_kernel):
an efficiency model by query length and context length for the kernel the
preset's engine runs, instead of one roofline efficiency per chip.

Per layer and iteration:
- a slice with new tokens q > 1 (a whole prompt or a chunk on a cached
  prefix) costs its causal FLOPs (AttentionShape.flops) at
  peak · peak_fraction · q/(q + q_half) · ctx/(ctx + ctx_half): short queries
  leave the kernel's query tiles part-empty and its SMs part-idle; short
  contexts give each tile too few key blocks to hide the pipeline's fill —
  or its KV bytes at decode bandwidth, whichever is longer;
- the decodes (q = 1) stream their KV together at decode_bw_fraction of HBM
  bandwidth, but no faster than the longest one alone at
  single_seq_bw_fraction (one sequence splits its keys over too few SMs).

The GPU presets say which kernel they model. Fractions are of the chip's
datasheet peaks, so a kernel measured on one chip carries to another of the
same generation (stated per kernel)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from testbed.sim.layer_shapes import AttentionShape


# seconds of a fixed head of slices plus a tail, given the tail and whether the vectorized path prices it
TailSeconds = Callable[[Sequence[tuple[int, int]], bool], float | None]


@dataclass(frozen=True)
class AttentionKernel:
    name: str
    peak_fraction: dict[str, float]    # by chip generation (the hardware's gemm_table: "h100", "a100")
    q_half: float                      # query length at half the long-query efficiency
    ctx_half: float                    # context length at half the long-context efficiency
    decode_bw_fraction: float          # batched decodes: fraction of hbm_bw_gbps
    single_seq_bw_fraction: float      # one decode alone: fraction of hbm_bw_gbps
    decode_floor_us: float = 0.0       # per layer, the decodes' call whatever its bytes (launch, reduction)


KERNELS = {
    # The project's Triton paged kernels (kernels/triton_attention.py) on one
    # H200. peak_fraction, q_half, ctx_half: fitted to the 18 Triton rows of
    # experiments/results/h200_prefill.csv (llama3-8b, prompts 4K-128K, whole
    # and in chunks of 2,048 and 512), each row's attention being its measured
    # time less the cost model's GEMMs, elementwise ops and overheads
    # (`python experiments/benchmarks/bench_gpu_presets.py --fit-triton`).
    # Decode fractions: experiments/results/h200_kernels.csv, decode_64x4k at
    # 4,124 GB/s and decode_1x128k at 2,040 GB/s of the datasheet's 4,800.
    # Assumed the same on A100 (not measured there).
    "triton": AttentionKernel("triton", {"h100": 0.314, "a100": 0.314}, q_half=128.0, ctx_half=2048.0,
                              decode_bw_fraction=0.859, single_seq_bw_fraction=0.425),
    # FlashAttention-2 (the flash-attn package's varlen/kvcache kernels).
    # Long-sequence forward throughput: up to 73% of A100's peak (Dao,
    # "FlashAttention-2", arXiv:2307.08691, abstract: "50-73% of the
    # theoretical maximum FLOPs/s on A100", §4.1 up to 230 TFLOP/s), and 35%
    # of H100's (Shah et al., "FlashAttention-3", arXiv:2407.08608, abstract:
    # "FlashAttention-2 achieving only 35% utilization on the H100").
    # q_half, ctx_half: assumed those fitted for triton (no per-length figures
    # quoted here). Decode bandwidth: assumed as the Triton kernel's.
    "flash_attn": AttentionKernel("flash_attn", {"h100": 0.35, "a100": 0.73}, q_half=128.0, ctx_half=2048.0,
                                  decode_bw_fraction=0.859, single_seq_bw_fraction=0.425),
}


# kernels whose efficiency model is fitted at first use to a dataset (module: fitted_kernel())
FITTED_KERNELS = {"fa3_flashinfer": "testbed.sim.blis_attention"}


def attention_kernel_names() -> list[str]:
    return sorted(KERNELS) + sorted(FITTED_KERNELS)


def attention_kernel(name: str, field: str = "hardware.attention_kernel") -> AttentionKernel:
    if name in KERNELS:
        return KERNELS[name]
    if name in FITTED_KERNELS:
        import importlib
        return importlib.import_module(FITTED_KERNELS[name]).fitted_kernel()
    raise ValueError(f"{field}: '{name}' is not known; choose one of: "
                     f"{', '.join(attention_kernel_names())} (or '' for the roofline)")


class KernelAttention:
    """Seconds of the attention of a batch over all layers, for one kernel on one chip."""

    def __init__(self, shape: AttentionShape, num_layers: int, kernel: AttentionKernel,
                 generation: str, peak_flops: float, hbm_bytes_per_s: float):
        if generation not in kernel.peak_fraction:
            raise ValueError(f"hardware.attention_kernel: '{kernel.name}' has no efficiency for '{generation}' "
                             f"chips (it has {sorted(kernel.peak_fraction)})")
        self.shape, self.num_layers, self.kernel = shape, num_layers, kernel
        self._flops_per_s = peak_flops * kernel.peak_fraction[generation]
        self._decode_s_per_byte = 1.0 / (hbm_bytes_per_s * kernel.decode_bw_fraction)
        self._single_s_per_byte = 1.0 / (hbm_bytes_per_s * kernel.single_seq_bw_fraction)
        self._floor_s = kernel.decode_floor_us * 1e-6

    def efficiency(self, q: np.ndarray | float, ctx: np.ndarray | float):
        """Fraction of the long-query, long-context throughput."""
        k = self.kernel
        return q / (q + k.q_half) * ctx / (ctx + k.ctx_half)

    def seconds(self, q: np.ndarray, ctx: np.ndarray) -> float:
        prefill = q > 1
        decode = ~prefill
        return self._vector_s(q[prefill], ctx[prefill], self._decodes_of(q[decode], ctx[decode]))

    def _vector_s(self, qp: np.ndarray, cp: np.ndarray, decodes_s: float | None) -> float:
        """seconds() of the prefills (qp, cp) and the decodes taking decodes_s (None: none)."""
        total = 0.0
        if len(qp):
            compute = self.shape.flops(qp, cp) / (self._flops_per_s * self.efficiency(qp, cp))
            total += float(np.maximum(compute, self.shape.bytes(qp, cp) * self._decode_s_per_byte).sum())
        if decodes_s is not None:
            total += decodes_s
        return self.num_layers * total

    def _decodes_of(self, q: np.ndarray, ctx: np.ndarray) -> float | None:
        if not len(q):
            return None
        nbytes = self.shape.bytes(q, ctx)
        return self._decodes_s(float(nbytes.sum()), float(nbytes.max()))

    def decode_seconds(self, num_decodes: int, context_tokens: int, longest_context: int) -> float:
        """seconds() of `num_decodes` decodes (q = 1) alone whose contexts sum
        to `context_tokens`, the longest `longest_context`: the same float."""
        return self.decode_seconds_of(num_decodes)(context_tokens, longest_context)

    def decode_seconds_of(self, num_decodes: int) -> Callable[[int, int], float]:
        """decode_seconds(num_decodes, ...) as a function of the contexts' sum
        and longest, _decodes_s inlined (a DecodeRun prices every iteration with it)."""
        shape = self.shape
        kv, io = shape.kv_bytes_per_token, shape.io_bytes_per_token
        io_decodes, num_layers = io * num_decodes, self.num_layers
        decode_s_per_byte, single_s_per_byte, floor = self._decode_s_per_byte, self._single_s_per_byte, self._floor_s

        def seconds(context_tokens: int, longest_context: int) -> float:
            return num_layers * (0.0 + (max((kv * context_tokens + io_decodes) * decode_s_per_byte,
                                            (kv * longest_context + io) * single_s_per_byte) + floor))
        return seconds

    def _decodes_s(self, decode_bytes: float, longest_bytes: float) -> float:
        """The decodes stream their KV together, no faster than the longest one alone."""
        return max(decode_bytes * self._decode_s_per_byte, longest_bytes * self._single_s_per_byte) + self._floor_s

    def seconds_pairs(self, slices: Sequence[tuple[int, int]]) -> float:
        return self._pairs_s(self._accumulate((0.0, 0.0, 0.0), slices))

    def seconds_after(self, head: Sequence[tuple[int, int]]) -> TailSeconds:
        """The seconds of head + tail as a function of tail and of which path
        prices it (vectorized: seconds(), else seconds_pairs()), the same
        float, head's part done once: a budget search prices one set of
        decodes with many candidate chunks. None where a vectorized tail
        holds a decode (it would change the decodes' sum)."""
        state = self._accumulate((0.0, 0.0, 0.0), head)
        longer = [(q, c) for q, c in head if q > 1]
        decodes: list = []            # the head's decodes' seconds on the vectorized path, once asked

        def seconds(tail: Sequence[tuple[int, int]], vectorized: bool) -> float | None:
            if not vectorized:
                return self._pairs_s(self._accumulate(state, tail))
            if any(q <= 1 for q, _ in tail):
                return None
            if not decodes:
                q, ctx = np.array([(q, c) for q, c in head if q <= 1], dtype=np.float64).reshape(-1, 2).T
                decodes.append(self._decodes_of(q, ctx))
            prefills = longer + list(tail)
            qp, cp = np.array(prefills, dtype=np.float64).reshape(-1, 2).T
            return self._vector_s(qp, cp, decodes[0])
        return seconds

    def _accumulate(self, state: tuple, slices: Sequence[tuple[int, int]]) -> tuple:
        """(prefills' seconds, decodes' bytes, the longest decode's bytes) after `slices`, from `state`."""
        shape = self.shape
        kv, io = shape.kv_bytes_per_token, shape.io_bytes_per_token
        total, decode_bytes, longest = state
        for q, ctx in slices:
            nbytes = kv * ctx + io * q
            if q > 1:
                compute = shape.flops(q, ctx) / (self._flops_per_s * self.efficiency(q, ctx))
                memory = nbytes * self._decode_s_per_byte
                total += compute if compute > memory else memory
            else:
                decode_bytes += nbytes
                longest = max(longest, nbytes)
        return total, decode_bytes, longest

    def _pairs_s(self, state: tuple) -> float:
        total, decode_bytes, longest = state
        if decode_bytes:
            total += self._decodes_s(decode_bytes, longest)
        return self.num_layers * total
