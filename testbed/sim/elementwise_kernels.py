"""Which kernel runs an elementwise op of a layer, and how many elements it
moves per token: what the GPU presets' elementwise pricing (table_pricing.py)
keys on, so that a model is priced by the kernel it runs, not by the name of
a profiled model that happens to be near in width.

The norms are RMSNorm (vLLM's fused add + RMSNorm) or LayerNorm (phi-2,
Falcon); the MLP activation is SiLU-and-mul for a gated MLP, GELU otherwise.
The other ops (residual add, rope, embedding) run one kernel each. Elements
moved are reads plus writes per token, in units of the op's width (the
elements of one token's row, operator_table.ProfiledModel.elementwise_width):
a stated count of what each kernel touches, used to carry a bandwidth measured
on one kernel to another whose rows no table holds."""
from __future__ import annotations

NORM_OPS = ("input_layernorm", "post_attention_layernorm")
NORMS = ("rms_norm", "layer_norm")

# reads + writes per token, in widths
ELEMENTS_MOVED = {
    "rms_norm": 4,         # fused add: reads x and the residual, writes both (width h)
    "layer_norm": 2,       # reads x, writes y (width h)
    "silu_and_mul": 1,     # width 3·inter already: reads gate and up, writes their product
    "gelu": 1,             # width 2·inter already: reads inter, writes inter
    "add": 3,              # reads two rows, writes one (width h)
    "attn_rope": 2,        # rewrites q and k in place (width: their elements)
    "emb": 2,              # gathers one row of the table, writes it (width h)
}


def elementwise_kernel(op: str, norm: str, gated: bool) -> str:
    """The kernel kind of table op `op` in a model with this norm and MLP."""
    if op in NORM_OPS:
        if norm not in NORMS:
            raise ValueError(f"model norm: '{norm}' is not a known norm kernel; choose one of: {', '.join(NORMS)}")
        return norm
    if op == "mlp_act":
        return "silu_and_mul" if gated else "gelu"
    return op


def bytes_moved_per_token(kernel: str, width: int, dtype_bytes: int) -> int:
    return ELEMENTS_MOVED[kernel] * width * dtype_bytes
