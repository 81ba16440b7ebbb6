"""Per-pool parallel configs (`prefill.parallel`, `decode.parallel`): set from
the command line field by field, validated with the field's name, counted in
num_gpus, priced per worker by the simulator (iteration times and KV memory of
the pool's split), and the KV hand-off between pools of different TP priced
by the links that carry it in parallel (testbed/sim/kv_sharding.py). The real
engine has no tensor parallelism and says so."""
from __future__ import annotations

import pytest

from test_seams import config
from testbed.config import validate
from testbed.model.config import load_model_preset
from testbed.request import Request
from testbed.runtime.build import pool_config
from testbed.runtime.deployment import num_gpus
from testbed.runtime.sim import SimRuntime
from testbed.sim.config import ParallelConfig
from testbed.sim.cost_model import CostModel
from testbed.sim.kv_sharding import handoff_links, kv_slices

GPU = ["runtime=sim", "model=llama3-8b", "hardware=h100-sxm", "link=rdma-400"]


def test_pool_parallel_is_set_field_by_field_and_follows_the_run_parallel_otherwise():
    cfg = config(*GPU, "mode=disagg", "prefill.parallel.tp=2", "decode.parallel.tp=1")
    assert cfg.prefill.parallel == ParallelConfig(tp=2)
    assert cfg.decode.parallel == ParallelConfig(tp=1)
    unset = config(*GPU, "mode=disagg")
    assert unset.prefill.parallel is None and unset.decode.parallel is None
    # a field the pool leaves unset is the run's
    mixed = config(*GPU, "parallel=tp8", "parallel.intra_node=pcie5", "decode.parallel.tp=2")
    assert mixed.decode.parallel == ParallelConfig(tp=2, intra_node="pcie5")
    assert mixed.prefill.parallel is None


def test_from_dict_reads_pool_parallel_as_the_command_line_does_and_round_trips():
    from testbed.config import from_dict, to_dict
    cfg = from_dict({"runtime": {"name": "sim"}, "parallel": {"tp": 8, "intra_node": "pcie5"},
                     "decode": {"parallel": {"tp": 2}}})
    assert cfg.decode.parallel == ParallelConfig(tp=2, intra_node="pcie5") and cfg.prefill.parallel is None
    again = from_dict(to_dict(cfg))
    assert (again.prefill.parallel, again.decode.parallel) == (None, ParallelConfig(tp=2, intra_node="pcie5"))


@pytest.mark.parametrize("override,field", [("prefill.parallel.tp=0", "prefill.parallel.tp"),
                                            ("decode.parallel.pp=-1", "decode.parallel.pp")])
def test_a_bad_pool_parallel_names_its_field(override, field):
    with pytest.raises(Exception, match=rf"{field}: must be an integer >= 1"):
        config(*GPU, "mode=disagg", override)


def test_the_real_engine_refuses_a_pool_parallel_it_cannot_run():
    cfg = config("runtime=real", "mode=disagg", "prefill.parallel.tp=2")
    with pytest.raises(ValueError, match=r"^prefill\.parallel: tp=2 pp=1 needs tensor or pipeline parallelism, "
                                         r"which runtime=real does not have .* unset prefill\.parallel"):
        validate(cfg)
    validate(config("runtime=real", "mode=disagg", "decode.parallel.tp=1"))     # tp=1 is what it runs


@pytest.mark.parametrize("overrides,gpus", [
    (["mode=colocated", "replicas=3"], 3),
    (["mode=colocated", "replicas=3", "parallel=tp2"], 6),
    (["mode=disagg", "prefill_workers=2", "decode_workers=1", "prefill.parallel.tp=2"], 5),
    (["mode=disagg", "parallel=tp2", "decode.parallel.tp=1", "decode_workers=3"], 5),
    (["mode=disagg", "prefill.parallel.pp=2", "prefill.parallel.tp=2", "decode.parallel.tp=4"], 8),
    (["mode=kvstore", "prefill.parallel.tp=2", "decode_workers=2"], 4),
])
def test_num_gpus_sums_tp_times_pp_of_each_workers_pool(overrides, gpus):
    assert num_gpus(config(*GPU, *overrides)) == gpus


