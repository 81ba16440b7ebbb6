"""The zmq transport: a payload is one multipart message, [header, data
frames...], from the sender's DEALER to the receiver's ROUTER.

Data frames are zero-copy views of the payload's tensor (`copy=False`: the
zmq I/O thread reads the tensor's memory), cut at frame_bytes because 1-4 MiB
frames move ~3x faster than one large message here. The receiver copies each
frame with recv_into straight into one reused contiguous buffer, so beyond
the kernel's socket copies the data is copied once on each side: pack_kv's
gather and the receive.
"""
from __future__ import annotations

import collections
import time

import torch
import zmq

from testbed.kv_transfer.base import TransferError
from testbed.kv_transfer.channel import ChannelReceiver, ChannelSender
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.payload import KVPayload, byte_view


class ZmqSender(ChannelSender):
    def __init__(self, cfg: TransferConfig, name: str | None = None) -> None:
        super().__init__(cfg, name)
        # a tracker per payload, on its last frame: a socket's frames leave in order
        self._in_flight: collections.deque[zmq.MessageTracker] = collections.deque()

    def send(self, peer: str, payload: KVPayload) -> None:
        sock = self._client.socket(peer)
        data = byte_view(payload.data)
        if len(data) == 0:
            raise ValueError(f"request {payload.request_id}: payload has no data to send")
        step = self.cfg.frame_bytes
        try:
            sock.send(payload.encode_header(), zmq.SNDMORE)
            for off in range(0, len(data), step):
                if off + step < len(data):
                    sock.send(data[off:off + step], zmq.SNDMORE, copy=False)
                else:
                    self._in_flight.append(sock.send(data[off:], 0, copy=False, track=True))
        except zmq.Again:
            raise TransferError(f"send of {payload.request_id} to {peer} timed out after "
                                f"{self.cfg.timeout_s}s: the receiver is not reading") from None
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


class ZmqReceiver(ChannelReceiver):
    def _receive_data(self, payload: KVPayload, into: torch.Tensor) -> str | None:
        view = memoryview(into.numpy())
        received = 0
        while self._server.more():
            # recv_into truncates a frame that does not fit and returns its full size
            received += self._server.sock.recv_into(view[min(received, len(view)):])
            if received > len(view):
                self._server.drain()
                return f"more data than the {len(view)} bytes declared"
        if received < len(view):
            return f"truncated: {received} of {len(view)} bytes arrived"
        return None
