"""`mode=kvstore` (Mooncake): disagg's P prefill and D decode workers plus a
KV block store shared by the prefill pool (kv_transfer/store_service.py, a
process of its own; a modeled node on runtime=sim).

Per request, as in disagg (modes/disagg.py): reserve on a decode worker,
prefill, push the KV into the reserved blocks, release. What changes:
  - the prefill router (`kvstore.prefill_router`, default `cache_aware`)
    picks the prefill worker with the lowest estimated TTFT, counting what
    its own cache and the store already hold (modes/cache_aware.py);
  - the prefill worker computes only the uncached suffix and publishes the
    blocks it computed (modes/kvstore_roles.py), and reports the reuse
    (`PrefixFetched`), which each request's record keeps;
  - with `kvstore.early_rejection`, a request whose predicted TTFT breaks
    slo.ttft_ms, or for which the decode pool has no room, is refused at
    arrival with status `rejected` (goodput counts it as a miss).
"""
from __future__ import annotations

from testbed.modes.base import Send, WorkerInfo
from testbed.modes.cache_aware import PrefixPool, TTFTEstimator
from testbed.modes.disagg import DisaggController
from testbed.modes.routers import Router
from testbed.metrics import KVStoreRequestRecord
from testbed.request import Request
from testbed.runtime.messages import Event, Finished, Prefilled, PrefixFetched, Reserved


class KVStoreController(DisaggController):
    record_cls = KVStoreRequestRecord

    def __init__(self, prefill: list[WorkerInfo], decode: list[WorkerInfo], send: Send, prefill_router: Router,
                 decode_router: Router, pool: PrefixPool, estimator: TTFTEstimator | None,
                 slo_ttft_ms: float | None, copy_prompts: bool = True):
        super().__init__(prefill, decode, send, prefill_router, decode_router, copy_prompts)
        self.pool = pool
        self.estimator, self.slo_ttft_ms = estimator, slo_ttft_ms    # estimator set: early rejection on
        self.uncached: dict[str, tuple[str, int]] = {}     # id -> (prefill worker, tokens it must compute)
        self.num_rejected = 0

    def apart_from(self, worker_id: str) -> frozenset[str] | None:
        # runtime=sim: no decode worker shown apart. Disagg's DecodeRuns bought kvstore no
        # speed beyond the noise (experiments/benchmarks/bench_kvstore.py speed --cases kvstore)
        return None

    def route(self, req: Request, now: float) -> None:
        why = self._rejection(req) if self.estimator is not None else None
        if why is not None:
            self.num_rejected += 1
            self._resolve(req.request_id, "rejected", why, now)
        else:
            super().route(req, now)
        if req.request_id not in self.handoffs:      # refused or failed at once: its keys are not needed
            self.pool.forget(req.request_id)

    def _rejection(self, req: Request) -> str | None:
        prefill, decode = self.alive(self.prefill), self.alive(self.decode)
        if not prefill or not decode:
            return None                           # the base controller fails it with the reason
        store = self.pool.store_prefix_tokens(req)
        ttft_s = min(self.estimator.estimate_s(req, w, self.pool, store) for w in prefill)
        if self.slo_ttft_ms is not None and ttft_s * 1000 > self.slo_ttft_ms:
            return f"rejected at arrival: predicted TTFT {ttft_s * 1000:.0f} ms > slo.ttft_ms={self.slo_ttft_ms:g}"
        waiting = sum(self._blocks_needed(self.handoffs[r].request) for r in self.queue)
        free = sum(self.pool.free_blocks(w) for w in decode)
        if waiting + self._blocks_needed(req) > free:
            return (f"rejected at arrival: the decode pool has {free} free KV blocks, {waiting} already "
                    f"promised to queued requests, and this one needs {self._blocks_needed(req)}")
        return None

    def on_mode_event(self, ev: Event, now: float) -> None:
        kind = type(ev)
        if kind is PrefixFetched:
            self._on_prefix(ev)
            return
        rid = getattr(ev, "id", None)
        before = self.handoffs.get(rid)
        super().on_mode_event(ev, now)
        if kind is Reserved and before is not None and before.prefill is not None and rid not in self.uncached:
            req = before.request
            cached = max(self.pool.cached_prefix_tokens(before.prefill, req), self.pool.store_prefix_tokens(req))
            self.uncached[rid] = (before.prefill, req.prompt_len - cached)
            self.pool.routed(before.prefill, req, cached)
        elif kind is Prefilled:
            self._prefilled(rid)

    def _on_prefix(self, ev: PrefixFetched) -> None:
        rec = self.records.get(ev.id)
        if rec is None:
            return
        rec.num_local_cached_tokens, rec.num_external_cached_tokens = ev.local_tokens, ev.store_tokens
        rec.num_cached_tokens = ev.local_tokens + ev.store_tokens
        rec.store_fetch_s = ev.fetch_s
        if ev.id in self.uncached:               # the estimate routed on becomes the truth
            worker, estimate = self.uncached[ev.id]
            actual = rec.prompt_len - rec.num_cached_tokens
            self.pool.prefilled(worker, estimate - actual)
            self.uncached[ev.id] = (worker, actual)

    def _prefilled(self, rid: str) -> None:
        entry = self.uncached.pop(rid, None)
        if entry is not None:
            self.pool.prefilled(*entry)
        self.pool.forget(rid)

    def on_request_end(self, rid: str, ev: Finished, now: float) -> None:
        self._prefilled(rid)
        super().on_request_end(rid, ev, now)

    def forget(self, rid: str) -> None:
        self._prefilled(rid)
        super().forget(rid)
