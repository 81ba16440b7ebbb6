"""KVPort over a real kv_transfer transport (zmq, torch_dist, shaped): the
prefill side sends a request's blocks out of its KV cache (zmq: the cache's
own segments, zero-copy, pack.view_kv; torch_dist: packed first); the
decode side's receiver writes each chunk straight into the reserved blocks as
it arrives (kv_transfer/landing.py), the request is admitted once the checksum
passed, and the sender is acknowledged. Nothing is taken for a request with
no reservation here, nor from a sender that is not one of the run's."""
from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass

import torch

from testbed.engine import Engine
from testbed.kv_transfer import PayloadError, TransferError, make_receiver, make_sender, pack_kv, unpack_kv, \
    view_kv
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.landing import BlockLanding
from testbed.kv_transfer.payload import KVPayload
from testbed.kv_transfer.torch_dist import TorchDistGroup
from testbed.kv_transfer.window import SendWindow
from testbed.launchers.base import WorkerSpec
from testbed.runtime.kv_port import KVArrival, KVPort


def uses_torch_dist(t: TransferConfig) -> bool:
    return (t.shaped_inner if t.transport == "shaped" else t.transport) == "torch_dist"


MAX_POOLED_BUFFERS = 8
log = logging.getLogger(__name__)


@dataclass
class _Send:
    """A send waiting for its peer's window: packed only when it goes."""
    request_id: str
    peer: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    num_tokens: int
    layers: tuple[int, int]
    last: bool
    meta: dict
    nbytes: int                     # on the wire


