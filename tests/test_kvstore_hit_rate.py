"""mode=kvstore: the measured prefix hit rate against what the
workload's hash ids say it must be (an unbounded store), and against an
offline LRU replay of the same block sequence (a bounded store); on
runtime=sim, and on runtime=real for a shortened trace."""
from __future__ import annotations

import json
import random
import re
from collections import OrderedDict
from pathlib import Path

import pytest

from testbed.block_keys import prefix_block_keys
from testbed.config import from_dict
from testbed.run import execute
from testbed.workloads.build import build_workload
from testbed.workloads.config import WorkloadConfig
from testbed.workloads.multiturn import block_reuse, multiturn_rows

BLOCK = 64          # tokens per trace block (hash id)


def prefix_tree_trace(path: Path, n: int, block: int, seed: int, gap_ms: float, max_blocks: int = 8) -> list[dict]:
    """n requests, each extending a prefix of an earlier one (or nothing) with
    1-3 fresh blocks: hash ids name prefixes, as in Mooncake's traces. Every
    prompt is whole blocks, and its last block is fresh."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    rows, next_id = [], 0
    for i in range(n):
        ids: list[int] = []
        fresh = rng.randint(1, 3)
        if prompts and rng.random() < 0.75:
            parent = rng.choice(prompts)
            ids = parent[:rng.randint(1, min(len(parent), max_blocks - fresh))]
        ids = ids + list(range(next_id, next_id + fresh))
        next_id += fresh
        prompts.append(ids)
        rows.append({"timestamp": i * gap_ms, "input_length": len(ids) * block,
                     "output_length": rng.randint(2, 5), "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def reuse_from_hash_ids(rows: list[dict], block: int) -> float:
    """Prompt tokens in blocks seen before (in arrival order) over all prompt
    tokens, counted from the hash ids alone."""
    seen: set[int] = set()
    reused = total = 0
    for r in sorted(rows, key=lambda r: r["timestamp"]):
        ids = r["hash_ids"]
        reused += sum(block for h in ids[:-1] if h in seen)
        total += r["input_length"]
        seen.update(ids)
    return reused / total


def trace_config(trace: Path, **overrides):
    d = {"mode": "kvstore", "runtime": {"name": "sim"}, "wandb": {"mode": "disabled"}, "progress": False,
         "prefill_workers": 2, "decode_workers": 2,
         "workload": {"name": "tree", "trace_path": str(trace), "trace_format": "mooncake", "arrival": "trace",
                      "prompt_dist": "trace", "output_dist": "trace", "hash_block_size": BLOCK},
         "kvstore": {"capacity_bytes": None}}
    for k, v in overrides.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and k in d else v
    return from_dict(d)


def requests(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("router", ["cache_aware", "round_robin"])
def test_unbounded_store_hit_rate_equals_the_reuse_in_the_hash_ids(tmp_path, router):
    rows = prefix_tree_trace(tmp_path / "t.jsonl", 80, BLOCK, seed=3, gap_ms=500)
    expected = reuse_from_hash_ids(rows, BLOCK)
    assert 0.3 < expected < 0.8
    summary = execute(trace_config(tmp_path / "t.jsonl", kvstore={"prefill_router": router}), tmp_path / "run")
    pc = summary["prefix_cache"]
    assert summary["num_finished"] == 80 and summary["kv_blocks_leaked"] == {}
    assert abs(pc["prefix_cache_hit_rate"] - expected) <= 0.005, (pc, expected)
    if router == "round_robin":
        # alternating between two prefill workers, the store serves what the other one computed
        assert pc["store_hits"] > 0 and pc["local_hits"] > 0
    else:
        # the cache-aware router sends a prefix back where it is cached: no fetch needed
        assert pc["local_hits"] >= pc["store_hits"]
    recs = requests(tmp_path / "run")
    assert all(r["num_cached_tokens"] == r["num_local_cached_tokens"] + r["num_external_cached_tokens"] for r in recs)
    assert summary["kv_store"]["evictions"] == 0


def offline_lru_hit_tokens(reqs, block_size: int, capacity_blocks: int) -> int:
    """An independent LRU in blocks, replaying what a prefill worker without
    a cache of its own does per request: look the prefix up (a hit refreshes
    it), then publish the blocks it computed."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit_tokens = 0
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        keys = prefix_block_keys(r, block_size, r.prompt_len // block_size)
        hit = 0
        for k in keys[:(r.prompt_len - 1) // block_size]:
            if k not in cache:
                break
            cache.move_to_end(k)
            hit += 1
        for k in keys[hit:]:
            cache[k] = None
            cache.move_to_end(k)
            if len(cache) > capacity_blocks:
                cache.popitem(last=False)
        hit_tokens += hit * block_size
    return hit_tokens


def test_bounded_store_hit_rate_equals_an_offline_lru_replay(tmp_path):
    prefix_tree_trace(tmp_path / "t.jsonl", 80, BLOCK, seed=5, gap_ms=500)
    rates = []
    for capacity_blocks in (10_000, 120, 40, 12):
        # the workers' own caches off, so every lookup reaches the store
        cfg = trace_config(tmp_path / "t.jsonl", prefill_workers=1, enable_prefix_caching=False)
        block_bytes = cfg.model.kv_bytes_per_token * cfg.block_size
        cfg.kvstore.capacity_bytes = capacity_blocks * block_bytes
        summary = execute(cfg, tmp_path / f"run{capacity_blocks}")
        reqs = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
        expected = offline_lru_hit_tokens(reqs, cfg.block_size, capacity_blocks) / sum(r.prompt_len for r in reqs)
        pc = summary["prefix_cache"]
        assert pc["local_hits"] == 0
        assert pc["store_hit_rate"] == pytest.approx(expected, abs=1e-12), capacity_blocks
        rates.append(pc["store_hit_rate"])
    assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1]


def test_multiturn_workload_reuse_is_what_it_was_asked(tmp_path):
    import numpy as np
    cfg = WorkloadConfig(num_requests=300, conversation_turns=4, reuse_fraction=0.6, rate=2.0,
                         prompt_dist="fixed", prompt_len=1000, hash_block_size=16,
                         think_time_s=20.0)
    rows = multiturn_rows(cfg, [np.random.default_rng([0, s]) for s in range(3)])
    assert len(rows) == 300
    # each later turn extends its previous one: the previous prompt is ~60% of it
    by_conv: dict[int, list] = {}
    for r in rows:
        by_conv.setdefault(r.hash_ids[0], []).append(r)
    shares = [a.prompt_len / b.prompt_len for turns in by_conv.values() for a, b in zip(turns, turns[1:])]
    assert len(shares) > 100 and all(abs(s - 0.6) < 0.01 for s in shares)
    # first turns reuse nothing: over all tokens, 1000 + 1667 + 2778 of 10,075 in a whole conversation
    assert 0.4 < block_reuse(rows, 16) < 0.55


def test_multiturn_sim_hit_rate_equals_its_block_reuse(tmp_path):
    wl = {"name": "multiturn", "num_requests": 60, "conversation_turns": 4, "reuse_fraction": 0.6, "rate": 1.0,
          "prompt_dist": "uniform", "prompt_min": 64, "prompt_max": 1024, "output_dist": "uniform",
          "output_min": 2, "output_max": 8, "hash_block_size": 16, "think_time_s": 5.0}
    cfg = from_dict({"mode": "kvstore", "runtime": {"name": "sim"}, "wandb": {"mode": "disabled"},
                     "progress": False, "prefill_workers": 2, "decode_workers": 2, "workload": wl,
                     "kvstore": {"capacity_bytes": None}})
    summary = execute(cfg, tmp_path)
    rows = multiturn_rows(cfg.workload, [__import__("numpy").random.default_rng([cfg.seed, s]) for s in range(3)])
    assert summary["prefix_cache"]["prefix_cache_hit_rate"] == pytest.approx(block_reuse(rows, 16), abs=0.005)


def test_real_unbounded_store_hit_rate_equals_the_reuse_in_the_hash_ids(tmp_path):
    """The same kind of trace, shortened, on real processes (2P1D over zmq;
    round robin alternates the prefill workers, so the store serves what the
    other one computed), and on the simulator."""
    rows = prefix_tree_trace(tmp_path / "t.jsonl", 14, BLOCK, seed=3, gap_ms=400, max_blocks=6)
    expected = reuse_from_hash_ids(rows, BLOCK)
    cfg = trace_config(tmp_path / "t.jsonl", runtime={"name": "real"}, decode_workers=1, timeout_s=120,
                       kvstore={"prefill_router": "round_robin"})
    summary = execute(cfg, tmp_path / "run")
    pc = summary["prefix_cache"]
    assert summary["num_finished"] == 14 and summary["kv_blocks_leaked"] == {}
    assert abs(pc["prefix_cache_hit_rate"] - expected) <= 0.005, (pc, expected)
    assert pc["store_hits"] > 0
    ks = summary["kv_store"]
    assert ks["bytes_from_store"] == pc["store_hits"] * cfg.model.kv_bytes_per_token
    # the simulator, on the same workload, reuses the very same tokens from the same places
    sim = execute(trace_config(tmp_path / "t.jsonl", decode_workers=1, kvstore={"prefill_router": "round_robin"}),
                  tmp_path / "sim")
    assert {k: sim["prefix_cache"][k] for k in ("local_hits", "store_hits")} == \
        {k: pc[k] for k in ("local_hits", "store_hits")}
    assert {k: sim["kv_store"][k] for k in ("hits", "misses", "blocks_stored", "evictions")} == \
        {k: ks[k] for k in ("hits", "misses", "blocks_stored", "evictions")}


def test_a_disk_tier_keeps_what_a_small_dram_tier_evicts(tmp_path, capsys):
    prefix_tree_trace(tmp_path / "t.jsonl", 80, BLOCK, seed=5, gap_ms=500)
    rates = {}
    for name, dram, disk in (("unbounded", None, 0), ("dram", 12, 0), ("dram+disk", 12, 10_000)):
        cfg = trace_config(tmp_path / "t.jsonl", prefill_workers=1, enable_prefix_caching=False)
        block_bytes = cfg.model.kv_bytes_per_token * cfg.block_size
        cfg.kvstore.capacity_bytes = None if dram is None else dram * block_bytes
        cfg.kvstore.disk_capacity_bytes, cfg.kvstore.disk_path = disk * block_bytes, str(tmp_path / "unused")
        summary = execute(cfg, tmp_path / name)
        rates[name] = summary["prefix_cache"]["store_hit_rate"]
        ks, printed = summary["kv_store"], capsys.readouterr().out
        if disk:
            assert ks["disk_hits"] > 0 and ks["evictions"] == 0
            # the run's printed summary says what the disk tier did
            assert re.search(rf"kv_store disk tier +demoted {ks['demotions']}  hits {ks['disk_hits']}\n", printed)
        else:
            assert "disk tier" not in printed
    assert rates["dram"] < rates["dram+disk"] == rates["unbounded"]
