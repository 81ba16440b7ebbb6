"""ChannelReceiver: the receive loop of the channel-based transports.

Messages on the ROUTER are [sender, HEADER, header, ...] or [sender, chunk]:
a header is checked and sized and a landing chosen for it (kv_transfer/
landing.py: a reused buffer, or, when the owner set `land_with`, straight
into the destination blocks), then the transport brings the data there (zmq:
the chunk messages that follow on the same connection; torch_dist: one
process-group recv) and the checksum decides. A sender's messages arrive in
order; different senders' interleave, so each sender has at most one payload
open.

Refused, counted in num_refused and logged once each: a header from a sender
the owner did not name in `expect_senders` (the run's KV senders; on the
wire, the ZMQ routing id each sender's DEALER sets, which CURVE authenticates
beyond loopback), and one for a request the owner has no reservation for
(its land_with returned None). A refused payload's chunks are read and
discarded; the sender's is told (ok=False) so it frees its buffers, a
stranger is not answered.

Whatever a peer sends, poll() does not raise: a bad message becomes a payload
with `error` (or, when it does not even name a request, is logged and counted
in num_rejected); a payload whose data stops coming fails after timeout_s.
The sender's name and request ids are the peer's own bytes: logs and errors
show them through wire_text.shown (hex when not printable text).
"""
from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable

import zmq

from testbed.kv_transfer.base import KVReceiver
from testbed.kv_transfer.buffers import ReceiveBuffers
from testbed.kv_transfer.channel import HEADER, TRAILER, ChannelServer
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.landing import BufferLanding, Landing
from testbed.kv_transfer.payload import KVPayload, PayloadError, decode_header
from testbed.wire_text import shown

log = logging.getLogger(__name__)


class ChannelReceiver(KVReceiver):
    def __init__(self, cfg: TransferConfig, max_payloads_per_poll: int = 64, curve=None) -> None:
        self.cfg = cfg
        self.max_payloads_per_poll = max_payloads_per_poll
        self._server = ChannelServer(cfg, curve)      # curve: the run's CURVE keys (kv_transfer/curve.py)
        self._buffers = ReceiveBuffers(pin_memory=cfg.pin_memory)
        self._returned: list[Landing] = []          # landings of the payloads the last poll returned
        self._land_with: Callable[[KVPayload], Landing | None] | None = None
        self._senders: frozenset[str] | None = None   # None: any sender (until expect_senders)
        self.address = self._server.address
        self.num_rejected = 0          # malformed messages
        self.num_refused = 0           # well-formed payloads from a stranger, or with no reservation

    def land_with(self, fn: Callable[[KVPayload], Landing | None]) -> None:
        """fn(header) says where a payload's bytes go: a Landing, or None to
        refuse it (no reservation); it may raise PayloadError (fails it)."""
        self._land_with = fn

    def expect_senders(self, names: Iterable[str]) -> None:
        """Take payloads only from senders with these names (KVSender.name)."""
        self._senders = frozenset(names)

    def wake_socket(self):
        # every message comes on the channel first; gloo's data is taken inside
        # poll(), behind its header, so nothing arrives that this socket misses
        return self._server.sock

    @abstractmethod
    def _on_header(self, origin: str, payload: KVPayload, landing: Landing | None) -> list[KVPayload]:
        """A header from `origin` passed every check; the rest of its message
        is unread; its bytes go to `landing` (None: refused, discard them).
        Returns payloads now finished."""

    def _on_data(self, origin: str, chunk: zmq.Frame) -> list[KVPayload]:
        """A data chunk from `origin` that no open payload took."""
        self._reject(origin, "a data chunk with no payload open")
        return []

    def _expire(self, now: float) -> list[KVPayload]:
        """Fail open payloads whose data stopped coming."""
        return []

    def poll(self, timeout_ms: int = 0) -> list[KVPayload]:
        for landing in self._returned:
            landing.release()
        self._returned = []
        arrived = self._expire(time.monotonic())
        deadline = time.monotonic() + timeout_ms / 1000
        while len(arrived) < self.max_payloads_per_poll:
            if not self._server.wait(0):
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if arrived or remaining_ms <= 0 or not self._server.wait(remaining_ms):
                    break
            origin = self._server.origin(self._server.sock.recv())
            if self._server.more():
                arrived += self._recv_body(origin)
            else:
                self._reject(origin, "an empty message")
        return arrived

    def _recv_body(self, origin: str) -> list[KVPayload]:
        """The rest of a message from `origin`: a header message or a chunk."""
        first = self._server.sock.recv(copy=False)
        if not self._server.more():
            return self._on_data(origin, first)
        return self._on_control(origin, first.bytes)

    def _on_control(self, origin: str, kind: bytes) -> list[KVPayload]:
        """A multipart message whose first frame, `kind`, has been read."""
        try:
            if kind == HEADER:
                return self._decode_header(origin, self._server.sock.recv(copy=False))
            if kind == TRAILER:
                self._reject(origin, "a checksum trailer with no payload awaiting one")
                return []
            self._reject(origin, f"a message of unknown kind {shown(kind[:16])}")
            return []
        finally:
            self._server.drain()

    def _decode_header(self, origin: str, header: zmq.Frame) -> list[KVPayload]:
        stranger = self._senders is not None and origin not in self._senders
        try:
            p = decode_header(header.buffer, self.cfg.max_header_bytes, self.cfg.max_message_bytes)
            p.origin = origin
            landing = None if stranger else self._landing(p)
        except PayloadError as e:
            if e.request_id is None or stranger:
                self._reject(origin, str(e))
                return []
            log.warning("receiver %s: failed a payload from %s: %s", self.address, shown(origin), e)
            return [KVPayload.failed_header(e.request_id, origin, str(e))]
        if stranger:       # its data is read and discarded
            self._refuse(origin, f"a payload for {shown(p.request_id)} from a sender that is not one of the run's")
        elif landing is None:
            self._refuse(origin, f"a payload for {shown(p.request_id)}, which has no reservation here")
            self.ack(origin, p.request_id, ok=False, reason="no reservation for it at this receiver")
        return self._on_header(origin, p, landing)

    def _landing(self, p: KVPayload) -> Landing | None:
        if self._land_with is None:
            return BufferLanding(self._buffers, p.nbytes)
        return self._land_with(p)

    def _land(self, p: KVPayload, landing: Landing, digest: int) -> KVPayload:
        """All of p's data is in `landing`, whose xxh3 is `digest`: the checksum decides."""
        try:
            p.check_checksum(digest)
        except PayloadError as e:
            return self._drop(p, landing, str(e).removeprefix(f"request {shown(p.request_id)}: "))
        landing.finish(p)
        self._returned.append(landing)
        return p

    def _drop(self, p: KVPayload, landing: Landing, why: str) -> KVPayload:
        """p failed; what its landing borrowed goes back."""
        landing.release()
        log.warning("receiver %s: failed %s from %s: %s", self.address, shown(p.request_id), shown(p.origin),
                    why)
        return p.failed(f"request {shown(p.request_id)}: {why}")

    def _refuse(self, origin: str, why: str) -> None:
        self.num_refused += 1
        log.warning("receiver %s: refused %s (sender %s)", self.address, why, shown(origin))

    def _reject(self, origin: str, why: str) -> None:
        self.num_rejected += 1
        log.warning("receiver %s: dropped a message from %s: %s", self.address, shown(origin), why)

    def ack(self, origin: str, request_id: str, ok: bool = True, reason: str = "") -> bool:
        return self._server.send_ack(origin, request_id, ok, reason)

    def close(self) -> None:
        self._server.close()