def test_kv_slices_by_heads_and_stages():
    llama = load_model_preset("llama3-8b")            # 8 KV heads
    assert llama.num_kv_heads == 8
    assert kv_slices(llama, ParallelConfig(tp=1)) == 1
    assert kv_slices(llama, ParallelConfig(tp=4)) == 4
    assert kv_slices(llama, ParallelConfig(tp=2, pp=2)) == 4
    tiny = load_model_preset("tiny")                  # 2 KV heads: at tp=4 each is held twice
    assert kv_slices(tiny, ParallelConfig(tp=4)) == 2
    mla = load_model_preset("deepseek-v2-lite")       # the latent KV is whole on every TP rank
    assert mla.attention == "mla"
    assert kv_slices(mla, ParallelConfig(tp=4)) == 1
    assert handoff_links(llama, ParallelConfig(tp=2), ParallelConfig(tp=1)) == 1
    assert handoff_links(llama, ParallelConfig(tp=1), ParallelConfig(tp=4)) == 1
    assert handoff_links(llama, ParallelConfig(tp=4), ParallelConfig(tp=2)) == 2
    assert handoff_links(llama, ParallelConfig(tp=8), ParallelConfig(tp=8)) == 8


def _one_request(cfg, prompt_len: int, outputs: int = 4):
    rt = SimRuntime(cfg, log=lambda line: None)
    result = rt.run([Request("r0", list(range(1, prompt_len + 1)), outputs)])
    assert [r.status for r in result.records] == ["finished"]
    return rt, result


def test_each_worker_is_priced_with_its_pools_parallel_config():
    cfg = config(*GPU, "mode=disagg", "prefill.parallel.tp=2", "decode.parallel.tp=1", "transfer.layerwise=false")
    rt, result = _one_request(cfg, 1024)
    by_worker = {w: [it for it in result.iterations if it.worker == w] for w in ("prefill0", "decode0")}
    prefill_it, = by_worker["prefill0"]           # one whole prompt within the 2,048-token budget
    tp2 = CostModel(cfg.model, cfg.hardware, ParallelConfig(tp=2))
    tp1 = CostModel(cfg.model, cfg.hardware, ParallelConfig(tp=1))
    assert prefill_it.duration_s == pytest.approx(tp2.iteration_time_s([(1024, 1024)], 1), rel=1e-12)
    assert tp2.iteration_time_s([(1024, 1024)], 1) < 0.8 * tp1.iteration_time_s([(1024, 1024)], 1)
    # decode steps at contexts 1025.. on tp=1
    first_decode = by_worker["decode0"][0]
    assert first_decode.duration_s == pytest.approx(tp1.iteration_time_s([(1, 1025)], 1), rel=1e-12)
    # each pool's KV memory is what one GPU of its split holds (num_kv_blocks=auto)
    blocks = {w.worker_id: w.num_blocks for w in rt.workers}
    assert blocks["prefill0"] == cfg.kv_blocks_from_memory(ParallelConfig(tp=2)) == pool_config(cfg, "prefill").num_kv_blocks
    assert blocks["decode0"] == cfg.num_kv_blocks < blocks["prefill0"]
    assert {w: s["num_blocks"] for w, s in result.worker_stats.items()} == blocks


@pytest.mark.parametrize("prefill_tp,decode_tp,links", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 2), (4, 2, 2)])
def test_the_hand_off_between_pools_of_different_tp_takes_min_slices_links(prefill_tp, decode_tp, links):
    prompt = 4096
    cfg = config(*GPU, "mode=disagg", f"prefill.parallel.tp={prefill_tp}", f"decode.parallel.tp={decode_tp}",
                 "transfer.layerwise=false")
    _, result = _one_request(cfg, prompt)
    rec, = result.records
    nbytes = prompt * cfg.model.kv_bytes_per_token
    assert rec.kv_bytes_sent == nbytes                 # the whole request's KV, however many links
    link = cfg.link
    expected = link.latency_us * 1e-6 + link.per_message_us * 1e-6 + nbytes / links / link.bytes_per_s
    assert rec.transfer_end_s - rec.transfer_start_s == pytest.approx(expected, rel=1e-9)


