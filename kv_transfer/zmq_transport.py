"""The zmq transport: a payload is a header message followed by data messages
of about frame_bytes each, from the sender's DEALER to the receiver's ROUTER.

Both ends are zero-copy. The sender's frames are views of the payload's
tensor (`copy=False`: the zmq I/O thread reads the tensor's memory), cut at
block boundaries; the receiver keeps the frames zmq received into and hashes
each as it arrives; unpack_kv copies them straight into the KV cache. So the
bytes are copied once in user space on each side (pack_kv's gather, the
unpack) beyond the kernel's socket copies; a staging buffer between frames
and cache would cost another copy, ~40% of the loopback's speed here.

Each chunk is its own message, not one frame of a multipart message: zmq
delivers a multipart message only once all of it has arrived, holding the
whole payload in freshly allocated (page-faulting) memory, and nothing can be
hashed until the last byte is in. As separate messages, a few chunks' memory
is recycled by the allocator and hashing overlaps the transfer.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time

import torch
import xxhash
import zmq

from testbed.kv_transfer.base import TransferError
from testbed.kv_transfer.channel import HEADER, ChannelSender
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.payload import DTYPES, KVPayload, byte_view
from testbed.kv_transfer.receiver import ChannelReceiver


class ZmqSender(ChannelSender):
    def __init__(self, cfg: TransferConfig, name: str | None = None) -> None:
        super().__init__(cfg, name)
        # a tracker per payload, on its last chunk: a socket's messages leave in order
        self._in_flight: collections.deque[zmq.MessageTracker] = collections.deque()

    def send(self, peer: str, payload: KVPayload) -> None:
        sock = self._client.socket(peer)
        data = byte_view(payload.data)
        if len(data) == 0:
            raise ValueError(f"request {payload.request_id}: payload has no data to send")
        # whole blocks per frame, so the receiver can copy every frame straight into its blocks
        block_bytes = math.prod(payload.shape[3:]) * DTYPES[payload.dtype].itemsize
        step = max(1, self.cfg.frame_bytes // block_bytes) * block_bytes
        sock.send_multipart([HEADER, payload.encode_header()])
        for off in range(0, len(data), step):
            tracker = sock.send(data[off:off + step], copy=False, track=off + step >= len(data))
        self._in_flight.append(tracker)
        while self._in_flight and self._in_flight[0].done:
            self._in_flight.popleft()

    def flush(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.cfg.timeout_s if timeout_s is None else timeout_s)
        while self._in_flight:
            try:
                self._in_flight[0].wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                raise TransferError(f"sender {self.name}: {len(self._in_flight)} payloads still queued "
                                    "at the flush deadline") from None
            self._in_flight.popleft()

    def close(self) -> None:
        self._in_flight.clear()
        super().close()


@dataclasses.dataclass
class _Open:
    """A payload whose header has arrived and whose data is coming in."""
    payload: KVPayload
    hasher: xxhash.xxh3_64
    pieces: list[torch.Tensor] = dataclasses.field(default_factory=list)
    received: int = 0
    last_progress_s: float = 0.0


class ZmqReceiver(ChannelReceiver):
    def __init__(self, cfg: TransferConfig, max_payloads_per_poll: int = 64) -> None:
        super().__init__(cfg, max_payloads_per_poll)
        self._open_by_origin: dict[str, _Open] = {}

    def _on_header(self, origin: str, payload: KVPayload) -> list[KVPayload]:
        done = []
        prev = self._open_by_origin.pop(origin, None)
        if prev is not None:
            done.append(self._fail(prev.payload, f"truncated: {prev.received} of {prev.payload.nbytes} bytes "
                                   "arrived before the sender's next payload"))
        self._open_by_origin[origin] = _Open(payload, xxhash.xxh3_64(), last_progress_s=time.monotonic())
        return done

    def _on_data(self, origin: str, frame: zmq.Frame) -> list[KVPayload]:
        o = self._open_by_origin.get(origin)
        if o is None:
            self._reject(origin, "data without an open payload")
            return []
        # (zmq capped the frame's size at MAXMSGSIZE before allocating it)
        o.received += len(frame.buffer)
        if o.received > o.payload.nbytes:
            del self._open_by_origin[origin]
            return [self._fail(o.payload, f"more data than the {o.payload.nbytes} bytes declared")]
        o.hasher.update(frame.buffer)                # while it is still in cache
        o.pieces.append(torch.frombuffer(frame.buffer, dtype=torch.uint8))   # keeps the frame alive
        o.last_progress_s = time.monotonic()
        if o.received < o.payload.nbytes:
            return []
        del self._open_by_origin[origin]
        o.payload.data = o.pieces
        return [self._finish(o.payload, o.hasher.intdigest())]

    def _expire(self, now: float) -> list[KVPayload]:
        stalled = [origin for origin, o in self._open_by_origin.items()
                   if now - o.last_progress_s > self.cfg.timeout_s]
        return [self._fail(o.payload, f"truncated: {o.received} of {o.payload.nbytes} bytes arrived, then "
                           f"nothing for {self.cfg.timeout_s}s")
                for o in (self._open_by_origin.pop(origin) for origin in stalled)]
