"""The GPU presets' GEMM and elementwise prices for one model: the measured
operator tables (operator_table.py) priced by shape (table_pricing.py), for
this model's shapes on one GPU of its replica (layer_shapes.py), transferred
from the table's chip to the preset's chip and dtype by the roofline ratio.
The cost model (cost_model.py) asks for a few curves of seconds over m."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from testbed.model.config import ModelConfig
from testbed.sim.config import HardwareConfig
from testbed.sim.elementwise_kernels import elementwise_kernel
from testbed.sim.layer_shapes import Gemm, LayerShapes
from testbed.sim.operator_table import elementwise_samples, gemm_samples, load_compute_table
from testbed.sim.table_pricing import Curve, RooflineRatio, TableElementwise, TableGemms

# The chips the tables were measured on (Vidur's profiling runs: A100 80GB
# SXM and H100 80GB SXM DGX nodes), datasheet dense bf16 TFLOP/s and GB/s:
# the source side of the roofline ratio. Their dtype: 16-bit.
TABLE_CHIPS = {"h100": (989.4, 3350.0), "a100": (312.0, 2039.0)}
TABLE_DTYPE_BYTES = 2
MATMUL_SIDE = 8192             # the square matmul HardwareConfig.matmul_tflops_measured times


@lru_cache(maxsize=None)
def table_models(tables: Path, table: str) -> tuple[TableGemms, TableElementwise]:
    """The pricing models of one GPU table, built once per process (pure: a
    function of the condensed files)."""
    models = load_compute_table(tables, table)
    return TableGemms(gemm_samples(models)), TableElementwise(elementwise_samples(models))


def elementwise_ops(model: ModelConfig, shapes: LayerShapes) -> list[tuple[str, str, int, int]]:
    """(table op, kernel kind, width per token, layers) of one GPU's
    elementwise work: two norms, the residual add, rope, the MLP activation
    per layer, and the embedding once."""
    h, L = model.hidden_size, shapes.num_layers
    a = shapes.attention
    if a.mla_rank:
        rope = (a.num_heads + 1) * a.rope_dim
    else:
        kv_heads = a.kv_bytes_per_token // (2 * a.qk_dim * shapes.dtype_bytes)
        rope = (a.num_heads + kv_heads) * a.qk_dim
    # the activation reads the up projection's output and writes the down
    # projection's input: up.n + down.k elements per token
    by_name = {g.name: g for g in shapes.gemms}
    act = sum(g.layers * (g.n + by_name[g.name.replace("up_proj", "down_proj")].k)
              for g in shapes.gemms if g.name.endswith("up_proj"))
    if shapes.experts:
        e = shapes.experts
        act += e.layers * e.top_k * (e.act_elems_per_routed_token - 2 * h)
    act = max(1, act // L)
    norm, parallel = model.norm, model.parallel_block
    ops = [("input_layernorm", h, L), ("post_attention_layernorm", h, L), ("add", h, L),
           ("attn_rope", rope, L), ("mlp_act", act, L), ("emb", h, 1)]
    return [(op, elementwise_kernel(op, norm, model.gated_mlp, parallel), width, layers) for op, width, layers in ops]


class GpuTablePricing:
    """Curves of seconds over m for a model's GEMMs and elementwise ops on a preset."""

    def __init__(self, hardware: HardwareConfig, model: ModelConfig, shapes: LayerShapes):
        if hardware.gemm_table not in TABLE_CHIPS:
            raise ValueError(f"hardware.gemm_table: '{hardware.gemm_table}' is not a known operator table; "
                             f"choose one of: {', '.join(sorted(TABLE_CHIPS))} (or '' for the roofline)")
        self.gemms, self.elementwise = table_models(hardware.operator_tables_dir(), hardware.gemm_table)
        peak, bw = TABLE_CHIPS[hardware.gemm_table]
        source_flops = peak * 1e12
        # the matmul throughput measured on both sides: the tables' own 8192^3 against this chip's
        measured = (2.0 * MATMUL_SIDE ** 3 / self.gemms.seconds(MATMUL_SIDE, MATMUL_SIDE, MATMUL_SIDE)
                    if hardware.matmul_tflops_measured else 0.0)

        def ratio(dtype: str, weight_bytes: int) -> RooflineRatio:
            target_flops = hardware.peak_flops(dtype)
            if measured:
                target_flops *= hardware.matmul_tflops_measured / hardware.peak_tflops
            return RooflineRatio(measured or source_flops, bw * 1e9, TABLE_DTYPE_BYTES,
                                 target_flops, hardware.hbm_bw_gbps * 1e9, shapes.dtype_bytes, weight_bytes)
        # lm_head and the elementwise ops run in the model's dtype, the layers' GEMMs in their weights'
        self.ratio = ratio(model.dtype, 0)
        self.layer_ratio = ratio(model.resolved_weight_dtype, shapes.weight_dtype_bytes)
        self.model, self.shapes = model, shapes

    def layers_curve(self) -> Curve:
        """The layers' GEMMs (in the weights' dtype)."""
        return self.gemms.curve(self.shapes.gemms, None if self.layer_ratio.identity else self.layer_ratio.gemm)

    def lm_head_curve(self) -> Curve:
        return self.gemms.curve([self.shapes.lm_head], None if self.ratio.identity else self.ratio.gemm)

    def elementwise_curve(self) -> Curve:
        return self.elementwise.curve(elementwise_ops(self.model, self.shapes), self.ratio.streaming())

    def experts_s(self, m: float, touched: float) -> float:
        """The routed experts of every MoE layer: per touched expert, its up and
        down GEMMs over its share of the m·top_k routed rows."""
        e = self.shapes.experts
        up_width = 2 if self.model.gated_mlp else 1
        im = e.expert_params // ((up_width + 1) * self.model.hidden_size)
        rows = max(1.0, m * e.top_k / touched)
        total = 0.0
        for g in (Gemm("expert_up", up_width * im, self.model.hidden_size), Gemm("expert_down", self.model.hidden_size, im)):
            scale = 1.0 if self.layer_ratio.identity else float(self.layer_ratio.gemm(g, np.array([rows]))[0])
            total += self.gemms.seconds(rows, g.n, g.k) * scale
        return e.layers * touched * total

