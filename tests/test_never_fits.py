"""A request whose KV can never fit a worker of the pool that must hold it
fails at arrival with the numbers and the fields to change, and the requests
behind it are served: it would otherwise wait (or preempt itself) forever at
the head of its worker's FCFS queue, and every request behind it with it
(the simulator ended with all of them unfinished and the decode worker's
reservation leaked). Each pool is checked: a replica and a decode worker hold
the prompt and the outputs, a prefill worker the prompt alone, and a prefill
pool of its own parallel split may hold fewer blocks than the decode pool."""
from __future__ import annotations

import pytest

from test_seams import config
from testbed.request import Request
from testbed.runtime.build import pool_config
from testbed.runtime.sim import SimRuntime
from testbed.workloads.tokens import SyntheticTokens

GPU = ["runtime=sim", "model=llama3-8b", "hardware=h100-sxm", "link=rdma-400"]


def prompt(index: int, length: int) -> SyntheticTokens:
    return SyntheticTokens(index, length, 32000)


def serve(cfg, lengths: list[int], outputs: int = 4):
    """Requests r0, r1, ... of these prompt lengths, 10 ms apart; the big one second."""
    reqs = [Request(f"r{i}", prompt(i, n), outputs, arrival_s=0.01 * i) for i, n in enumerate(lengths)]
    result = SimRuntime(cfg, log=lambda line: None).run(reqs)
    for w, s in result.worker_stats.items():
        assert s["all_free"] and s["num_free_blocks"] == s["num_blocks"], (w, s)
    return {r.request_id: r for r in result.records}


def check_only_r1_failed(records, error: str) -> None:
    assert records["r1"].status == "failed" and records["r1"].output_token_ids == []
    assert records["r1"].error == error
    assert records["r1"].finish_s == pytest.approx(0.01)        # at its arrival
    assert all(r.status == "finished" for rid, r in records.items() if rid != "r1"), records


def test_a_replica_never_big_enough_fails_the_request_at_arrival():
    cfg = config(*GPU, "mode=colocated", "replicas=2", "num_kv_blocks=64")      # 1,024 tokens each
    records = serve(cfg, [300, 1018, 500, 200], outputs=8)                  # 1,018 + 7 = 1,025 > 1,024
    check_only_r1_failed(records, "prompt of 1018 tokens plus 8 outputs needs 65 KV blocks, more than a replica "
                         "has (64, num_kv_blocks); raise num_kv_blocks (with num_kv_blocks=auto: the pool's "
                         "parallel.tp or gpu_memory_utilization) or clip workload.max_prompt_len / "
                         "workload.max_output_len")
    # one token less fits exactly, and is served
    assert serve(cfg, [300, 1017, 500], outputs=8)["r1"].status == "finished"


def test_a_decode_worker_never_big_enough_fails_the_request_at_arrival():
    cfg = config(*GPU, "mode=disagg", "num_kv_blocks=64")
    records = serve(cfg, [300, 1100, 500])
    assert records["r1"].error.startswith("prompt of 1100 tokens plus 4 outputs needs 69 KV blocks, more than a "
                                          "decode worker has (64, num_kv_blocks)")
    check_only_r1_failed(records, records["r1"].error)


def test_a_prefill_pool_smaller_than_the_decode_pool_is_checked_on_its_own():
    cfg = config(*GPU, "mode=disagg", "decode.parallel.tp=2")     # num_kv_blocks=auto: per pool
    prefill, decode = pool_config(cfg, "prefill").num_kv_blocks, pool_config(cfg, "decode").num_kv_blocks
    big = (prefill + 1) * 16                                       # fits a decode worker, not a prefill worker
    assert prefill * 16 < big < decode * 16
    records = serve(cfg, [300, big, 500])
    check_only_r1_failed(records, f"prompt of {big} tokens needs {prefill + 1} KV blocks, more than a prefill "
                         f"worker has ({prefill}, num_kv_blocks); raise num_kv_blocks (with num_kv_blocks=auto: "
                         "the pool's parallel.tp or gpu_memory_utilization) or clip workload.max_prompt_len / "
                         "workload.max_output_len")


def test_the_real_engine_fails_a_request_past_its_models_context_at_arrival():
    """As vLLM's max_model_len: a prompt and outputs past the positions the
    model was trained for (model.max_position_embeddings, or a checkpoint's
    config.json) fail at arrival on the real engine; the others are served with
    the reference tokens by real processes (disagg 1P1D), every block free."""
    from test_disagg_faults import Watch, check, long_request, run
    from test_disagg_faults import config as real_config
    cfg = real_config(model={"max_position_embeddings": 512})
    long = long_request(cfg)          # 1,024 + 16 > 512; every other request is at most 160 + 12
    result = run(cfg, Watch(), lambda rt, ev: None)
    check(result, cfg, {long: ("failed", "prompt of 1024 tokens plus 16 outputs passes the model's context of 512 "
                               "positions (model.max_position_embeddings); clip workload.max_prompt_len / "
                               "workload.max_output_len")}, {"prefill0", "decode0"})


def test_the_simulator_extrapolates_past_a_presets_context():
    """The simulator's cost model prices any length (the studies go to 1M on
    presets trained for less): no request fails for its length there."""
    cfg = config(*GPU, "mode=colocated", "model.max_position_embeddings=512")
    records = serve(cfg, [300, 1018, 500], outputs=8)
    assert all(r.status == "finished" for r in records.values()), records


def test_the_context_comes_from_the_checkpoint_where_model_path_names_one(tmp_path):
    """The frontend reads the limit where the workers read the architecture:
    the checkpoint's config.json, not the preset the run started from."""
    import json

    from testbed.config import RunConfig
    from testbed.model.config import ModelConfig
    from testbed.runtime.deployment import max_model_len
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "hidden_act": "silu",
        "max_position_embeddings": 2048}))
    assert max_model_len(RunConfig(model=ModelConfig(path=str(tmp_path)))) == 2048
    assert max_model_len(RunConfig(model=ModelConfig(max_position_embeddings=4096))) == 4096
    assert max_model_len(config(*GPU, "mode=colocated")) is None          # the simulator's: no limit
