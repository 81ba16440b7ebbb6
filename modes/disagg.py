"""`mode=disagg` (Splitwise): P prefill workers and D decode workers.

Hand-off, per request:
  1. the router picks the decode worker with the most free KV blocks and asks
     it to `reserve` blocks for the prompt; on `rejected` the request waits at
     the head of the queue until a decode worker reports enough free blocks
     (it is never dropped);
  2. on `reserved`, the prefill worker with the fewest outstanding prefill
     tokens computes the prompt and the first token (streamed to the client:
     TTFT), and sends the KV straight into the reserved blocks;
  3. on `kv_received`, the prefill worker is told to `release` its blocks; the
     decode worker decodes the rest.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from testbed.modes.base import ModeController, Send, WorkerInfo
from testbed.request import Request


@dataclass
class _HandOff:
    request: Request
    decode: str | None = None
    prefill: str | None = None
    prefilled_s: float | None = None     # engine time the KV left (first token sampled)


class DisaggController(ModeController):
    def __init__(self, workers: list[WorkerInfo], send: Send):
        super().__init__(workers, send)
        self.prefill = sorted(w for w, i in self.workers.items() if i.role == "prefill")
        self.decode = sorted(w for w, i in self.workers.items() if i.role == "decode")
        if not self.prefill or not self.decode:
            raise ValueError("mode=disagg needs prefill_workers >= 1 and decode_workers >= 1")
        self.free_blocks = {w: self.workers[w].num_blocks for w in self.decode}
        self.prefill_tokens: Counter[str] = Counter()
        self.queue: deque[str] = deque()
        self.reserving: str | None = None        # one reservation in flight keeps FCFS order
        self.reserving_on: str | None = None     # the decode worker asked
        self.handoffs: dict[str, _HandOff] = {}

    def _blocks_needed(self, req: Request) -> int:
        return -(-(req.prompt_len + 1) // self.workers[self.decode[0]].block_size)

    def route(self, req: Request, now: float) -> None:
        # the decode worker ends up holding the prompt's and the outputs' KV
        if self._fail_if_never_fits(req, self.decode, "decode worker", now):
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
        while self.queue and self.reserving is None:
            rid = self.queue[0]
            ho = self.handoffs[rid]
            alive = [w for w in self.decode if w not in self.dead]
            if not alive:
                return
            best = max(alive, key=lambda w: (self.free_blocks[w], w))
            if self.free_blocks[best] < self._blocks_needed(ho.request):
                return                                    # wait for blocks to free up
            self.queue.popleft()
            self.reserving, self.reserving_on = rid, best
            ho.decode = best
            self.location[rid] = {best}
            self.send(best, {"type": "reserve", "request": self.request_msg(ho.request)})

    def on_free_blocks(self, worker_id: str, free_blocks: int, now: float) -> None:
        if worker_id in self.free_blocks:
            self.free_blocks[worker_id] = free_blocks
            self._dispatch()

    def on_mode_event(self, ev: dict, now: float) -> None:
        kind, rid = ev["type"], ev["id"]
        if ev.get("worker") in self.dead:
            return      # sent just before it died, read after: its requests are resolved, a reservation re-queued
        if kind in ("reserved", "rejected"):
            self.reserving = self.reserving_on = None
            self.free_blocks[ev["worker"]] = ev["free_blocks"]
        ho = self.handoffs.get(rid)
        if ho is None:                     # resolved meanwhile (aborted, a worker died)
            if kind == "reserved":
                self.send(ev["worker"], {"type": "release", "id": rid})
            elif kind == "kv_received":
                self.send(ev["worker"], {"type": "abort", "id": rid})
            elif kind == "prefilled" and rid in self.records:
                self._record_prefilled(rid, ev)      # the KV did leave: count it
            self._dispatch()
            return
        if kind == "reserved":
            alive = [w for w in self.prefill if w not in self.dead]
            p = min(alive, key=lambda w: (self.prefill_tokens[w], w))
            ho.prefill = p
            self.prefill_tokens[p] += ho.request.prompt_len
            self.location[rid] = {ho.decode, p}
            self.send(p, {"type": "prefill", "request": self.request_msg(ho.request),
                          "peer": ho.decode, "dst_blocks": ev["blocks"]})
        elif kind == "rejected":
            ho.decode = None
            self.location[rid] = set()
            self.queue.appendleft(rid)
        elif kind == "prefilled":
            ho.prefilled_s = ev["t"]
            self._record_prefilled(rid, ev)
            self.prefill_tokens[ho.prefill] -= ho.request.prompt_len
        elif kind == "kv_received":
            rec = self.records[rid]
            rec.transfer_end_s = ev["t"]
            if ho.prefilled_s is not None:         # else _record_prefilled sets it when that event comes
                rec.exposed_transfer_s = max(0.0, ev["t"] - ho.prefilled_s)
            self.send(ho.prefill, {"type": "release", "id": rid})
            self.location[rid] = {ho.decode}
        else:
            raise ValueError(f"unexpected event type '{kind}'")
        self._dispatch()

    def _record_prefilled(self, rid: str, ev: dict) -> None:
        """The prefill and decode workers report on separate sockets, so the
        decode side's `kv_received` (even the request's end) may come first."""
        rec = self.records[rid]
        rec.kv_bytes_sent = ev["kv_bytes"]
        # layer-wise, the first layers left before the first token: the transfer began there
        rec.transfer_start_s = ev.get("transfer_start_s", ev["t"])
        if rec.transfer_end_s is not None:
            rec.exposed_transfer_s = max(0.0, rec.transfer_end_s - ev["t"])

    def on_worker_died(self, worker_id: str, now: float) -> None:
        # a reservation asked of the dead worker is never answered, and it would
        # stall the queue behind it; its request holds nothing anywhere yet, so
        # it goes back to the head of the queue for another decode worker
        if self.reserving_on == worker_id:
            rid, self.reserving, self.reserving_on = self.reserving, None, None
            if rid in self.handoffs:
                self.handoffs[rid].decode = None
                self.location[rid] = set()
                self.queue.appendleft(rid)
        super().on_worker_died(worker_id, now)
        gone = self._dead_pool()
        if gone is not None:       # nobody left to serve what waits: fail it now, not at timeout_s
            for rid in list(self.handoffs):
                for w in self.location[rid] - self.dead:
                    self.send(w, {"type": "abort", "id": rid})
                self.forget(rid)
                self._resolve(rid, "failed", gone, now)
        self._dispatch()

    def on_request_end(self, rid: str, ev: dict, now: float) -> None:
        ho = self.handoffs.get(rid)
        if ho is None:
            return
        # the side that did not report may still hold blocks for it
        if ev.get("worker") != ho.decode and ho.decode is not None:
            self.send(ho.decode, {"type": "release", "id": rid})
        if ho.prefill is not None:
            self.send(ho.prefill, {"type": "release", "id": rid})
            if ho.prefilled_s is None:
                self.prefill_tokens[ho.prefill] -= ho.request.prompt_len
        self.handoffs.pop(rid, None)

    def forget(self, rid: str) -> None:
        ho = self.handoffs.pop(rid, None)
        if ho is not None and ho.prefill is not None and ho.prefilled_s is None:
            self.prefill_tokens[ho.prefill] -= ho.request.prompt_len
        if rid in self.queue:
            self.queue.remove(rid)
        # a reservation in flight for it is released when its reply arrives (on_mode_event)
