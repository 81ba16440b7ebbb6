"""mode=kvstore on the real runtime (tiny model, fp32, CPU, zmq): on a seeded
multi-turn chat workload it generates exactly the colocated tokens, 1P1D and
2P2D, while reusing prefixes from the workers' caches and the store process;
and the store's faults, each caused for real, cost reuse, never a request:
the store process killed mid-run, a block corrupted on its way out of the
store, a store too small to keep anything. Every run ends with every KV
block of every worker free."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.config import RunConfig, from_dict
from testbed.run import execute
from testbed.runtime.build import apply_sampling
from testbed.runtime.messages import PrefixFetched
from testbed.runtime.real import STORE_ID, RealRuntime
from testbed.workloads.build import build_workload

WORKLOAD = {"name": "multiturn_test", "num_requests": 12, "conversation_turns": 3, "reuse_fraction": 0.6,
            "rate": 2.0, "think_time_s": 1.0, "prompt_dist": "uniform", "prompt_min": 48, "prompt_max": 160,
            "output_dist": "uniform", "output_min": 3, "output_max": 8, "hash_block_size": 16}


def config(**overrides) -> RunConfig:
    d = {"mode": "kvstore", "token_budget": 64, "workload": WORKLOAD, "wandb": {"mode": "disabled"},
         "progress": False, "timeout_s": 90, "transfer": {"timeout_s": 20},
         "kvstore": {"capacity_bytes": None, "prefill_router": "round_robin"}}
    for key, value in overrides.items():
        d[key] = {**d[key], **value} if isinstance(value, dict) and key in d else value
    return from_dict(d)


def tokens_of(out: Path) -> dict[str, list[int]]:
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [(r["status"], r["error"]) for r in recs] == [("finished", None)] * len(recs)
    return {r["request_id"]: r["output_token_ids"] for r in recs}


@pytest.fixture(scope="module")
def colocated(tmp_path_factory) -> dict[str, list[int]]:
    out = tmp_path_factory.mktemp("colocated")
    execute(config(mode="colocated"), out)
    return tokens_of(out)


def assert_no_leaks(summary: dict) -> None:
    assert summary["kv_blocks_leaked"] == {}
    assert all(s["all_free"] for s in summary["workers"].values())


@pytest.mark.parametrize("prefill_workers,decode_workers", [(1, 1), (2, 2)], ids=["1P1D", "2P2D"])
def test_kvstore_generates_the_colocated_tokens(colocated, tmp_path, prefill_workers, decode_workers):
    summary = execute(config(prefill_workers=prefill_workers, decode_workers=decode_workers), tmp_path)
    assert tokens_of(tmp_path) == colocated
    assert_no_leaks(summary)
    pc = summary["prefix_cache"]
    assert pc["prefix_cache_hits"] > 0
    if prefill_workers == 2:         # round robin over two workers: some prefixes come from the store
        assert pc["store_hits"] > 0 and summary["kv_store"]["bytes_from_store"] > 0
    assert summary["kv_store"]["bytes_to_store"] > 0


def test_store_killed_mid_run_falls_back_to_recompute(colocated):
    cfg = config(prefill_workers=2, decode_workers=1, kvstore={"timeout_s": 0.5, "retry_s": 60})
    fetched = []

    def kill_after_a_few(runtime: RealRuntime, ev) -> None:
        if type(ev) is PrefixFetched:
            fetched.append(ev)
            if len(fetched) == 4:
                runtime.kill(STORE_ID)
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, requests)
    result = RealRuntime(cfg, on_event=kill_after_a_few).run(requests)
    assert {r.request_id: (r.status, r.error) for r in result.records} == \
        {rid: ("finished", None) for rid in colocated}
    assert {r.request_id: r.output_token_ids for r in result.records} == colocated
    assert all(s["all_free"] for s in result.worker_stats.values()) and len(result.worker_stats) == 3
    assert result.store_stats is None                    # it never said goodbye
    after = [r for r in result.records if r.request_id not in {e.id for e in fetched[:4]}]
    assert after and all(r.num_external_cached_tokens == 0 for r in after)


def test_corrupted_block_is_never_used(colocated, tmp_path):
    summary = execute(config(prefill_workers=2, decode_workers=1, kvstore={"fault_corrupt_nth_get": 3}), tmp_path)
    assert tokens_of(tmp_path) == colocated
    assert_no_leaks(summary)
    recs = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    used = sum(r["num_external_cached_tokens"] for r in recs) // 16
    assert used < summary["kv_store"]["blocks_served"]    # the corrupted block (and the rest of its read) dropped


def test_full_store_degrades_to_no_caching(colocated, tmp_path):
    summary = execute(config(prefill_workers=2, decode_workers=1, kvstore={"capacity_bytes": 1000}), tmp_path)
    assert tokens_of(tmp_path) == colocated
    assert_no_leaks(summary)
    ks = summary["kv_store"]
    assert ks["puts_rejected"] > 0 and ks["blocks_stored"] == 0 and summary["prefix_cache"]["store_hits"] == 0


def test_disk_tier_serves_what_dram_evicted(colocated, tmp_path):
    block = 2048 * 16          # tiny: 2 KiB of KV per token, 16-token blocks
    summary = execute(config(prefill_workers=2, decode_workers=1,
                             kvstore={"capacity_bytes": 8 * block, "disk_capacity_bytes": 10_000 * block,
                                      "disk_path": str(tmp_path / "disk")}), tmp_path / "run")
    assert tokens_of(tmp_path / "run") == colocated
    assert_no_leaks(summary)
    ks = summary["kv_store"]
    assert ks["demotions"] > 0 and ks["disk_hits"] > 0 and ks["evictions"] == 0
