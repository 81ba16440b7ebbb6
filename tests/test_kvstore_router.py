"""The cache-aware router (modes/cache_aware.py): Conductor's TTFT estimate
over the frontend's shadow of the prefill workers' caches and the store, and
the typed messages mode=kvstore adds."""
from __future__ import annotations

from testbed.kv_transfer.store_index import StoreCounters
from testbed.modes.cache_aware import CacheAware, PrefixPool
from testbed.modes.routers import RouterContext, make_router
from testbed.request import Request
from testbed.runtime.messages import PrefixFetched, StoreStats
from testbed.runtime.wire import decode, encode

BS = 16


class LinearPredictor:
    """1 ms per new token: easy to reason about."""

    def iteration_time_s(self, slices, num_sampled=None):
        return sum(n for n, _ in slices) * 1e-3


def context(store_s_per_byte: float = 0.0) -> RouterContext:
    return RouterContext(LinearPredictor(), lambda nbytes: nbytes * store_s_per_byte, kv_bytes_per_token=100,
                         token_budget=64)


def prompt(n: int, base: int = 0) -> list[int]:
    return [(base + i) % 1000 for i in range(n)]


def test_a_prefix_goes_back_where_it_is_cached():
    pool = PrefixPool({"p0": 1000, "p1": 1000}, BS, None, 100 * BS)
    router = CacheAware(context())
    first = Request("a", prompt(320), 4)
    assert router.pick(first, ["p0", "p1"], pool) == "p0"          # a tie goes by id
    pool.routed("p1", first, 0)                                   # (routed to p1 anyway)
    pool.prefilled("p1", 320)
    again = Request("b", prompt(320) + prompt(64, 500), 4)
    assert pool.cached_prefix_tokens("p1", again) == 320 and pool.cached_prefix_tokens("p0", again) == 0
    assert pool.store_prefix_tokens(again) == 320
    # both can reuse 320 tokens (p0 from the store, free here); equal estimates, so the id decides
    assert router.pick(again, ["p0", "p1"], pool) == "p0"
    # a slow store makes p0's fetch cost: p1, which holds it, wins
    slow = CacheAware(context(store_s_per_byte=1e-6))
    assert slow.pick(again, ["p0", "p1"], pool) == "p1"
    # unless p1's queue outweighs the fetch: 320 uncached tokens queued there cost 320 ms
    pool.routed("p1", Request("c", prompt(320, 900), 4), 0)
    assert slow.pick(again, ["p0", "p1"], pool) == "p0"


def test_estimate_is_queue_plus_fetch_plus_suffix():
    pool = PrefixPool({"p0": 1000}, BS, None, 100 * BS)
    router = CacheAware(context(store_s_per_byte=1e-6))
    pool.routed("p0", Request("a", prompt(160), 4), 0)             # 160 tokens queued: 160 ms
    pool._local["p0"].clear()                                     # evicted locally, still in the store
    req = Request("b", prompt(160) + prompt(40, 500), 4)
    est = router.estimator.estimate_s(req, "p0", pool, pool.store_prefix_tokens(req))
    # queue 160 ms + fetch 160 tokens * 100 B * 1 us/B = 16 ms + suffix 40 ms
    assert abs(est - (0.160 + 0.016 + 0.040)) < 1e-9


def test_the_shadow_of_a_worker_cache_is_bounded_lru():
    pool = PrefixPool({"p0": 4}, BS, None, 100 * BS)
    pool.routed("p0", Request("a", prompt(5 * BS), 1), 0)        # 5 full blocks into a 4-block shadow
    assert pool.cached_prefix_tokens("p0", Request("b", prompt(6 * BS), 1)) == 0   # its first block fell out


def test_make_router_needs_a_context_for_cache_aware():
    import pytest
    with pytest.raises(ValueError, match="only for mode=kvstore"):
        make_router("cache_aware", "router")
    assert isinstance(make_router("cache_aware", "kvstore.prefill_router", context), CacheAware)


def test_kvstore_messages_round_trip_on_the_wire():
    for msg in (PrefixFetched("r1", "prefill0", 32, 64, 96, 0.0125),
                StoreStats("kvstore", StoreCounters(hits=3, evictions=2, bytes_to_store=10), 5, 4096, None)):
        assert decode(encode(msg)) == msg
