"""Cache-aware prefill routing for `mode=kvstore`, after Mooncake's Conductor:
send a request to the prefill worker with the lowest estimated TTFT,

    queued prefill (its uncached prompt tokens not yet prefilled)
  + fetch of the cached prefix it lacks (in the store, not in its own cache)
  + prefill of the uncached suffix,

each priced by the cost model's step-time predictor and the store's link.
The frontend cannot see the workers' caches, so `PrefixPool` keeps a shadow
of them from what it routed: per worker, an LRU of the block keys it
prefilled (as many as its KV blocks), and for the store the same StoreIndex
class the store runs, at the store's capacity. A shadow can be wrong (a block
evicted early, a put refused): the worker then computes what it lacks, and
only the estimate was off."""
from __future__ import annotations

from collections import Counter, OrderedDict

from testbed.block_keys import prefix_block_keys
from testbed.kv_transfer.store_index import StoreIndex
from testbed.modes.pool import PoolState, PoolView
from testbed.modes.routers import Router, RouterContext, register_router
from testbed.request import Request


class PrefixPool(PoolState):
    """PoolState plus the shadow caches; read by routers as a PoolView."""

    def __init__(self, num_blocks: dict[str, int], block_size: int, store_capacity_bytes: int | None,
                 block_bytes: int):
        super().__init__(num_blocks)
        self.block_size, self.block_bytes = block_size, block_bytes
        self._local: dict[str, OrderedDict[int, None]] = {w: OrderedDict() for w in num_blocks}
        self._capacity = dict(num_blocks)
        self._store = StoreIndex(store_capacity_bytes)
        self._keys: dict[str, list[int]] = {}
        self._uncached: Counter[str] = Counter()

    def keys(self, request: Request) -> list[int]:
        """The chained keys of the prompt's full blocks (computed once per request)."""
        keys = self._keys.get(request.request_id)
        if keys is None:
            keys = self._keys[request.request_id] = prefix_block_keys(
                request, self.block_size, request.prompt_len // self.block_size)
        return keys

    def _usable(self, request: Request) -> list[int]:
        return self.keys(request)[:(request.prompt_len - 1) // self.block_size]

    # -- PoolView --------------------------------------------------------------------
    def cached_prefix_tokens(self, worker_id: str, request: Request) -> int:
        local, n = self._local[worker_id], 0
        for key in self._usable(request):
            if key not in local:
                break
            n += 1
        return n * self.block_size

    def store_prefix_tokens(self, request: Request) -> int:
        return self._store.num_leading(self._usable(request)) * self.block_size

    def uncached_tokens(self, worker_id: str) -> int:
        """Prompt tokens routed to the worker, not yet prefilled, that it must compute."""
        return self._uncached[worker_id]

    # -- kept by the controller ---------------------------------------------------------
    def routed(self, worker_id: str, request: Request, cached_tokens: int) -> None:
        """The request goes to `worker_id`: its blocks will be cached there and in the store."""
        local, keys = self._local[worker_id], self.keys(request)
        for key in keys:
            if key in local:
                local.move_to_end(key)
            else:
                local[key] = None
        for _ in range(len(local) - self._capacity[worker_id]):
            local.popitem(last=False)
        self._store.put_many(keys, self.block_bytes)
        self._uncached[worker_id] += request.prompt_len - cached_tokens

    def prefilled(self, worker_id: str, uncached_tokens: int) -> None:
        self._uncached[worker_id] -= uncached_tokens

    def forget(self, request_id: str) -> None:
        self._keys.pop(request_id, None)


class TTFTEstimator:
    """Conductor's estimate of a request's TTFT on one prefill worker."""

    def __init__(self, context: RouterContext):
        self.ctx = context

    def prefill_s(self, num_tokens: int, context_len: int) -> float:
        """The last `num_tokens` of a `context_len`-token prompt, in chunks of
        the token budget (each priced at its own context)."""
        if num_tokens <= 0:
            return 0.0
        budget, predict = self.ctx.token_budget, self.ctx.predictor.iteration_time_s
        total, done = 0.0, context_len - num_tokens
        while done < context_len:
            n = min(budget, context_len - done)
            done += n
            total += predict([(n, done)])
        return total

    def estimate_s(self, request: Request, worker_id: str, pool: PoolView, store_tokens: int) -> float:
        local = pool.cached_prefix_tokens(worker_id, request)
        cached = max(local, store_tokens)
        fetch_s = self.ctx.store_transfer_s((cached - local) * self.ctx.kv_bytes_per_token) if cached > local else 0.0
        queued = getattr(pool, "uncached_tokens", pool.prompt_tokens)(worker_id)
        return self.prefill_s(queued, queued) + fetch_s + self.prefill_s(request.prompt_len - cached,
                                                                         request.prompt_len)


class CacheAware(Router):
    name = "cache_aware"
    needs_context = True

    def __init__(self, context: RouterContext):
        self.estimator = TTFTEstimator(context)
        self.last_estimate_s = 0.0

    def pick(self, request, candidates, pool):
        store = getattr(pool, "store_prefix_tokens", lambda r: 0)(request)
        estimates = {w: self.estimator.estimate_s(request, w, pool, store) for w in candidates}
        best = min(candidates, key=lambda w: (estimates[w], w))
        self.last_estimate_s = estimates[best]
        return best


register_router(CacheAware)