class RealKVPort(KVPort):
    """A sender that takes parts sends the held blocks themselves, which the
    prefill worker keeps until `Release`. Packing (torch_dist, GPU caches,
    scattered blocks) goes into reused staging buffers: fresh multi-MB allocations
    page-fault at a few GB/s here, slower than the link. A buffer is reused
    only once the receiver has acknowledged the request it carried (by then
    every byte has left); one never acknowledged is simply not reused.

    Bytes in flight to each peer are bounded by transfer.max_inflight_mb
    (kv_transfer/window.py): a send that does not fit waits in the peer's
    queue, its KV still in the (held) blocks, and is packed when acks free
    room, so a slow receiver costs the sender a bounded amount of memory and
    the other peers nothing."""

    def __init__(self, transfer: TransferConfig, spec: WorkerSpec, engine: Engine, sends: bool, receives: bool):
        self.cache = engine.executor.kv_cache
        self.bm = engine.bm
        self.num_layers = engine.executor.num_layers
        self.kv_bytes_per_token = engine.executor.kv_bytes_per_token
        self.group = None
        if uses_torch_dist(transfer):
            self.group = TorchDistGroup(spec.dist_addr, spec.rank, spec.world_size,
                                        transfer.dist_backend, transfer.timeout_s, bind_host=transfer.host)
        self.receiver = make_receiver(transfer, group=self.group, curve=spec.curve) if receives else None
        if self.receiver is not None:
            self.receiver.land_with(self._landing)
        self.sender = make_sender(transfer, name=spec.worker_id, group=self.group, curve=spec.curve) \
            if sends else None
        self._free_buffers: list[torch.Tensor] = []
        self._in_flight: OrderedDict[str, list[torch.Tensor]] = OrderedDict()   # request id -> its buffers
        self.window = SendWindow(int(transfer.max_inflight_mb * (1 << 20)))
        self._queued: defaultdict[str, deque[_Send]] = defaultdict(deque)      # peer -> sends waiting
        self.num_sends_waited = 0

    def _staging(self, request_id: str, nbytes: int) -> torch.Tensor:
        fits = [i for i, b in enumerate(self._free_buffers) if b.numel() >= nbytes]
        if fits:
            buf = self._free_buffers.pop(min(fits, key=lambda i: self._free_buffers[i].numel()))
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cache.is_cuda)
        self._in_flight.setdefault(request_id, []).append(buf)
        if len(self._in_flight) > 4 * MAX_POOLED_BUFFERS:      # never acknowledged: forget, never reuse
            self._in_flight.popitem(last=False)
        return buf

    @property
    def address(self) -> str:
        return self.receiver.address if self.receiver is not None else ""

    def wake_socket(self):
        return self.receiver.wake_socket() if self.receiver is not None else None

    def expect_senders(self, senders: list[str]) -> None:
        self.receiver.expect_senders(senders)

    def connect(self, peer: str, address: str) -> None:
        self.sender.connect(peer, address)

    def send(self, request_id, peer, src_block_ids, dst_block_ids, num_tokens, layers, last, meta) -> int:
        nbytes = (layers[1] - layers[0]) * 2 * len(src_block_ids) * self.cache[0, 0, 0].numel() \
            * self.cache.element_size()
        job = _Send(request_id, peer, list(src_block_ids), list(dst_block_ids), num_tokens, layers, last,
                    dict(meta), nbytes)
        if self.window.holds(request_id) or (not self._queued[peer] and
                                              self.window.admits(peer, request_id, nbytes)):
            self._start(job)
        else:
            self._queued[peer].append(job)
            self.num_sends_waited += 1
        # the logical KV of the prompt (the wire also carries the last block's padding)
        return num_tokens * self.kv_bytes_per_token * (layers[1] - layers[0]) // self.num_layers

    def _start(self, job: _Send) -> None:
        args = (self.cache, job.layers, job.src_block_ids, job.dst_block_ids, job.num_tokens, job.request_id)
        # zero-copy from the held blocks where the sender can (pack.view_kv), else gathered into staging
        payload = view_kv(*args, last=job.last, meta=job.meta) if self.sender.takes_parts else None
        if payload is None:
            payload = pack_kv(*args, last=job.last, meta=job.meta, out=self._staging(job.request_id, job.nbytes))
        try:
            self.sender.send(job.peer, payload)
        except (TransferError, RuntimeError) as e:
            # RuntimeError: gloo's, at once, for a peer whose process is gone. The worker fails
            # the request: a live peer's reservation would otherwise wait until timeout_s
            raise TransferError(f"KV of {job.request_id} to {job.peer}: {e}") from e
        self.window.sent(job.peer, job.request_id, job.nbytes)

    def _drain(self, peer: str) -> None:
        """Start the peer's waiting sends that its window now admits, in order."""
        queue = self._queued[peer]
        while queue and self.window.admits(peer, queue[0].request_id, queue[0].nbytes):
            job = queue.popleft()
            try:
                self._start(job)
            except TransferError as e:
                # its peer is gone: the frontend resolves the request (worker death, or the lease)
                log.warning("%s; its KV is dropped", e)
                self.cancel(job.request_id)

    def stats(self) -> dict[str, int]:
        return {"kv_peak_inflight_bytes": max(self.window.peak_bytes.values(), default=0),
                "kv_sends_waited": self.num_sends_waited,
                "kv_refused": self.receiver.num_refused if self.receiver is not None else 0}

    def cancel(self, request_id: str) -> None:
        """The request is released on this side: its waiting sends are dropped
        (before its blocks are freed) and its bytes leave the window."""
        for queue in self._queued.values():
            for job in [j for j in queue if j.request_id == request_id]:
                queue.remove(job)
        self.window.settle(request_id)

    def _reserved_for(self, p: KVPayload) -> bool:
        return self.bm.block_table(p.request_id)[:len(p.block_ids)] == list(p.block_ids)

    def _landing(self, p: KVPayload) -> BlockLanding | None:
        """Where a payload's bytes go: its reserved blocks. None (refused) when the
        reservation is gone (aborted, failed, never made): those blocks may hold
        another request's KV by now. Withdrawn if it goes while bytes arrive."""
        if not self._reserved_for(p):
            return None
        return BlockLanding(self.cache, p, valid=lambda: self._reserved_for(p))

    def poll(self) -> list[KVArrival]:
        out = []
        for p in self.receiver.poll(0):
            if p.error is not None:
                self.receiver.ack(p.origin, p.request_id, ok=False, reason=p.error)
                out.append(KVArrival(p.request_id, True, ok=False, error=p.error))
                continue
            if not p.in_place:
                try:
                    unpack_kv(self.cache, p)
                except PayloadError as e:      # the header does not fit this cache (a peer's bug)
                    self.receiver.ack(p.origin, p.request_id, ok=False, reason=str(e))
                    out.append(KVArrival(p.request_id, True, ok=False, error=str(e)))
                    continue
            if p.last:
                self.receiver.ack(p.origin, p.request_id, ok=True)
            out.append(KVArrival(p.request_id, p.last, num_bytes=p.nbytes, meta=p.meta))
        return out

    def pump(self, service) -> None:
        """Prefill side: drain acknowledgements, which free the staging buffers
        (the frontend's `release` is what frees the KV blocks)."""
        if self.sender is not None:
            for ack in self.sender.poll_acks(0):
                self.window.settle(ack.request_id)
                self._free_buffers.extend(self._in_flight.pop(ack.request_id, []))
            # the pool holds at most a window's worth (and always its largest buffer)
            self._free_buffers.sort(key=torch.Tensor.numel, reverse=True)
            kept, total = 0, 0
            for buf in self._free_buffers[:MAX_POOLED_BUFFERS]:
                if kept and total + buf.numel() > self.window.max_bytes:
                    break
                kept, total = kept + 1, total + buf.numel()
            del self._free_buffers[kept:]
            for peer in [p for p, q in self._queued.items() if q]:
                self._drain(peer)

    def close(self) -> None:
        for t in (self.sender, self.receiver):
            if t is not None:
                t.close()
        if self.group is not None:
            self.group.close()
