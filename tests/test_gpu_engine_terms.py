"""The GPU presets' attention kernels, engine overhead and hardware-following
defaults: the triton kernel against the measured H200 prefills, the launch
bound and the CUDA-graph switch, num_kv_blocks=auto and the token budget."""
import csv
import dataclasses
from pathlib import Path

import pytest

from testbed.config import RunConfig, from_dict
from testbed.model.config import load_model_preset
from testbed.sim.attention_kernels import KERNELS, attention_kernel
from testbed.sim.config import ParallelConfig, load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.defaults import kv_blocks_from_memory
from testbed.sim.engine_config import EngineConfig, load_engine_preset
from testbed.sim.engine_overhead import kernels_per_layer
from engine_fixture import STATED_ENGINE  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "experiments" / "results" / "h200_prefill.csv"


def _prefill_ms(cost: CostModel, prompt: int, chunk: int) -> float:
    if chunk == 0:
        return cost.iteration_time_s([(prompt, prompt)]) * 1e3
    return sum(cost.iteration_time_s([(min(chunk, prompt - s), min(s + chunk, prompt))])
               for s in range(0, prompt, chunk)) * 1e3


@pytest.mark.parametrize("prompt", [4096, 32768, 131072])
@pytest.mark.parametrize("chunk", [0, 2048, 512])
def test_triton_preset_within_15_percent_of_the_measured_h200_prefills(prompt, chunk):
    rows = {(int(r["prompt_len"]), int(r["chunk"])): float(r["ttft_s"]) * 1e3
            for r in csv.DictReader(RESULTS.open()) if r["backend"] == "triton" and r["status"] == "ok"}
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h200"), engine=STATED_ENGINE)
    assert _prefill_ms(cost, prompt, chunk) == pytest.approx(rows[(prompt, chunk)], rel=0.15)


def test_flash_attn_cites_its_source_and_prices_long_prompts_faster_on_a100():
    src = Path(attention_kernel("flash_attn").__module__.replace(".", "/") + ".py")
    text = (Path(__file__).resolve().parents[1] / src).read_text()
    assert "arXiv:2307.08691" in text and "arXiv:2407.08608" in text
    model = load_model_preset("llama3-8b")
    triton = CostModel(model, load_hardware_preset("a100-80gb-sxm"), engine=STATED_ENGINE)
    flash = CostModel(model, load_hardware_preset("a100-80gb-sxm", attention_kernel="flash_attn"), engine=STATED_ENGINE)
    ratio = triton.breakdown([(32768, 32768)])["attention_s"] / flash.breakdown([(32768, 32768)])["attention_s"]
    assert ratio == pytest.approx(KERNELS["flash_attn"].peak_fraction["a100"] / KERNELS["triton"].peak_fraction["a100"],
                                  rel=1e-9)
    with pytest.raises(ValueError, match="attention_kernel"):
        attention_kernel("cudnn")


def test_decodes_stream_no_faster_than_the_longest_alone():
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h200"), engine=STATED_ENGINE)
    k = KERNELS["triton"]
    one_long = cost.breakdown([(1, 131072)])["attention_s"]
    nbytes = cost.shapes.attention.bytes(1, 131072) * cost.shapes.num_layers
    assert one_long == pytest.approx(nbytes / (4800e9 * k.single_seq_bw_fraction), rel=1e-12)


def test_eager_decodes_are_launch_bound_and_cuda_graphs_lift_the_bound():
    model = load_model_preset("llama3-8b")
    hw = load_hardware_preset("h100-sxm")
    eager_engine = EngineConfig(name="eager", overhead_ms=0.3, kernel_launch_us=50.0)
    graph_engine = dataclasses.replace(eager_engine, cuda_graphs=True, cuda_graph_sizes=[1, 2, 4, 8, 16])
    eager, graph = CostModel(model, hw, engine=eager_engine), CostModel(model, hw, engine=graph_engine)
    launches = model.num_layers * kernels_per_layer(eager.shapes, ParallelConfig()) * 50e-6
    decode = [(1, 1024)] * 8
    assert eager.iteration_time_s(decode) == pytest.approx(launches + 0.3e-3, rel=1e-12)
    kernels = sum(v for k, v in graph.breakdown(decode).items()
                  if k.endswith("_s") and k not in ("total_s", "overhead_s"))
    assert graph.iteration_time_s(decode) == pytest.approx(kernels + 0.3e-3, rel=1e-12)
    # 5 decodes replay the graph captured for 8: the GEMMs of 8 rows, the attention of 5
    five = graph.breakdown([(1, 1024)] * 5)
    assert five["gemm_s"] == graph.breakdown(decode)["gemm_s"]
    assert five["attention_s"] < graph.breakdown(decode)["attention_s"]
    # a prefill is never captured
    prefill = [(4096, 4096)]
    assert graph.iteration_time_s(prefill) == eager.iteration_time_s(prefill)


def test_cpu_keeps_its_own_tables_and_defaults():
    cfg = RunConfig()
    assert cfg.hardware.name == "cpu" and not cfg.hardware.gemm_table and not cfg.hardware.attention_kernel
    assert (cfg.token_budget, cfg.num_kv_blocks) == (256, 2048)


def test_gpu_defaults_follow_the_hardware_and_explicit_values_win():
    hw, model = load_hardware_preset("h100-sxm"), load_model_preset("llama3-8b")
    cfg = RunConfig(hardware=hw, model=model)
    assert (cfg.token_budget, cfg.max_num_seqs, cfg.scheduler) == (2048, 256, "sarathi")     # vllm-v1's
    assert cfg.num_kv_blocks == kv_blocks_from_memory(cfg.model, cfg.hardware, cfg.parallel, cfg.block_size,
                                                      cfg.gpu_memory_utilization,
                                                      max(cfg.token_budget, cfg.max_num_batched_tokens),
                                                      cfg.max_num_seqs)
    capacity = CostModel(model, hw).kv_capacity_tokens() // cfg.block_size     # weights only, no activations
    assert 0.9 * capacity < cfg.num_kv_blocks < capacity
    assert "num_kv_blocks=auto" in cfg.hardware_defaults_note
    explicit = RunConfig(hardware=hw, model=model, token_budget=512, num_kv_blocks=1000, scheduler="orca",
                         max_num_seqs=8, block_size=32)
    assert (explicit.token_budget, explicit.num_kv_blocks, explicit.hardware_defaults_note) == (512, 1000, "")
    assert (explicit.scheduler, explicit.max_num_seqs, explicit.block_size) == ("orca", 8, 32)
    v0 = RunConfig(hardware=hw, model=model, engine=load_engine_preset("vllm-v0"), num_kv_blocks=1000)
    assert (v0.scheduler, v0.max_num_seqs, v0.block_size) == ("vllm_v0", 256, 16)
    assert from_dict({"num_kv_blocks": 77}).num_kv_blocks == 77


def test_auto_kv_blocks_say_when_the_weights_do_not_fit():
    with pytest.raises(ValueError, match="num_kv_blocks=auto.*raise parallel.tp"):
        RunConfig(hardware=load_hardware_preset("h100-sxm"), model=load_model_preset("falcon-180b"))
    with pytest.raises(ValueError, match="num_kv_blocks: expected a number of blocks or 'auto'"):
        RunConfig(num_kv_blocks="lots")
