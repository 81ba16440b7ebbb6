"""mode=hybrid: a colocated pool beside P/D pools behind a router that sends
prompts shorter than hybrid.threshold to colocation and longer ones to
disaggregation. Routing by length on the simulator (which worker computed
which prompt tokens), the threshold read from a decision study's summary
(`auto`) with its errors, and on the real engine the same tokens as
mode=colocated (fp32 tiny model, greedy, exact)."""
from __future__ import annotations

import json

import pytest

from test_disagg import assert_same_tokens, colocated, read_jsonl, workload  # noqa: F401 (colocated: a fixture)
from test_disagg import config as real_config
from test_seams import config
from testbed.config import validate
from testbed.modes.hybrid_router import make_hybrid_router
from testbed.modes.pool import PoolState
from testbed.request import Request
from testbed.run import execute
from testbed.runtime.deployment import build_mode, hybrid_threshold, num_gpus

THRESHOLD = 160
MIXED = ["workload=mixed", "workload.num_requests=16", "workload.prompt_dist=uniform", "workload.prompt_min=16",
         "workload.prompt_max=320", "workload.output_dist=fixed", "workload.output_len=4"]


def test_the_length_threshold_router_disaggregates_from_the_threshold_up():
    router = make_hybrid_router("length_threshold", THRESHOLD)
    pool = PoolState({})
    assert not router.disaggregates(Request("a", list(range(THRESHOLD - 1)), 4), pool)
    assert router.disaggregates(Request("b", list(range(THRESHOLD)), 4), pool)
    with pytest.raises(ValueError, match=r"^hybrid.router='shortest' is not known; choose one of: length_threshold"):
        make_hybrid_router("shortest", THRESHOLD)


def test_hybrid_routes_short_prompts_to_colocation_and_long_ones_to_disaggregation(tmp_path):
    cfg = config("runtime=sim", "mode=hybrid", f"hybrid.threshold={THRESHOLD}", "hybrid.colocated_replicas=2",
                 *MIXED)
    summary = execute(cfg, tmp_path)
    records = read_jsonl(tmp_path / "requests.jsonl")
    assert [r["status"] for r in records] == ["finished"] * 16
    short = [r for r in records if r["prompt_len"] < THRESHOLD]
    long = [r for r in records if r["prompt_len"] >= THRESHOLD]
    assert short and long
    # only the long prompts' KV crossed the link
    assert all(r["kv_bytes_sent"] == 0 for r in short)
    assert all(r["kv_bytes_sent"] == r["prompt_len"] * cfg.model.kv_bytes_per_token for r in long)
    its = read_jsonl(tmp_path / "iterations.jsonl")

    def tokens(workers, key):
        return sum(it[key] for it in its if it["worker"] in workers)
    assert set(summary["workers"]) == {"replica0", "replica1", "prefill0", "decode0"}
    assert tokens({"replica0", "replica1"}, "num_prefill_tokens") == sum(r["prompt_len"] for r in short)
    assert tokens({"replica0", "replica1"}, "num_decode_tokens") == 3 * len(short)
    assert tokens({"prefill0"}, "num_prefill_tokens") == sum(r["prompt_len"] for r in long)
    assert tokens({"prefill0"}, "num_decode_tokens") == 0
    assert tokens({"decode0"}, "num_decode_tokens") == 3 * len(long)
    assert all({"replica0", "replica1"} & {it["worker"] for it in its})
    assert summary["kv_blocks_leaked"] == {}
    assert all(w["all_free"] for w in summary["workers"].values())


def test_hybrid_gpus_count_both_pools():
    cfg = config("runtime=sim", "mode=hybrid", "model=llama3-8b", "hardware=h100-sxm", "hybrid.colocated_replicas=2",
                 "prefill.parallel.tp=2")
    assert num_gpus(cfg) == 2 + 2 + 1


def test_with_every_replica_dead_short_prompts_are_disaggregated():
    from testbed.runtime.messages import Add, Reserve
    cfg = config("runtime=sim", "mode=hybrid", f"hybrid.threshold={THRESHOLD}")
    mode = build_mode(cfg)
    sent = []
    ctl = mode.controller(mode.workers(), lambda w, c: sent.append((w, type(c))), copy_prompts=False)
    ctl.on_arrival(Request("a", list(range(1, 20)), 4), 0.0)
    ctl.on_arrival(Request("b", list(range(1, THRESHOLD + 1)), 4), 0.0)
    assert sent == [("replica0", Add), ("decode0", Reserve)]
    ctl.on_worker_died("replica0", 0.1)
    failed = ctl.sink.by_id()["a"]
    assert failed.status == "failed" and "replica0 died" in failed.error
    ctl.on_arrival(Request("c", list(range(1, 20)), 4), 0.2)
    assert ctl.queue and list(ctl.queue) == ["c"]      # behind b's reservation in flight, on the P/D pools


# -- hybrid.threshold=auto ------------------------------------------------------------------------

GPU = ["runtime=sim", "mode=hybrid", "model=llama3-8b", "hardware=h100-sxm", "link=rdma-400"]   # 3 GPUs


