"""The two worker roles of `mode=disagg` (modes/disagg.py has the hand-off).

- `PrefillWorker`: a prefill-only engine; once a prompt's first token is
  sampled it sends the prompt's KV into the blocks the decode worker reserved
  (whole, or layer by layer during the final chunk) and holds its own blocks
  until the frontend's `Release`.
- `DecodeWorker`: reserves blocks for a prompt on `Reserve`, admits a request
  once its KV has arrived complete and verified, then decodes it. Nothing
  there looks a prefix up, so its blocks are not hashed."""
from __future__ import annotations

import sys

from testbed.batch import Batch
from testbed.engine import StepOutput
from testbed.kv_transfer.base import TransferError
from testbed.request import Request, RequestStatus
from testbed.runtime.messages import (Finished, FreeBlocks, HandOffMeta, KVReceived, Prefill, Prefilled, Rejected,
                                      Reserve, Reserved)
from testbed.runtime.wire import hand_off_meta
from testbed.worker import WorkerService


class PrefillWorker(WorkerService):
    role = "prefill"
    pool = "prefill"
    prefill_only = True
    sends_kv = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_layers = getattr(self.engine.executor, "num_layers", 1)
        self.handoff: dict[str, tuple[str, list[int]]] = {}     # id -> (decode peer, its block ids)
        self.awaiting_release: dict[str, float] = {}             # KV sent (at engine time), waiting for the ack
        self.streamed: dict[str, tuple[float, int]] = {}         # layer-wise: id -> (first layer left, bytes so far)
        self.send_failed: dict[str, str] = {}                    # layer-wise: id -> why a layer did not go
        self._handlers[Prefill] = self._prefill

    def _prefill(self, msg: Prefill) -> None:
        req = msg.request.to_request()
        self.handoff[req.request_id] = (msg.peer, msg.dst_blocks)
        self.engine.add_request(req)

    def _release(self, request_id: str) -> None:
        """The decode side has the KV (or the request ended). A prompt not yet
        handed off is still queued or mid-prefill here: it ended elsewhere
        (its decode side failed, say) and leaves the scheduler too, or it
        would go on computing into freed blocks."""
        if request_id in self.handoff and request_id not in self.awaiting_release:
            self.engine.abort(request_id)
        self.awaiting_release.pop(request_id, None)
        self.handoff.pop(request_id, None)
        self.streamed.pop(request_id, None)
        self.send_failed.pop(request_id, None)
        if self.kv_port is not None:
            self.kv_port.cancel(request_id)      # before its blocks are freed: a waiting send reads them
        super()._release(request_id)

    def _holds(self, request_id: str) -> bool:
        return request_id in self.awaiting_release

    def _forget(self, request_id: str) -> None:
        self.handoff.pop(request_id, None)
        self.streamed.pop(request_id, None)

    def expire_leases(self, now: float, lease_s: float) -> None:
        for rid in [r for r, sent in self.awaiting_release.items() if now - sent > lease_s]:
            n = len(self.engine.bm.block_table(rid))
            self._release(rid)
            self.num_leases_expired += 1
            print(f"worker {self.worker_id}: no release of {rid} within transfer.lease_s={lease_s:g} s of "
                  f"sending its KV: lease expired, freed its {n} blocks", file=sys.stderr)

    def renew_leases(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            if rid in self.awaiting_release:
                self.awaiting_release[rid] = now

    def _layer_hook(self):
        return self._send_layer if self.layerwise else None

    def _after_finished(self, out: StepOutput) -> None:
        for req in out.prefill_completed:
            self._hand_off(req, out.end_s, out.iteration.duration_s)

    def _send_layer(self, layer: int, batch: Batch) -> None:
        """Layer-wise streaming: once a layer of a prompt's final chunk is done,
        that layer's KV for the whole prompt can go. The last layer goes after
        sampling, with the first token."""
        if layer == self.num_layers - 1:
            return
        for sl in batch.slices:
            req = sl.request
            rid = req.request_id
            if sl.end == req.prompt_len and rid in self.handoff and rid not in self.send_failed:
                start_s, so_far = self.streamed.get(rid, (self.engine.clock.now(), 0))
                try:
                    sent = self._send(req, (layer, layer + 1), last=False, meta={})
                except TransferError as e:       # failed at the hand-off, once the step is over
                    self.send_failed[rid] = str(e)
                    continue
                self.streamed[rid] = (start_s, so_far + sent)

    def _hand_off(self, req: Request, now: float, last_iteration_s: float) -> None:
        first = (self.num_layers - 1) if self.layerwise else 0
        meta = HandOffMeta(req.output_token_ids[0], now, last_iteration_s, req.first_scheduled_s,
                           req.num_preemptions)
        # layer-wise, the earlier layers left during the step: count them, and start the transfer there
        start_s, streamed = self.streamed.pop(req.request_id, (now, 0))
        why = self.send_failed.pop(req.request_id, None)
        if why is None:
            try:
                sent = streamed + self._send(req, (first, self.num_layers), last=True, meta=meta.to_dict())
            except TransferError as e:
                why = str(e)
        if why is not None:
            # the frontend releases the decode side's reservation when it sees this
            self._release(req.request_id)
            self.emit(Finished.failed(req.request_id, f"KV transfer failed: {why}"))
            return
        self.awaiting_release[req.request_id] = now
        self.emit(Prefilled(req.request_id, self.worker_id, now, sent, start_s))

    def _send(self, req: Request, layers: tuple[int, int], last: bool, meta: dict) -> int:
        peer, dst_blocks = self.handoff[req.request_id]
        src = self.engine.bm.block_table(req.request_id)
        n = -(-req.prompt_len // self.engine.bm.block_size)
        return self.kv_port.send(req.request_id, peer, src[:n], dst_blocks[:n], req.prompt_len, layers, last, meta)


class DecodeWorker(WorkerService):
    role = "decode"
    pool = "decode"
    prefix_caching = False
    receives_kv = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reserved: dict[str, Request] = {}                   # blocks held, KV not yet complete
        self.reserved_s: dict[str, float] = {}                   # id -> engine time of the reservation or its last layer
        self._handlers[Reserve] = lambda m: self._reserve(m.request.to_request())

    def _reserve(self, req: Request) -> None:
        bm = self.engine.bm
        # room for the prompt's KV and the first decoded token
        if bm.allocate(req, req.prompt_len + 1):
            self.reserved[req.request_id] = req
            self.reserved_s[req.request_id] = self.engine.clock.now()
            self.emit(Reserved(req.request_id, self.worker_id, list(bm.block_table(req.request_id)),
                               bm.num_free_blocks))
        else:
            self.emit(Rejected(req.request_id, self.worker_id, bm.num_free_blocks))

    def _release(self, request_id: str) -> None:
        """Drop a reservation whose KV will never come (or a finished request's blocks)."""
        self.reserved.pop(request_id, None)
        self.reserved_s.pop(request_id, None)
        super()._release(request_id)
        # an idle decode worker reports no iteration: without this the router would
        # keep waiting for blocks that are already free
        self.emit(FreeBlocks(self.worker_id, self.engine.bm.num_free_blocks))

    def _holds(self, request_id: str) -> bool:
        return request_id in self.reserved

    def expire_leases(self, now: float, lease_s: float) -> None:
        for rid in [r for r, since in self.reserved_s.items() if now - since > lease_s]:
            n = len(self.engine.bm.block_table(rid))
            self._release(rid)
            self.num_leases_expired += 1
            why = (f"no KV within transfer.lease_s={lease_s:g} s of its reservation: lease expired, "
                   f"freed its {n} blocks")
            print(f"worker {self.worker_id}: {rid}: {why}", file=sys.stderr)
            self.emit(Finished.failed(rid, why))     # a request whose KV was lost gets a status

    def renew_leases(self, request_ids: list[str], now: float) -> None:
        # a reservation whose prompt still waits for (or is in) its prefill
        for rid in request_ids:
            if rid in self.reserved_s:
                self.reserved_s[rid] = now

    def has_work(self) -> bool:
        return self.engine.has_work() or bool(self.reserved)

    def awaits_kv(self) -> bool:
        return bool(self.reserved)

    def _before_step(self) -> None:
        if self.kv_port is not None:
            self._admit_arrivals()

    def _admit_arrivals(self) -> None:
        for a in self.kv_port.poll():
            req = self.reserved.get(a.request_id)
            if req is None:          # aborted or cancelled while in flight
                continue
            if not a.ok:
                self._release(a.request_id)
                self.emit(Finished.failed(a.request_id, f"KV transfer failed: {a.error}"))
                continue
            if not a.last:
                self.reserved_s[a.request_id] = self.engine.clock.now()     # layer-wise: progress renews
                continue
            try:
                meta = hand_off_meta(a.meta)
            except ValueError as e:     # a peer's bug: fail the request, never the worker
                self._release(a.request_id)
                self.emit(Finished.failed(a.request_id, f"KV transfer failed: bad hand-off metadata ({e})"))
                continue
            del self.reserved[a.request_id]
            del self.reserved_s[a.request_id]
            req.output_token_ids.append(meta.first_token)
            req.token_times_s.append(meta.first_token_s)
            req.first_scheduled_s = meta.first_scheduled_s
            req.num_preemptions = meta.num_preemptions
            now = self.engine.clock.now()
            if req.is_finished_generating():
                req.status, req.finish_s = RequestStatus.FINISHED, now
                self.engine.release(req.request_id)
                self.emit(Finished.of(req))
            else:
                self.engine.add_prefilled(req)
            self.emit(KVReceived(req.request_id, self.worker_id, now))
