"""Which kernel runs an elementwise op of a layer, how many elements it moves
per token and how many launches it takes: what the GPU presets' elementwise
pricing (table_pricing.py) keys on, so that a model is priced by the kernels
it runs, not by the name of a profiled model that happens to be near in width.

The norms are RMSNorm or LayerNorm (phi-2, Falcon); the MLP activation is
SiLU-and-mul for a gated MLP, GELU otherwise; the residual add sums two rows,
or three in a parallel attention/MLP block (phi-2, Falcon: two adds). The
counts follow the ops as Vidur's profiler runs them (vidur/profiling/mlp/
mlp_impl.py at the commit the vidur-profiles manifest names: an unfused RMSNorm(x), torch.nn.LayerNorm, SiLU-and-mul,
torch.nn.GELU, `residual + x` or `attn + mlp + residual`). Elements moved are
reads plus writes per token, in units of the op's width (the elements of one
token's row, operator_table.ProfiledModel.elementwise_width); they carry a
bandwidth measured on one kernel to another whose rows no table holds."""
from __future__ import annotations

from dataclasses import dataclass

NORM_OPS = ("input_layernorm", "post_attention_layernorm")
NORMS = ("rms_norm", "layer_norm")


@dataclass(frozen=True)
class ElementwiseKernel:
    moved: int           # elements read + written per token, in widths
    launches: int = 1


KERNELS = {
    "rms_norm": ElementwiseKernel(2),        # reads x, writes y (width h)
    "layer_norm": ElementwiseKernel(2),
    "silu_and_mul": ElementwiseKernel(1),    # width 3·inter already: reads gate and up, writes their product
    "gelu": ElementwiseKernel(1),            # width 2·inter already: reads inter, writes inter
    "add": ElementwiseKernel(3),             # residual + x (width h)
    "add3": ElementwiseKernel(6, 2),         # attn + mlp + residual: two adds of two rows
    "attn_rope": ElementwiseKernel(2),       # rewrites q and k in place (width: their elements)
    "emb": ElementwiseKernel(2),             # gathers one row of the table, writes it (width h)
}


def elementwise_kernel(op: str, norm: str, gated: bool, parallel_block: bool) -> str:
    """The kernel kind of table op `op` in a model with this norm, MLP and block."""
    if op in NORM_OPS:
        if norm not in NORMS:
            raise ValueError(f"model norm: '{norm}' is not a known norm kernel; choose one of: {', '.join(NORMS)}")
        return norm
    if op == "mlp_act":
        return "silu_and_mul" if gated else "gelu"
    if op == "add":
        return "add3" if parallel_block else "add"
    return op


def bytes_moved_per_token(kernel: str, width: int, dtype_bytes: int) -> int:
    return KERNELS[kernel].moved * width * dtype_bytes