def test_pipeline_stages_split_the_weights_and_kv_that_num_kv_blocks_auto_counts():
    """A pp stage holds ceil(layers / pp) layers' weights and KV: falcon-180b
    (80 layers, 334 GiB) leaves no KV memory on an h100-sxm at tp=4 and fits at
    tp=4 pp=2, where a token's KV on the fullest GPU is half of tp=4's; the
    footprint line says the same. More stages than layers, or a pool's split
    that leaves no memory, is refused naming that field."""
    from testbed.sim.defaults import gpu_memory
    from testbed.sim.layer_shapes import layer_shapes
    from testbed.sim.memory import format_footprint, kv_footprint
    falcon = ["runtime=sim", "model=falcon-180b", "hardware=h100-sxm", "mode=colocated"]
    with pytest.raises(ValueError, match=r"falcon-180b at parallel tp=4 leaves no KV memory .* raise parallel\.tp "
                                         r"or parallel\.pp"):
        config(*falcon, "parallel.tp=4")
    cfg = config(*falcon, "parallel.tp=4", "parallel.pp=2")
    assert cfg.num_kv_blocks > 0
    model, shapes = cfg.model, layer_shapes(cfg.model, 4)
    weights, kv = gpu_memory(model, shapes, 2)
    assert kv == shapes.kv_bytes_per_token / 2                         # 40 of 80 layers
    lm_head = shapes.lm_head.n * shapes.lm_head.k * shapes.dtype_bytes
    assert weights == pytest.approx((shapes.weight_bytes - 2 * lm_head) / 2 + lm_head)
    assert gpu_memory(model, shapes, 3)[1] == shapes.kv_bytes_per_token * 27 / 80    # the fullest of 27/27/26
    line = format_footprint(kv_footprint(CostModel(model, cfg.hardware, cfg.parallel), cfg.num_kv_blocks, 16))
    assert line.startswith(f"KV footprint: {kv:,.0f} B/token (falcon-180b, tp=4 pp=2)") and "warning" not in line
    with pytest.raises(ValueError, match=r"parallel\.pp: 81 stages for falcon-180b's 80 layers; at most 80"):
        config(*falcon, "parallel.tp=8", "parallel.pp=81")
    with pytest.raises(ValueError, match=r"at decode\.parallel tp=2 leaves no KV memory .* raise decode\.parallel\.tp"):
        pool_config(config(*falcon[:3], "mode=disagg", "parallel.tp=8", "decode.parallel.tp=2"), "decode")


def test_a_run_parallel_that_sizes_no_worker_need_not_fit():
    """llama2-70b (128 GiB of weights at tp=1) with both P/D pools at tp=4: the
    run's default `parallel` (tp=1) splits no worker, so num_kv_blocks=auto asks
    only the pools (it refused the run before), and what it stands at is the
    least a worker holds. Where some worker does run with the run's `parallel`
    (a pool without its own, or hybrid's colocated replicas) it must still fit."""
    big = ["runtime=sim", "model=llama2-70b", "hardware=h100-sxm"]
    cfg = config(*big, "mode=disagg", "prefill.parallel.tp=4", "decode.parallel.tp=8")
    pools = {p: pool_config(cfg, p).num_kv_blocks for p in ("prefill", "decode")}
    assert 0 < pools["prefill"] < pools["decode"]
    assert cfg.num_kv_blocks == pools["prefill"]
    assert "each pool's own" in cfg.hardware_defaults_note
    rt, result = _one_request(config(*big, "mode=disagg", "prefill.parallel.tp=4", "decode.parallel.tp=4"), 2048)
    assert {it.worker for it in result.iterations} == {"prefill0", "decode0"}
    refused = r"llama2-70b at parallel tp=1 leaves no KV memory"
    with pytest.raises(ValueError, match=refused + r".*; the decode pool runs with it .*decode\.parallel\.tp=N"):
        config(*big, "mode=disagg", "prefill.parallel.tp=4")             # decode runs at the run's tp=1
    with pytest.raises(ValueError, match=refused):
        config(*big, "mode=hybrid", "prefill.parallel.tp=4", "decode.parallel.tp=4")    # its colocated pool
    with pytest.raises(ValueError, match=r"at decode\.parallel tp=1 leaves no KV memory"):
        config(*big, "mode=kvstore", "prefill.parallel.tp=4", "decode.parallel.tp=1")


@pytest.mark.parametrize("mode", ["colocated", "disagg", "kvstore", "hybrid"])
def test_a_modes_pools_are_those_its_workers_come_from(mode):
    """Mode.pools decides whether the run's `parallel` must fit (above): it names
    exactly the pools of the roles its layout starts."""
    from testbed.modes.registry import MODES, get_role
    from testbed.runtime.deployment import mode_settings
    cfg = config(*GPU, f"mode={mode}", "replicas=2", "hybrid.threshold=1000")
    roles = {role for _, role in MODES[mode](mode_settings(cfg)).layout()}
    assert {get_role(r).pool for r in roles} == set(MODES[mode].pools)
