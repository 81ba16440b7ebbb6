"""Prefix-reuse metrics of `mode=kvstore`.

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

from array import array
from collections.abc import Iterable

import numpy as np

from testbed.metrics import KVStoreRequestRecord, RequestRecord, latency_stats_ms


class PrefixCacheStats:
    """The counters, fed one record at a time (testbed/run_stats.py)."""

    def __init__(self) -> None:
        self.num_counted = self.queries = self.local = self.store = 0
        self.fetch_s = array("d")      # of the requests that read from the store

    def add(self, r: RequestRecord) -> None:
        if not isinstance(r, KVStoreRequestRecord) or r.store_fetch_s is None:
            return
        self.num_counted += 1
        self.queries += r.prompt_len
        self.local += r.num_local_cached_tokens
        self.store += r.num_external_cached_tokens
        if r.num_external_cached_tokens:
            self.fetch_s.append(r.store_fetch_s)

    def summary(self) -> dict | None:
        """None when no record counts cached tokens (every mode but kvstore)."""
        if not self.num_counted:
            return None
        queries, local, store = self.queries, self.local, self.store
        return {"prefix_cache_queries": queries, "prefix_cache_hits": local + store,
                "prefix_cache_hit_rate": (local + store) / queries if queries else None,
                "local_hits": local, "store_hits": store,
                "local_hit_rate": local / queries if queries else None,
                "store_hit_rate": store / queries if queries else None,
                "store_fetch_ms": latency_stats_ms(np.frombuffer(self.fetch_s, dtype=np.float64))}


def prefix_cache_summary(records: Iterable[RequestRecord]) -> dict | None:
    """None when no record counts cached tokens (every mode but kvstore)."""
    stats = PrefixCacheStats()
    for r in records:
        stats.add(r)
    return stats.summary()
