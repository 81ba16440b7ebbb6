"""`mode=disagg` (Splitwise): P prefill workers and D decode workers.

Hand-off, per request:
  1. the decode router (`decode_router=`, default the most free KV blocks)
     picks a decode worker and asks it to `Reserve` blocks for the prompt; on
     `Rejected` the request waits at the head of the queue until a decode
     worker reports enough free blocks (it is never dropped);
  2. on `Reserved`, the prefill router (`prefill_router=`, default the fewest
     outstanding prompt tokens) picks the prefill worker that computes the
     prompt and the first token (streamed to the client: TTFT), and sends the
     KV straight into the reserved blocks;
  3. on `KVReceived`, the prefill worker is told to `Release` its blocks; the
     decode worker decodes the rest.
The workers' side of it is modes/disagg_roles.py.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from testbed.modes.base import ModeController, Send, WorkerInfo
from testbed.modes.routers import Router
from testbed.request import Request
from testbed.runtime.messages import Abort, Event, Finished, KVReceived, Prefill, Prefilled, Rejected, Release, \
    Reserve, Reserved


@dataclass
class _HandOff:
    request: Request
    decode: str | None = None
    prefill: str | None = None
    prefilled_s: float | None = None     # engine time the KV left (first token sampled)


class DisaggController(ModeController):
    def __init__(self, prefill: list[WorkerInfo], decode: list[WorkerInfo], send: Send,
                 prefill_router: Router, decode_router: Router, copy_prompts: bool = True):
        super().__init__(prefill + decode, send, copy_prompts)
        self.prefill = sorted(w.worker_id for w in prefill)
        self.decode = sorted(w.worker_id for w in decode)
        if not self.prefill or not self.decode:
            raise ValueError("mode=disagg needs prefill_workers >= 1 and decode_workers >= 1")
        self.decode_set = set(self.decode)
        self._decode_peers = {w: frozenset(self.decode_set - {w}) for w in self.decode}
        self.prefill_router, self.decode_router = prefill_router, decode_router
        self.queue: deque[str] = deque()
        # decode worker -> the request it was asked to reserve for: one in flight per decode worker,
        # so the queue goes out in FCFS order and a decode worker slow to answer holds back only itself
        self.reserving: dict[str, str] = {}
        self.handoffs: dict[str, _HandOff] = {}
        # Prefill sent, Prefilled not read yet: the prefill worker and the decode worker report on
        # separate sockets, so a request can finish before its Prefilled (the KV's bytes) is read
        self.prefilling: dict[str, str] = {}     # id -> prefill worker

    def _blocks_needed(self, req: Request) -> int:
        return -(-(req.prompt_len + 1) // self.workers[self.decode[0]].block_size)

    def route(self, req: Request, now: float) -> None:
        # the decode worker ends up holding the prompt's and the outputs' KV, the prefill
        # worker the prompt's (a pool of its own parallel split may hold fewer blocks)
        if self._fail_if_never_fits(req, self.decode, "decode worker", now) or \
                self._fail_if_never_fits(req, self.prefill, "prefill worker", now, outputs=False):
            return
        gone = self._dead_pool()
        if gone is not None:
            self._resolve(req.request_id, "failed", gone, now)
            return
        self.handoffs[req.request_id] = _HandOff(req)
        self.queue.append(req.request_id)
        self._dispatch()

    def _dead_pool(self) -> str | None:
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            if all(w in self.dead for w in pool):
                return f"every {role} worker has died ({', '.join(pool)})"
        return None

    def _dispatch(self) -> None:
        while self.queue:
            rid = self.queue[0]
            ho = self.handoffs[rid]
            idle = [w for w in self.alive(self.decode) if w not in self.reserving]
            if not idle:
                return
            best = self.decode_router.pick(ho.request, idle, self.pool)
            if self.pool.free_blocks(best) < self._blocks_needed(ho.request):
                return                                    # wait for blocks to free up
            self.queue.popleft()
            self.reserving[best] = rid
            ho.decode = best
            self.location[rid] = {best}
            self.send(best, Reserve(self.request_msg(ho.request)))

    def apart_from(self, worker_id: str) -> frozenset[str] | None:
        # runtime=sim's ShowsApart (testbed/runtime/sim_fast_forward.py). With nothing queued
        # or being reserved, a Reserve (the only command that gives a decode worker work, and
        # the only reading of its free blocks) goes out on an arrival alone; another decode
        # worker's events then deliver tokens, end requests and release blocks (a prefill
        # worker's too: that gives it no work)
        if worker_id not in self.decode_set or self.queue or self.reserving:
            return None
        return self._decode_peers[worker_id]

    def on_free_blocks(self, worker_id: str, free_blocks: int, now: float) -> None:
        if worker_id in self.decode_set:
            self.pool.set_free_blocks(worker_id, free_blocks)
            self._dispatch()

    def on_mode_event(self, ev: Event, now: float) -> None:
        kind = type(ev)
        if kind not in (Reserved, Rejected, Prefilled, KVReceived):
            raise ValueError(f"unexpected event '{ev.kind}'")
        rid = ev.id
        if ev.worker in self.dead:
            return      # sent just before it died, read after: its requests are resolved, a reservation re-queued
        if kind is Reserved or kind is Rejected:
            self.reserving.pop(ev.worker, None)
            self.pool.set_free_blocks(ev.worker, ev.free_blocks)
        ho = self.handoffs.get(rid)
        if ho is None:                     # resolved meanwhile (aborted, a worker died)
            if kind is Reserved:
                self.send(ev.worker, Release(rid))
            elif kind is KVReceived:
                self.send(ev.worker, Abort(rid))
            elif kind is Prefilled and self.prefilling.pop(rid, None) is not None and rid in self.records:
                self._record_prefilled(rid, ev)      # the KV did leave: count it, and the record is complete
                self._emit(rid)
            self._dispatch()
            return
        if kind is Reserved:
            p = self.prefill_router.pick(ho.request, self.alive(self.prefill), self.pool)
            ho.prefill = p
            self.pool.add_prompt_tokens(p, ho.request.prompt_len)
            self.location[rid] = {ho.decode, p}
            self.prefilling[rid] = p
            self.send(p, Prefill(self.request_msg(ho.request), ho.decode, ev.blocks))
        elif kind is Rejected:
            ho.decode = None
            self.location[rid] = set()
            self.queue.appendleft(rid)
        elif kind is Prefilled:
            ho.prefilled_s = ev.t
            self.prefilling.pop(rid, None)
            self._record_prefilled(rid, ev)
            self.pool.add_prompt_tokens(ho.prefill, -ho.request.prompt_len)
        else:
            rec = self.records[rid]
            rec.transfer_end_s = ev.t
            if ho.prefilled_s is not None:         # else _record_prefilled sets it when that event comes
                rec.exposed_transfer_s = max(0.0, ev.t - ho.prefilled_s)
            self.send(ho.prefill, Release(rid))
            self.location[rid] = {ho.decode}
        self._dispatch()

    def _record_prefilled(self, rid: str, ev: Prefilled) -> None:
        """The prefill and decode workers report on separate sockets, so the
        decode side's `KVReceived` (even the request's end) may come first."""
        rec = self.records[rid]
        rec.kv_bytes_sent = ev.kv_bytes
        # layer-wise, the first layers left before the first token: the transfer began there
        rec.transfer_start_s = ev.transfer_start_s
        if rec.transfer_end_s is not None:
            rec.exposed_transfer_s = max(0.0, rec.transfer_end_s - ev.t)

    def on_worker_died(self, worker_id: str, now: float, reason: str | None = None) -> None:
        # a reservation asked of the dead worker is never answered; its request
        # holds nothing anywhere yet, so it goes back to the head of the queue
        # for another decode worker
        rid = self.reserving.pop(worker_id, None)
        if rid is not None:
            if rid in self.handoffs:
                self.handoffs[rid].decode = None
                self.location[rid] = set()
                self.queue.appendleft(rid)
        super().on_worker_died(worker_id, now, reason)
        for rid in [r for r, w in self.prefilling.items() if w == worker_id and r not in self.unresolved]:
            del self.prefilling[rid]         # its Prefilled never comes
            self._emit(rid)
        gone = self._dead_pool()
        if gone is not None:       # nobody left to serve what waits: fail it now, not at timeout_s
            for rid in list(self.handoffs):
                for w in self.location[rid] - self.dead:
                    self.send(w, Abort(rid))
                self.forget(rid)
                self._resolve(rid, "failed", gone, now)
        self._dispatch()

    def on_request_end(self, rid: str, ev: Finished, now: float) -> None:
        ho = self.handoffs.get(rid)
        if ho is None:
            return
        # `Finished` does not say which side reported it, and either may still hold
        # blocks for it: both are told to release (a no-op where nothing is held)
        if ho.decode is not None:
            self.send(ho.decode, Release(rid))
        if ho.prefill is not None:
            self.send(ho.prefill, Release(rid))
            if ho.prefilled_s is None:
                self.pool.add_prompt_tokens(ho.prefill, -ho.request.prompt_len)
        self.handoffs.pop(rid, None)

    def completes_later(self, rid: str) -> bool:
        if rid not in self.prefilling:
            return False
        if self.records[rid].status == "finished":
            return True                      # its KV was sent: the Prefilled is on its way
        del self.prefilling[rid]             # failed or aborted: whatever of it is late is dropped
        return False

    def forget(self, rid: str) -> None:
        ho = self.handoffs.pop(rid, None)
        if ho is not None and ho.prefill is not None and ho.prefilled_s is None:
            self.pool.add_prompt_tokens(ho.prefill, -ho.request.prompt_len)
        self.prefilling.pop(rid, None)
        if rid in self.queue:
            self.queue.remove(rid)
        # a reservation in flight for it is released when its reply arrives (on_mode_event)
