"""The zmq transport: a payload is a header message followed by data chunks
of about frame_bytes, each its own single-frame message, from the sender's
DEALER to the receiver's ROUTER.

The sender's chunks are zero-copy views of the payload's tensor, or of its
parts (pack.view_kv: the cache's own segments) (`copy=False`: the zmq I/O
thread reads that memory); a part ends a chunk, the receiver only counts bytes. The receiver copies each chunk
once, to its landing (kv_transfer/landing.py): with recv_into into one reused
contiguous buffer, or from the frame straight into the destination blocks of
the KV cache, and hashes it while the next is on the wire; zmq frees the chunk
at once, so the allocator hands the same memory to the next one. (Keeping the
frames instead, to save that copy, costs fresh page-faulting memory for every
payload: slower below ~100 MiB here.)

A header whose checksum is nil (pack.view_kv's payloads) is followed, after
the data, by a trailer message [TRAILER, xxh3_64 as 8 little-endian bytes]:
the sender hashes each chunk as it queues it, so the header and the first
bytes go at once (the receiver hashes as the chunks land, as ever).

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

import xxhash
import zmq

from testbed.kv_transfer.base import TransferError
from testbed.kv_transfer.channel import HEADER, TRAILER, ChannelSender
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.landing import Landing
from testbed.kv_transfer.payload import KVPayload
from testbed.kv_transfer.receiver import ChannelReceiver


class ZmqSender(ChannelSender):
    takes_parts = True           # each part goes as its own chunks: the receiver only counts bytes

    def __init__(self, cfg: TransferConfig, name: str | None = None, curve=None) -> None:
        super().__init__(cfg, name, curve)
        # a tracker per payload, on its last chunk: a socket's messages leave in order
        self._in_flight: collections.deque[zmq.MessageTracker] = collections.deque()

    def send(self, peer: str, payload: KVPayload) -> None:
        sock = self._client.socket(peer)
        chunks = [part[off:off + self.cfg.frame_bytes] for part in payload.byte_parts()
                  for off in range(0, len(part), self.cfg.frame_bytes)]
        if sum(len(c) for c in chunks) != payload.nbytes or not chunks:
            raise ValueError(f"request {payload.request_id}: payload has {sum(len(c) for c in chunks)} bytes of "
                             f"data, its header declares {payload.nbytes}")
        sock.send_multipart([HEADER, payload.encode_header()])
        # a payload without a checksum (view_kv's) is hashed a chunk at a time, each once
        # it is queued, while the I/O thread sends the ones before: the digest follows the data
        hasher = xxhash.xxh3_64() if payload.checksum is None else None
        for chunk in chunks[:-1]:
            sock.send(chunk, copy=False)
            if hasher is not None:
                hasher.update(chunk)
        self._in_flight.append(sock.send(chunks[-1], copy=False, track=True))
        if hasher is not None:
            hasher.update(chunks[-1])
            sock.send_multipart([TRAILER, hasher.intdigest().to_bytes(8, "little")])
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
    landing: Landing | None           # None: refused, its chunks are discarded
    hasher: xxhash.xxh3_64
    received: int = 0
    last_progress_s: float = 0.0


class ZmqReceiver(ChannelReceiver):
    def __init__(self, cfg: TransferConfig, max_payloads_per_poll: int = 64, curve=None) -> None:
        super().__init__(cfg, max_payloads_per_poll, curve)
        self._open_by_origin: dict[str, _Open] = {}

    def _on_header(self, origin: str, payload: KVPayload, landing: Landing | None) -> list[KVPayload]:
        self._open_by_origin[origin] = _Open(payload, landing, xxhash.xxh3_64(), last_progress_s=time.monotonic())
        return []

    def poll(self, timeout_ms: int = 0) -> list[KVPayload]:
        # a landing withdrawn since the last poll (its reservation dropped) takes no more bytes
        for o in self._open_by_origin.values():
            if o.landing is not None and not o.landing.valid():
                o.landing.release()
                o.landing = None
        return super().poll(timeout_ms)

    def _recv_body(self, origin: str) -> list[KVPayload]:
        o = self._open_by_origin.get(origin)
        if o is None:
            return super()._recv_body(origin)
        sock, nbytes = self._server.sock, o.payload.nbytes
        if o.received == nbytes:          # all the data is here; its checksum trailer is due
            return self._recv_trailer(origin, o)
        start = min(o.received, nbytes)
        view = o.landing.view(start) if o.landing is not None else None
        if view is not None:
            # recv_into truncates a frame that does not fit and returns its full size
            n = sock.recv_into(view)
            chunk = view[:n]
        else:
            chunk = sock.recv(copy=False).buffer
            n = len(chunk)
        if self._server.more():
            # not a chunk: the sender's next header (or junk), so this payload was cut short
            kind = bytes(chunk[:16])
            del self._open_by_origin[origin]
            cut = self._end(o, f"truncated: {o.received} of {nbytes} bytes arrived before the sender's next "
                            "payload")
            return [*cut, *self._on_control(origin, kind)]
        o.received += n
        if o.received > nbytes:
            del self._open_by_origin[origin]
            return self._end(o, f"more data than the {nbytes} bytes declared")
        o.last_progress_s = time.monotonic()
        if o.landing is not None:
            o.hasher.update(chunk)                    # while the chunk is still in cache
            if view is None:
                o.landing.write(start, chunk)
        if o.received < nbytes or o.payload.checksum is None:      # more data, or the trailer, to come
            return []
        del self._open_by_origin[origin]
        if o.landing is None:
            return []
        return [self._land(o.payload, o.landing, o.hasher.intdigest())]

    def _recv_trailer(self, origin: str, o: _Open) -> list[KVPayload]:
        """The message after o's last byte, which must be [TRAILER, checksum]."""
        del self._open_by_origin[origin]
        first = self._server.sock.recv(copy=False)
        if not self._server.more():
            return self._end(o, f"more data than the {o.payload.nbytes} bytes declared")
        kind = first.bytes
        if kind != TRAILER:
            cut = self._end(o, "no checksum trailer after its data (the sender's next message came instead)")
            return [*cut, *self._on_control(origin, kind)]
        digest = self._server.sock.recv()
        self._server.drain()
        if o.landing is None:
            return []
        if len(digest) != 8:
            return self._end(o, f"a checksum trailer of {len(digest)} bytes, not 8")
        o.payload.checksum = int.from_bytes(digest, "little")
        return [self._land(o.payload, o.landing, o.hasher.intdigest())]

    def _end(self, o: _Open, why: str) -> list[KVPayload]:
        """o ends short of its data: failed, or quietly gone when it was refused."""
        return [] if o.landing is None else [self._drop(o.payload, o.landing, why)]

    def _expire(self, now: float) -> list[KVPayload]:
        stalled = [origin for origin, o in self._open_by_origin.items()
                   if now - o.last_progress_s > self.cfg.timeout_s]
        return [p for o in (self._open_by_origin.pop(origin) for origin in stalled)
                for p in self._end(o, f"truncated: {o.received} of {o.payload.nbytes} bytes arrived, then "
                                   f"nothing for {self.cfg.timeout_s}s" +
                                   (" (no checksum trailer)" if o.received == o.payload.nbytes else ""))]

    def close(self) -> None:
        self._open_by_origin.clear()
        super().close()