def entry(l_star, num_gpus=3, slo="p99_tbt", link="rdma-400", model="llama3-8b", tbt=100):
    return {"model": model, "hardware": "h100-sxm", "link": link, "link_gbps": 400.0, "num_gpus": num_gpus,
            "slo": slo, "tbt_slo_ms": tbt, "l_star": l_star,
            "best_colocated": {"1024": "sarathi-2048"}, "best_disaggregated": {"1024": "disagg-1P1D"}}


def auto(tmp_path, entries, *overrides):
    path = tmp_path / "decision_summary.json"
    path.write_text(json.dumps({"assumptions": {"ttft_k": 5.0}, "crossovers": entries}))
    return config(*GPU, "hybrid.threshold=auto", f"hybrid.decision_summary={path}", *overrides)


def test_auto_reads_the_entry_of_this_model_hardware_link_gpu_count_and_slo(tmp_path):
    entries = [entry(1024, link="rdma-100"), entry(2048, model="llama2-70b"), entry(4096, num_gpus=8),
               entry(8192, slo="fluidity"), entry(16384), entry(32768, tbt=50)]
    assert hybrid_threshold(auto(tmp_path, entries)) == 16384
    assert hybrid_threshold(auto(tmp_path, entries, "hybrid.slo=fluidity")) == 8192
    assert hybrid_threshold(auto(tmp_path, entries, "slo.tpot_ms=50")) == 32768
    # no entry at this GPU count: the nearest one
    assert hybrid_threshold(auto(tmp_path, [entry(4096, num_gpus=8), entry(2048, num_gpus=2)])) == 2048
    # the controller routes by it
    mode = build_mode(auto(tmp_path, entries))
    ctl = mode.controller(mode.workers(), lambda w, c: None, copy_prompts=False)
    assert ctl.hybrid_router.threshold == 16384


def test_auto_errors_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"^hybrid.decision_summary: no file '/nowhere/d.json'; run "
                                         r"experiment=decision"):
        build_mode(config(*GPU, "hybrid.threshold=auto", "hybrid.decision_summary=/nowhere/d.json"))
    with pytest.raises(ValueError, match=r"has no crossover for model=llama3-8b hardware=h100-sxm link=rdma-400 "
                                         r"\(it has: llama3-8b/h100-sxm/rdma-100\)"):
        build_mode(auto(tmp_path, [entry(1024, link="rdma-100")]))
    with pytest.raises(ValueError, match=r"is null: the best disaggregated deployment never overtook the best "
                                         r"colocated one .* set hybrid.threshold to a prompt length"):
        build_mode(auto(tmp_path, [entry(None)]))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"^hybrid.decision_summary: '.*bad.json' is not JSON"):
        build_mode(config(*GPU, "hybrid.threshold=auto", f"hybrid.decision_summary={bad}"))
    with pytest.raises(ValueError, match=r"^hybrid.threshold=auto reads the crossover from a decision study: set "
                                         r"hybrid.decision_summary"):
        validate(config(*GPU, "hybrid.threshold=auto"))
    with pytest.raises(ValueError, match=r"^hybrid.threshold: a prompt length in tokens \(>= 1\) or 'auto', got 0"):
        validate(config(*GPU, "hybrid.threshold=0"))
    with pytest.raises(ValueError, match=r"^hybrid.router='shortest' is not known"):
        validate(config(*GPU, "hybrid.router=shortest"))


def test_a_missing_summary_fails_the_run_before_any_worker_starts(tmp_path):
    cfg = config("runtime=real", "mode=hybrid", "hybrid.threshold=auto", "hybrid.decision_summary=/nowhere/d.json",
                 "workload.num_requests=2")
    with pytest.raises(ValueError, match=r"^hybrid.decision_summary: no file"):
        execute(cfg, tmp_path)


# -- the real engine ---------------------------------------------------------------------------------

@pytest.mark.slow       # ~30 s here (three worker processes start, 2 shared cores) plus the colocated run
def test_real_hybrid_generates_the_colocated_tokens(colocated, tmp_path):  # noqa: F811
    cfg = real_config(mode="hybrid", hybrid={"threshold": THRESHOLD})
    reqs = workload(cfg)
    assert {r.prompt_len < THRESHOLD for r in reqs} == {True, False}      # both pools serve
    summary = execute(cfg, tmp_path)
    records = read_jsonl(tmp_path / "requests.jsonl")
    assert [(r["request_id"], r["status"]) for r in records] == [(r.request_id, "finished") for r in reqs]
    assert_same_tokens(cfg, {r["request_id"]: r["output_token_ids"] for r in records}, colocated)
    its = read_jsonl(tmp_path / "iterations.jsonl")
    prompt = {r.request_id: r.prompt_len for r in reqs}
    assert sum(it["num_prefill_tokens"] for it in its if it["worker"] == "replica0") == \
        sum(n for n in prompt.values() if n < THRESHOLD)
    assert sum(it["num_prefill_tokens"] for it in its if it["worker"] == "prefill0") == \
        sum(n for n in prompt.values() if n >= THRESHOLD)
    assert all((r["kv_bytes_sent"] > 0) == (prompt[r["request_id"]] >= THRESHOLD) for r in records)
    assert summary["kv_blocks_leaked"] == {}
    assert all(s["all_free"] for s in summary["workers"].values())
