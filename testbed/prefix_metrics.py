"""Prefix-reuse metrics of `mode=kvstore` (DESIGN.md, "Metrics").

Per request (`metrics.KVStoreRequestRecord`, a RequestRecord with four more
fields in requests.jsonl): the prompt tokens whose KV was reused, from the prefill
worker's own cache and from the store, and the store fetch time. vLLM's
names where it has them: `num_cached_tokens` (RequestOutput), and the
KV connector's "external" tokens for the store's part.

Summary (`prefix_cache_summary`): vLLM's prefix-cache counters in tokens,
`prefix_cache_queries` (prompt tokens looked up) and `prefix_cache_hits`
(reused), their ratio `prefix_cache_hit_rate`, split into local and store;
and the store's own counters (`kv_store`: block hits, misses, evictions,
bytes to and from it)."""
from __future__ import annotations

from collections.abc import Sequence

from testbed.metrics import KVStoreRequestRecord, RequestRecord, latency_stats_ms


def prefix_cache_summary(records: Sequence[RequestRecord]) -> dict | None:
    """None when no record counts cached tokens (every mode but kvstore)."""
    counted = [r for r in records if isinstance(r, KVStoreRequestRecord) and r.store_fetch_s is not None]
    if not counted:
        return None
    queries = sum(r.prompt_len for r in counted)
    local = sum(r.num_local_cached_tokens for r in counted)
    store = sum(r.num_external_cached_tokens for r in counted)
    return {"prefix_cache_queries": queries, "prefix_cache_hits": local + store,
            "prefix_cache_hit_rate": (local + store) / queries if queries else None,
            "local_hits": local, "store_hits": store,
            "local_hit_rate": local / queries if queries else None,
            "store_hit_rate": store / queries if queries else None,
            "store_fetch_ms": latency_stats_ms([r.store_fetch_s for r in counted if r.num_external_cached_tokens])}
