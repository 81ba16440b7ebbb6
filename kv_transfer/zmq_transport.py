"""The zmq transport: a payload is a header message followed by data chunks
of about frame_bytes, each its own single-frame message, from the sender's
DEALER to the receiver's ROUTER.

The sender's chunks are zero-copy views of the payload's tensor (`copy=False`:
the zmq I/O thread reads the tensor's memory). The receiver copies each chunk
with recv_into straight into the payload's one reused contiguous buffer and
hashes it while the next is on the wire; zmq frees the chunk at once, so the
allocator hands the same memory to the next one. (Keeping the frames instead,
to save that copy, costs fresh page-faulting memory for every payload: slower
below ~100 MiB here.)

Chunks are separate messages rather than frames of one multipart message
because zmq delivers a multipart message only when all of it has arrived:
nothing could be copied or hashed before the last byte, and zmq would hold the
whole payload in fresh memory. A kind frame before every chunk would cost ~15%
of the loopback's throughput, so a single-frame message is a chunk and a
header message is [HEADER, header].
"""
from __future__ import annotations

import collections
import dataclasses
import time

import torch
import xxhash
import zmq

from testbed.kv_transfer.base import TransferError
from testbed.kv_transfer.channel import HEADER, ChannelSender
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.payload import KVPayload, byte_view
from testbed.kv_transfer.receiver import ChannelReceiver


class ZmqSender(ChannelSender):
    def __init__(self, cfg: TransferConfig, name: str | None = None, curve=None) -> None:
        super().__init__(cfg, name, curve)
        # a tracker per payload, on its last chunk: a socket's messages leave in order
        self._in_flight: collections.deque[zmq.MessageTracker] = collections.deque()

    def send(self, peer: str, payload: KVPayload) -> None:
        sock = self._client.socket(peer)
        data = byte_view(payload.data)
        if len(data) == 0:
            raise ValueError(f"request {payload.request_id}: payload has no data to send")
        step = self.cfg.frame_bytes
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
    buf: torch.Tensor                 # flat uint8, payload.nbytes long, from the pool
    view: memoryview
    hasher: xxhash.xxh3_64
    received: int = 0
    last_progress_s: float = 0.0


class ZmqReceiver(ChannelReceiver):
    def __init__(self, cfg: TransferConfig, max_payloads_per_poll: int = 64, curve=None) -> None:
        super().__init__(cfg, max_payloads_per_poll, curve)
        self._open_by_origin: dict[str, _Open] = {}

    def _on_header(self, origin: str, payload: KVPayload) -> list[KVPayload]:
        buf = self._buffers.take(payload.nbytes)
        self._open_by_origin[origin] = _Open(payload, buf, memoryview(buf.numpy()), xxhash.xxh3_64(),
                                             last_progress_s=time.monotonic())
        return []

    def _recv_body(self, origin: str) -> list[KVPayload]:
        o = self._open_by_origin.get(origin)
        if o is None:
            return super()._recv_body(origin)
        start = min(o.received, len(o.view))
        # recv_into truncates a frame that does not fit and returns its full size
        n = self._server.sock.recv_into(o.view[start:])
        if self._server.more():
            # not a chunk: the sender's next header (or junk), so this payload was cut short
            kind = bytes(o.view[start:start + n]) if start + n <= len(o.view) else b""
            del self._open_by_origin[origin]
            cut = self._drop(o.payload, o.buf, f"truncated: {o.received} of {len(o.view)} bytes arrived "
                             "before the sender's next payload")
            return [cut, *self._on_control(origin, kind)]
        o.received += n
        if o.received > len(o.view):
            del self._open_by_origin[origin]
            return [self._drop(o.payload, o.buf, f"more data than the {len(o.view)} bytes declared")]
        o.hasher.update(o.view[start:o.received])      # while the chunk is still in cache
        o.last_progress_s = time.monotonic()
        if o.received < len(o.view):
            return []
        del self._open_by_origin[origin]
        return [self._land(o.payload, o.buf, o.hasher.intdigest())]

    def _expire(self, now: float) -> list[KVPayload]:
        stalled = [origin for origin, o in self._open_by_origin.items()
                   if now - o.last_progress_s > self.cfg.timeout_s]
        return [self._drop(o.payload, o.buf, f"truncated: {o.received} of {len(o.view)} bytes arrived, then "
                           f"nothing for {self.cfg.timeout_s}s")
                for o in (self._open_by_origin.pop(origin) for origin in stalled)]

    def close(self) -> None:
        self._open_by_origin.clear()
        super().close()
