"""The cost model against the published shapes (Sarathi-Serve's chunking
overhead and hybrid batches, decode batching), first-principles sanity numbers
on H100, the architecture variants (MLA, MoE), TP/PP, and a profiled CPU
prediction against a real timing on this machine."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from testbed.kernels.attention import AttentionMetadata
from testbed.kernels.torch_backend import TorchAttentionBackend
from testbed.model.config import load_model_preset
from testbed.sim.config import (HardwareConfig, ParallelConfig, hardware_preset_names, load_hardware_preset,
                                load_link_preset)
from testbed.sim.cost_model import CostModel
from testbed.sim.crossover import chunked_prefill_s
from testbed.sim.layer_shapes import Gemm, expected_experts_touched
from testbed.sim.link_model import LinkModel
from testbed.profiling.profile import profile_cpu, seconds_per_call
from testbed.sim.engine_config import EngineConfig, load_engine_preset
from testbed.sim.timers import ProfiledGemms


@pytest.fixture(scope="module")
def h100():
    """h100-sxm priced by the roofline (the tables, the attention kernel model
    and the launch bound off): these tests pin down the roofline's first
    principles; tests/test_gpu_tables.py covers the table-priced preset."""
    return load_hardware_preset("h100-sxm", gemm_table="", allreduce_table="", attention_kernel="")


# the engine's part off but a stated 0.3 ms of host time per iteration, added
BARE_ENGINE = EngineConfig(name="bare", overhead_ms=0.3)


@pytest.fixture(scope="module")
def llama(h100):
    return CostModel(load_model_preset("llama3-8b"), h100, engine=BARE_ENGINE)


def hbm_s(h100, nbytes):
    return nbytes / (h100.hbm_bw_gbps * 1e9 * h100.memory_efficiency)


# -- published shapes --------------------------------------------------------

@pytest.mark.parametrize("length", [2048, 3072, 4096])
def test_chunking_costs_more_than_whole_prefill_and_less_with_bigger_chunks(llama, length):
    whole = llama.iteration_time_s([(length, length)])
    overhead = {c: chunked_prefill_s(llama, length, c) / whole - 1 for c in (512, 1024, 2048)}
    assert overhead[512] > overhead[1024] > overhead[2048] >= 0
    assert 0.05 < overhead[512] < 0.5            # Sarathi-Serve: up to ~1.2x at C=512


@pytest.mark.parametrize("chunk", [512, 1024, 2048])
@pytest.mark.parametrize("decodes", [1, 8, 32])
def test_hybrid_batch_costs_about_a_prefill_only_batch(llama, chunk, decodes):
    prefill_only = llama.iteration_time_s([(chunk, chunk)])
    hybrid = llama.iteration_time_s([(chunk - decodes, chunk - decodes)] + [(1, 512)] * decodes)
    assert hybrid >= prefill_only * 0.99
    assert hybrid / prefill_only - 1 < 0.06


def test_decode_cost_per_token_falls_an_order_of_magnitude_with_batching(llama):
    per_token = {b: llama.iteration_time_s([(1, 1024)] * b) / b for b in (1, 8, 32, 128)}
    assert per_token[1] > per_token[8] > per_token[32] > per_token[128]
    assert per_token[1] / per_token[128] >= 10


def test_decode_batch_one_streams_the_weights(llama, h100):
    t = llama.iteration_time_s([(1, 1024)])
    assert 5.5e-3 < t < 8e-3                      # 16 GB / 3.35 TB/s at ~80%
    streamed = llama.shapes.weight_bytes - 128256 * 4096 * 2      # the embedding table is not streamed
    assert t == pytest.approx(hbm_s(h100, streamed) + BARE_ENGINE.overhead_ms * 1e-3, rel=0.05)


def test_prefill_4k_is_compute_bound(llama, h100):
    t = llama.iteration_time_s([(4096, 4096)])
    ideal = 2 * 8.03e9 * 4096 / (h100.peak_tflops * 1e12 * h100.compute_efficiency)
    assert ideal < t < 1.2 * ideal


def test_kv_bytes_read_counts_each_slices_context(llama):
    kv = 131072
    assert llama.kv_bytes_read([(1, 1000), (512, 1536), (4096, 4096)]) == kv * (1000 + 1536 + 4096)
    b = llama.breakdown([(1, 1000), (512, 1536)])
    assert b["kv_bytes_read"] == kv * 2536 and b["num_tokens"] == 513
    assert b["total_s"] == pytest.approx(sum(v for k, v in b.items() if k.endswith("_s") and k != "total_s"))


def test_chunk_attention_rereads_its_prefix(h100):
    # MHA decode-like chunks are memory-bound: attention time follows the context read
    cost = CostModel(load_model_preset("llama2-7b"), h100, engine=BARE_ENGINE)
    short = cost.breakdown([(1, 4096)])["attention_s"]
    long = cost.breakdown([(1, 8192)])["attention_s"]
    assert long == pytest.approx(2 * short, rel=0.01)
    assert short == pytest.approx(hbm_s(h100, 4096 * 524288), rel=0.01)


def test_numpy_slices_match_list_slices(llama):
    slices = [(1, 900), (256, 2048), (1, 17)]
    assert llama.iteration_time_s(np.array(slices)) == llama.iteration_time_s(slices)
    assert llama.kv_bytes_read(np.array(slices)) == llama.kv_bytes_read(slices)


def test_lm_head_only_for_sampled_rows(llama):
    mid_chunk = llama.breakdown([(512, 1024)], num_sampled=0)
    last_chunk = llama.breakdown([(512, 1024)])
    assert mid_chunk["lm_head_s"] == 0 and last_chunk["lm_head_s"] > 0
    assert mid_chunk["total_s"] == pytest.approx(last_chunk["total_s"] - last_chunk["lm_head_s"])


# -- architectures -------------------------------------------------------------

def test_mla_kv_bytes_come_from_the_latent_rank(h100):
    model = load_model_preset("deepseek-v2-lite")
    assert model.kv_bytes_per_token == (512 + 64) * 2 * 27
    cost = CostModel(model, h100, engine=BARE_ENGINE)
    assert cost.shapes.attention.kv_bytes_per_token == (512 + 64) * 2
    assert cost.kv_bytes_read([(1, 10000)]) == 10000 * 31104
    # a long decode is memory-bound on the latent KV
    attention = cost.breakdown([(1, 65536)])["attention_s"]
    assert attention == pytest.approx(hbm_s(h100, 65536 * 31104), rel=0.02)
    # a full-head GQA cache of the same heads would read 16·128·2·2 / 1152 = 7x more
    assert 2 * 16 * 128 * 2 / 1152 > 7


def test_moe_flops_count_active_experts_bytes_count_touched_experts(h100):
    model = load_model_preset("mixtral-8x7b")
    cost = CostModel(model, h100, engine=BARE_ENGINE)
    expert_bytes = 3 * 4096 * 14336 * 2
    all_experts = 32 * 8 * expert_bytes
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2.0)
    assert expected_experts_touched(8, 2, 256) == pytest.approx(8.0)
    one = cost.breakdown([(1, 1024)])["experts_s"]
    assert one == pytest.approx(hbm_s(h100, all_experts / 4), rel=0.01)     # 2 of 8 experts
    many = cost.breakdown([(1, 1024)] * 64)["experts_s"]
    assert many >= hbm_s(h100, all_experts)                                   # every expert streamed
    # a 4K prefill is compute-bound on the 2 active experts per token, not all 8
    prefill = cost.breakdown([(4096, 4096)])["experts_s"]
    active_flops = 2 * 4096 * 2 * 32 * expert_bytes / 2
    peak = h100.peak_tflops * 1e12 * h100.compute_efficiency
    assert active_flops / peak < prefill < 1.2 * active_flops / peak


def test_tensor_parallel_splits_work_and_adds_allreduces(h100):
    model = load_model_preset("llama3-8b")
    one = CostModel(model, h100, engine=BARE_ENGINE).breakdown([(4096, 4096)])
    two = CostModel(model, h100, ParallelConfig(tp=2), engine=BARE_ENGINE).breakdown([(4096, 4096)])
    assert one["allreduce_s"] == 0
    nvlink = LinkModel(load_link_preset("nvlink"))
    assert two["allreduce_s"] == pytest.approx(2 * 32 * nvlink.allreduce_time_s(4096 * 4096 * 2, 2))
    assert two["gemm_s"] == pytest.approx(one["gemm_s"] / 2, rel=0.02)
    assert one["total_s"] / 2 < two["total_s"] < one["total_s"]


def test_pipeline_parallel_adds_stage_handoffs(h100):
    model = load_model_preset("llama3-8b")
    one = CostModel(model, h100, engine=BARE_ENGINE).breakdown([(2048, 2048)])
    four = CostModel(model, h100, ParallelConfig(pp=4, pp_link="rdma-400"), engine=BARE_ENGINE).breakdown([(2048, 2048)])
    handoff = LinkModel(load_link_preset("rdma-400")).transfer_time_s(2048 * 4096 * 2)
    assert four["pp_transfer_s"] == pytest.approx(3 * handoff)
    assert four["total_s"] == pytest.approx(one["total_s"] + 3 * handoff)


def test_kv_capacity_and_weights_that_do_not_fit():
    a100 = load_hardware_preset("a100-80gb-sxm")
    with pytest.raises(ValueError, match="hardware.memory_gib.*parallel.tp"):
        CostModel(load_model_preset("llama2-70b"), a100).kv_capacity_tokens()
    tokens = CostModel(load_model_preset("llama2-70b"), a100, ParallelConfig(tp=4)).kv_capacity_tokens()
    per_gpu_kv = 2 * 2 * 128 * 2 * 80                        # 2 of 8 KV heads per GPU
    free = 80 * 2**30 * 0.9 - 69e9 / 4 * 2
    assert tokens == pytest.approx(free / per_gpu_kv, rel=0.02)


# -- validation -------------------------------------------------------------------

def test_bad_inputs_name_the_field(llama, h100):
    with pytest.raises(ValueError, match="slices"):
        llama.iteration_time_s([])
    with pytest.raises(ValueError, match="context_len >= num_new_tokens"):
        llama.iteration_time_s([(5, 3)])
    with pytest.raises(ValueError, match="num_new_tokens >= 1"):
        llama.iteration_time_s([(0, 3)])
    with pytest.raises(ValueError, match="parallel.tp"):
        CostModel(load_model_preset("llama3-8b"), h100, ParallelConfig(tp=3), engine=BARE_ENGINE)
    with pytest.raises(ValueError, match="parallel.pp"):
        ParallelConfig(pp=0)
    with pytest.raises(ValueError, match="hardware.compute_efficiency"):
        HardwareConfig("x", 1.0, 1.0, 1.0, 1.0, compute_efficiency=1.5, memory_efficiency=0.5)
    with pytest.raises(ValueError, match="peak_tflops_fp8"):
        CostModel(load_model_preset("llama3-8b", dtype="fp8"), load_hardware_preset("a100-80gb-sxm"))
    with pytest.raises(ValueError, match="known preset.*h100-sxm"):
        load_hardware_preset("h100")
    assert {"a100-80gb-sxm", "a100-80gb-pcie", "h100-sxm", "h200", "cpu"} <= set(hardware_preset_names())


# -- profiled CPU ----------------------------------------------------------------

def _tiny_forward(model, num_tokens):
    """A GEMM-heavy prefill of the tiny model in plain torch: the same linears
    and attention backend the real engine runs."""
    h, d, heads, kv_heads = model.hidden_size, model.resolved_head_dim, model.num_heads, model.num_kv_heads
    g = torch.Generator().manual_seed(0)
    layers = [{n: torch.randn(shape, generator=g) * 0.05 for n, shape in
               (("qkv", ((heads + 2 * kv_heads) * d, h)), ("o", (h, heads * d)),
                ("up", (2 * model.intermediate_size, h)), ("down", (h, model.intermediate_size)))}
              for _ in range(model.num_layers)]
    lm_head = torch.randn(model.vocab_size, h, generator=g) * 0.05
    block = 16
    cache = torch.zeros(2, model.num_layers, num_tokens // block, block, kv_heads, d)
    meta = AttentionMetadata([0, num_tokens], [num_tokens], [list(range(num_tokens // block))],
                             torch.arange(num_tokens), block)
    backend, x0 = TorchAttentionBackend(), torch.randn(num_tokens, h, generator=g)

    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    def forward():
        x = x0
        for i, w in enumerate(layers):
            q, k, v = F.linear(norm(x), w["qkv"]).split([heads * d, kv_heads * d, kv_heads * d], -1)
            cache[0, i].view(-1, kv_heads, d)[:] = k.view(num_tokens, kv_heads, d)
            cache[1, i].view(-1, kv_heads, d)[:] = v.view(num_tokens, kv_heads, d)
            a = backend.forward(q.reshape(num_tokens, heads, d), cache[0, i], cache[1, i], meta, d ** -0.5)
            x = x + F.linear(a.reshape(num_tokens, heads * d), w["o"])
            gate, up = F.linear(norm(x), w["up"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
        return F.linear(norm(x[-1:]), lm_head)
    return forward


def test_profiled_cpu_predicts_a_real_prefill_within_a_sane_factor(tmp_path):
    torch.set_num_threads(1)
    hardware = profile_cpu(tmp_path / "cpu.yaml", model_name="tiny", quick=True)
    assert hardware.gemm_profile and hardware.attention_profile
    assert load_hardware_preset(str(tmp_path / "cpu.yaml")) == hardware       # the YAML round-trips
    typed = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(tmp_path / "cpu.yaml"))
    assert HardwareConfig(**OmegaConf.to_container(typed)) == hardware         # and passes Hydra's typing
    model = load_model_preset("tiny")
    engine = load_engine_preset(str(tmp_path / "cpu-engine.yaml"))        # the second file the profile wrote
    assert engine.profiled_for == "cpu" and engine.overhead_ms + engine.overhead_per_seq_ms > 0
    cost = CostModel(model, hardware, engine=engine)
    measured = seconds_per_call(_tiny_forward(model, 512), min_time_s=0.3)
    predicted = cost.iteration_time_s([(512, 512)])
    assert 1 / 3 < predicted / measured < 3, (predicted, measured)
    # GEMM rows reproduce themselves through the interpolation
    m, n, k, s = next(r for r in hardware.gemm_profile if r[1:3] == [256, 256] and r[0] == 256)
    assert ProfiledGemms(hardware.gemm_profile).curve([Gemm("o", 256, 256)])(256) == pytest.approx(s)
