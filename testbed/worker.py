"""WorkerService: an engine with a role (colocated, prefill or decode) that
takes frontend commands and emits events (testbed/runtime/protocol.py).

The real runtime runs one per process and moves the messages over ZMQ; the
simulator calls the same methods in virtual-time order. Neither the engine nor
the scheduler knows which."""
from __future__ import annotations

from typing import Callable

from testbed.batch import Batch
from testbed.engine import Engine, StepOutput
from testbed.kv_transfer.base import TransferError
from testbed.request import Request, RequestStatus
from testbed.runtime.kv_port import KVPort
from testbed.runtime.protocol import failed, finished_msg, request_from_msg

ROLES = ("colocated", "prefill", "decode")
Emit = Callable[[dict], None]


class WorkerService:
    def __init__(self, worker_id: str, role: str, engine: Engine, emit: Emit,
                 kv_port: KVPort | None = None, layerwise: bool = False):
        if role not in ROLES:
            raise ValueError(f"worker role '{role}' is not one of {ROLES}")
        self.worker_id, self.role, self.engine, self.emit = worker_id, role, engine, emit
        self.kv_port, self.layerwise = kv_port, layerwise
        self.num_layers = getattr(engine.executor, "num_layers", 1)
        self.handoff: dict[str, tuple[str, list[int]]] = {}     # prefill: id -> (decode peer, its block ids)
        self.awaiting_release: set[str] = set()                  # prefill: KV sent, waiting for the ack
        # prefill, layer-wise: id -> (engine time its first layer left, bytes sent so far)
        self.streamed: dict[str, tuple[float, int]] = {}
        self.send_failed: dict[str, str] = {}                    # prefill, layer-wise: id -> why a layer did not go
        self.reserved: dict[str, Request] = {}                   # decode: blocks held, KV not yet complete
        self.stopping = False

    # -- commands ----------------------------------------------------------
    def handle(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == "add":
            self.engine.add_request(request_from_msg(msg["request"]))
        elif kind == "prefill":
            req = request_from_msg(msg["request"])
            self.handoff[req.request_id] = (msg["peer"], msg["dst_blocks"])
            self.engine.add_request(req)
        elif kind == "reserve":
            self._reserve(request_from_msg(msg["request"]))
        elif kind == "release":
            self._release(msg["id"])
        elif kind == "abort":
            self._abort(msg["id"])
        elif kind == "connect":
            self.kv_port.connect(msg["peer"], msg["address"])
        elif kind == "stop":
            self.stopping = True
        else:
            raise ValueError(f"unknown command type '{kind}'")

    def _reserve(self, req: Request) -> None:
        bm = self.engine.bm
        # room for the prompt's KV and the first decoded token
        if bm.allocate(req, req.prompt_len + 1):
            self.reserved[req.request_id] = req
            self.emit({"type": "reserved", "id": req.request_id, "worker": self.worker_id,
                       "blocks": list(bm.block_table(req.request_id)), "free_blocks": bm.num_free_blocks})
        else:
            self.emit({"type": "rejected", "id": req.request_id, "worker": self.worker_id,
                       "free_blocks": bm.num_free_blocks})

    def _release(self, request_id: str) -> None:
        """Prefill side: the decode side has the KV (or the request ended).
        Decode side: drop a reservation whose KV will never come."""
        self.awaiting_release.discard(request_id)
        self.reserved.pop(request_id, None)
        self.handoff.pop(request_id, None)
        self.streamed.pop(request_id, None)
        self.send_failed.pop(request_id, None)
        self.engine.release(request_id)
        if self.role == "decode":
            # an idle decode worker reports no iteration: without this the router would
            # keep waiting for blocks that are already free
            self.emit({"type": "free_blocks", "worker": self.worker_id,
                       "free_blocks": self.engine.bm.num_free_blocks})

    def _abort(self, request_id: str) -> None:
        req = self.engine.abort(request_id)
        held = request_id in self.reserved or request_id in self.awaiting_release
        self._release(request_id)
        if req is not None or held:
            self.emit(failed(request_id, "aborted by the client", RequestStatus.ABORTED))

    # -- the loop body -------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work() or bool(self.reserved)

    def step(self) -> StepOutput | None:
        if self.kv_port is not None and self.role == "decode":
            self._admit_arrivals()
        hook = self._send_layer if self.role == "prefill" and self.layerwise else None
        out = self.engine.step(hook)
        if out is None:
            return None
        now = out.end_s
        if out.new_tokens:
            self.emit({"type": "tokens", "worker": self.worker_id,
                       # the token's index: a request's tokens come from two workers in disagg
                       "items": [[r.request_id, tok, now, r.num_output_tokens - 1] for r, tok in out.new_tokens]})
        for req in out.finished:
            self.handoff.pop(req.request_id, None)
            self.streamed.pop(req.request_id, None)
            self.emit(finished_msg(req))
        for req in out.prefill_completed:
            self._hand_off(req, now, out.iteration.duration_s)
        for req in out.preempted:
            self.emit({"type": "preempted", "id": req.request_id})
        it = out.iteration
        self.emit({"type": "iteration", "worker": self.worker_id, "start_s": it.start_s,
                   "duration_s": it.duration_s, "num_prefill_tokens": it.num_prefill_tokens,
                   "num_decode_tokens": it.num_decode_tokens, "kv_bytes_read": it.kv_bytes_read,
                   "free_blocks": self.engine.bm.num_free_blocks})
        return out

    # -- prefill side ---------------------------------------------------------
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
        meta = {"first_token": req.output_token_ids[0], "first_token_s": now, "last_iteration_s": last_iteration_s,
                "first_scheduled_s": req.first_scheduled_s, "num_preemptions": req.num_preemptions}
        # layer-wise, the earlier layers left during the step: count them, and start the transfer there
        start_s, streamed = self.streamed.pop(req.request_id, (now, 0))
        why = self.send_failed.pop(req.request_id, None)
        if why is None:
            try:
                sent = streamed + self._send(req, (first, self.num_layers), last=True, meta=meta)
            except TransferError as e:
                why = str(e)
        if why is not None:
            # the frontend releases the decode side's reservation when it sees this
            self._release(req.request_id)
            self.emit(failed(req.request_id, f"KV transfer failed: {why}"))
            return
        self.awaiting_release.add(req.request_id)
        self.emit({"type": "prefilled", "id": req.request_id, "worker": self.worker_id, "t": now,
                   "kv_bytes": sent, "transfer_start_s": start_s})

    def _send(self, req: Request, layers: tuple[int, int], last: bool, meta: dict) -> int:
        peer, dst_blocks = self.handoff[req.request_id]
        src = self.engine.bm.block_table(req.request_id)
        n = -(-req.prompt_len // self.engine.bm.block_size)
        return self.kv_port.send(req.request_id, peer, src[:n], dst_blocks[:n], req.prompt_len, layers, last, meta)

    # -- decode side ----------------------------------------------------------
    def _admit_arrivals(self) -> None:
        for a in self.kv_port.poll():
            req = self.reserved.get(a.request_id)
            if req is None:          # aborted or cancelled while in flight
                continue
            if not a.ok:
                self._release(a.request_id)
                self.emit(failed(a.request_id, f"KV transfer failed: {a.error}"))
                continue
            if not a.last:
                continue
            del self.reserved[a.request_id]
            req.output_token_ids.append(a.meta["first_token"])
            req.token_times_s.append(a.meta["first_token_s"])
            req.first_scheduled_s = a.meta.get("first_scheduled_s")
            req.num_preemptions = a.meta.get("num_preemptions", 0)
            now = self.engine.clock.now()
            if req.is_finished_generating():
                req.status, req.finish_s = RequestStatus.FINISHED, now
                self.engine.release(req.request_id)
                self.emit(finished_msg(req))
            else:
                self.engine.add_prefilled(req)
            self.emit({"type": "kv_received", "id": req.request_id, "worker": self.worker_id, "t": now})

    def stats(self) -> dict:
        bm = self.engine.bm
        return {"type": "stats", "worker": self.worker_id, "role": self.role,
                "num_free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks, "all_free": bm.all_free(),
                "num_preemptions": self.engine.scheduler.num_preemptions}
