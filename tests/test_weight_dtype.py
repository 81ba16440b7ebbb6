"""model.weight_dtype: a model whose linear layers run in a narrower dtype
than the rest (FP8 W8A8: fp8 weights and quantized GEMM inputs, bfloat16
activations, KV cache, embedding and lm_head), as the FP8 Llama 4 Scout
preset is. The weights' memory and the layers' GEMMs follow weight_dtype;
everything else stays in dtype, and models without it are priced as before."""
from __future__ import annotations

import numpy as np
import pytest

from testbed.model.config import ModelConfig, load_model_preset, model_preset_names
from testbed.model.llama import LlamaModel
from testbed.sim.config import ParallelConfig, load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.engine_config import load_engine_preset
from testbed.sim.layer_shapes import Gemm, layer_shapes
from testbed.sim.table_pricing import RooflineRatio


def _params(shapes) -> tuple[int, int]:
    """(the layers' GEMM weight elements, embedding and lm_head elements) on one GPU."""
    layers = sum(g.n * g.k * g.layers for g in shapes.gemms)
    if shapes.experts:
        e = shapes.experts
        layers += e.layers * e.num_experts * e.expert_params
    return layers, shapes.lm_head.n * shapes.lm_head.k


def test_fp8_weights_halve_the_layers_not_the_embedding_lm_head_or_kv_cache():
    scout = load_model_preset("llama4-scout-fp8")
    bf16 = load_model_preset("llama4-scout-fp8", weight_dtype="")
    for tp in (1, 2, 4):
        fp8, wide = layer_shapes(scout, tp), layer_shapes(bf16, tp)
        layers, head = _params(fp8)
        embedding = head          # untied: the embedding is as big as lm_head
        assert fp8.weight_bytes == layers * 1 + (head + embedding) * 2
        assert wide.weight_bytes == (layers + head + embedding) * 2
        assert fp8.kv_bytes_per_token == wide.kv_bytes_per_token == 48 * 2 * (8 // min(tp, 8)) * 128 * 2
        assert fp8.elementwise_bytes_per_token == wide.elementwise_bytes_per_token
    # Scout: 108B parameters, 17B of them active per token
    layers, head = _params(layer_shapes(scout, 1))
    assert 107e9 < layers + 2 * head < 110e9


@pytest.mark.parametrize("name", [n for n in model_preset_names() if n != "llama4-scout-fp8"])
def test_a_model_without_weight_dtype_keeps_every_weight_in_its_dtype(name):
    model = load_model_preset(name)
    assert model.weight_dtype == "" and model.resolved_weight_dtype == model.dtype
    shapes = layer_shapes(model, 1)
    layers, head = _params(shapes)
    embedding = 0 if model.tie_word_embeddings else head
    assert shapes.weight_bytes == (layers + head + embedding) * model.dtype_bytes


def test_a_w8a8_gemm_reads_fp8_and_runs_at_the_fp8_peak():
    """The roofline ratio from a bf16 table to the same chip in fp8 W8A8: a
    one-row GEMM streams half the bytes (weights and input at 1 byte, the
    output at 2), a big one computes at twice the peak."""
    h100 = load_hardware_preset("h100-sxm")
    bf16, fp8, bw = h100.peak_flops("bfloat16"), h100.peak_flops("fp8"), h100.hbm_bw_gbps * 1e9
    same = RooflineRatio(bf16, bw, 2, bf16, bw, 2, 2)
    assert same.identity
    w8a8 = RooflineRatio(bf16, bw, 2, fp8, bw, 2, 1)
    assert not w8a8.identity
    g = Gemm("up_proj", 16384, 5120)
    one_row, big = w8a8.gemm(g, np.array([1.0, 16384.0]))
    assert one_row == pytest.approx((g.n * g.k + g.k + 2 * g.n) / (2 * (g.n * g.k + g.n + g.k)))
    assert one_row == pytest.approx(0.5, abs=1e-3)
    assert big == pytest.approx(bf16 / fp8)


@pytest.mark.parametrize("gemm_table", ["h100", ""])
def test_fp8_weights_price_the_layers_cheaper_and_lm_head_the_same(gemm_table):
    """With the operator tables and with the roofline alone: the FP8 model's
    decode is cheaper than the same model in bf16, its lm_head costs the
    same (it stays bfloat16) and its attention the same (so does the KV)."""
    h100 = load_hardware_preset("h100-sxm", gemm_table=gemm_table)
    engine = load_engine_preset("vllm-v1")
    fp8 = CostModel(load_model_preset("llama4-scout-fp8"), h100, ParallelConfig(tp=2), engine)
    wide = CostModel(load_model_preset("llama4-scout-fp8", weight_dtype=""), h100, ParallelConfig(tp=2), engine)
    batch = [(1, 700)] * 32
    a, b = fp8.breakdown(batch), wide.breakdown(batch)
    assert a["lm_head_s"] == b["lm_head_s"] and a["attention_s"] == b["attention_s"]
    assert a["experts_s"] < 0.7 * b["experts_s"] and a["gemm_s"] < 0.8 * b["gemm_s"]
    assert fp8.iteration_time_s(batch) < 0.75 * wide.iteration_time_s(batch)


def test_weight_dtype_is_checked_and_the_real_engine_refuses_it():
    with pytest.raises(ValueError, match=r"model\.weight_dtype: 'int3'"):
        ModelConfig(weight_dtype="int3")
    with pytest.raises(ValueError, match=r"weights in model\.dtype.*weight_dtype=fp8 only run with runtime=sim"):
        LlamaModel(ModelConfig(weight_dtype="fp8"))
    # a chip without an fp8 peak
    a100 = load_hardware_preset("a100-80gb-sxm")
    with pytest.raises(ValueError, match=r"hardware\.peak_tflops_fp8: 'a100-80gb-sxm' has no fp8 peak.*weight_dtype"):
        CostModel(load_model_preset("llama4-scout-fp8"), a100, ParallelConfig(tp=2), load_engine_preset("vllm-v1"))
    # the CPU's measured GEMM profile is one dtype's
    cpu = load_hardware_preset("h100-sxm", gemm_table="", gemm_profile=[[1, 8, 8, 1e-6], [8, 8, 8, 2e-6]])
    with pytest.raises(ValueError, match=r"model\.weight_dtype: hardware 'h100-sxm' prices GEMMs from its profile"):
        CostModel(load_model_preset("llama4-scout-fp8"), cpu, ParallelConfig(tp=2), load_engine_preset("vllm-v1"))
