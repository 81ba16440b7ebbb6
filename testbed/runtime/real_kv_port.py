"""KVPort over a real kv_transfer transport (zmq, torch_dist, shaped): the
prefill side packs a request's blocks out of its KV cache and sends them; the
decode side writes verified arrivals straight into the reserved blocks and
acknowledges them to the sender. The receiver writes each chunk straight
into the reserved blocks as it arrives (kv_transfer/landing.py), and takes
nothing for a request with no reservation here."""
from __future__ import annotations

from collections import OrderedDict

import torch

from testbed.engine import Engine
from testbed.kv_transfer import PayloadError, TransferError, make_receiver, make_sender, pack_kv, unpack_kv
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.landing import BlockLanding
from testbed.kv_transfer.payload import KVPayload
from testbed.kv_transfer.torch_dist import TorchDistGroup
from testbed.launchers.base import WorkerSpec
from testbed.runtime.kv_port import KVArrival, KVPort


def uses_torch_dist(t: TransferConfig) -> bool:
    return (t.shaped_inner if t.transport == "shaped" else t.transport) == "torch_dist"


MAX_POOLED_BUFFERS = 8


class RealKVPort(KVPort):
    """Packing goes into reused staging buffers: fresh multi-MB allocations
    page-fault at a few GB/s here, slower than the link. A buffer is reused
    only once the receiver has acknowledged the request it carried (by then
    every byte has left); one never acknowledged is simply not reused."""

    def __init__(self, transfer: TransferConfig, spec: WorkerSpec, engine: Engine, sends: bool, receives: bool):
        self.cache = engine.executor.kv_cache
        self.bm = engine.bm
        self.num_layers = engine.executor.num_layers
        self.kv_bytes_per_token = engine.executor.kv_bytes_per_token
        self.group = None
        if uses_torch_dist(transfer):
            self.group = TorchDistGroup(spec.dist_addr, spec.rank, spec.world_size,
                                        transfer.dist_backend, transfer.timeout_s)
        self.receiver = make_receiver(transfer, group=self.group, curve=spec.curve) if receives else None
        if self.receiver is not None:
            self.receiver.land_with(self._landing)
        self.sender = make_sender(transfer, name=spec.worker_id, group=self.group, curve=spec.curve) \
            if sends else None
        self._free_buffers: list[torch.Tensor] = []
        self._in_flight: OrderedDict[str, list[torch.Tensor]] = OrderedDict()   # request id -> its buffers

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

    def connect(self, peer: str, address: str) -> None:
        self.sender.connect(peer, address)

    def send(self, request_id, peer, src_block_ids, dst_block_ids, num_tokens, layers, last, meta) -> int:
        nbytes = (layers[1] - layers[0]) * 2 * len(src_block_ids) * self.cache[0, 0, 0].numel() \
            * self.cache.element_size()
        payload = pack_kv(self.cache, layers, src_block_ids, dst_block_ids, num_tokens, request_id,
                          last=last, meta=meta, out=self._staging(request_id, nbytes))
        try:
            self.sender.send(peer, payload)
        except (TransferError, RuntimeError) as e:
            # RuntimeError: gloo's, at once, for a peer whose process is gone. The worker fails
            # the request: a live peer's reservation would otherwise wait until timeout_s
            raise TransferError(f"KV of {request_id} to {peer}: {e}") from e
        # the logical KV of the prompt (the wire also carries the last block's padding)
        return num_tokens * self.kv_bytes_per_token * (layers[1] - layers[0]) // self.num_layers

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
                self._free_buffers.extend(self._in_flight.pop(ack.request_id, []))
            del self._free_buffers[MAX_POOLED_BUFFERS:]

    def close(self) -> None:
        for t in (self.sender, self.receiver):
            if t is not None:
                t.close()
        if self.group is not None:
            self.group.close()
