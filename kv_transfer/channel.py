"""ZMQ plumbing shared by the transports: the receiver's bound ROUTER socket
(`ChannelServer`) and the sender's DEALER socket per peer (`ChannelClient`),
and the sender/receiver halves every transport built on them shares
(`ChannelSender`, `ChannelReceiver`: peers, acks, the receive loop).

The zmq transport sends header and data frames over it; torch_dist sends only
headers (the data goes over the process group). Acks come back over the same
connection: the ROUTER addresses a sender by its routing id, which is the
sender's name. Each side owns its zmq.Context, so close() joins its I/O
thread; LINGER 0 means close never waits for a dead peer.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from abc import abstractmethod
from pathlib import Path

import msgpack
import torch
import zmq

from testbed.kv_transfer.base import Ack, KVReceiver, KVSender, TransferError
from testbed.kv_transfer.buffers import ReceiveBuffers
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.payload import DTYPES, KVPayload, PayloadError, decode_header

log = logging.getLogger(__name__)


def _name_bytes(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def _name_str(raw: bytes) -> str:
    # surrogateescape round-trips any routing id, even one a raw zmq peer made up
    return raw.decode("utf-8", "surrogateescape")


class ChannelServer:
    """One ROUTER bound to a random tcp port on cfg.host, or to a socket file
    in a private temporary directory (ipc)."""

    def __init__(self, cfg: TransferConfig) -> None:
        self.cfg = cfg
        self._ctx = zmq.Context(io_threads=1)
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # unroutable ack: an error, not a silent drop
        # zmq allocates each incoming frame whole: bound it before any header is read
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(cfg.max_message_bytes, cfg.max_header_bytes))
        self._ipc_dir: Path | None = None
        if cfg.protocol == "tcp":
            port = self.sock.bind_to_random_port(f"tcp://{cfg.host}")
            self.address = f"tcp://{cfg.host}:{port}"
        else:
            self._ipc_dir = Path(tempfile.mkdtemp(prefix="kvt-"))
            self.address = f"ipc://{self._ipc_dir / 'kv.sock'}"
            self.sock.bind(self.address)

    def wait(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def more(self) -> bool:
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def drain(self) -> None:
        """Discard the rest of the current multipart message."""
        while self.more():
            self.sock.recv(copy=False)

    def recv_envelope(self) -> tuple[str, zmq.Frame] | None:
        """(origin, header frame) of the next message; None (and the message
        discarded) when it has no header."""
        origin = self.sock.recv()
        if not self.more():
            return None
        return _name_str(origin), self.sock.recv(copy=False)

    def send_ack(self, origin: str, request_id: str, ok: bool, reason: str) -> bool:
        msg = msgpack.packb({"request_id": request_id, "ok": ok, "reason": reason[:1000]})
        try:
            self.sock.send_multipart([_name_bytes(origin), msg], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:                       # EHOSTUNREACH: the sender is gone
            log.warning("ack for %s to %s not delivered: %s", request_id, origin, e)
            return False

    def close(self) -> None:
        if self._ctx.closed:
            return
        self.sock.close(linger=0)
        self._ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


class ChannelClient:
    """A DEALER per peer, identified to the peer by `name`."""

    def __init__(self, name: str, cfg: TransferConfig) -> None:
        self.name = name
        self.cfg = cfg
        self._ctx = zmq.Context(io_threads=1)
        self._socks: dict[str, zmq.Socket] = {}
        self._addresses: dict[str, str] = {}
        self._poller = zmq.Poller()

    def connect(self, peer: str, address: str) -> None:
        if self._addresses.get(peer) == address:
            return
        if peer in self._socks:
            self._poller.unregister(self._socks[peer])
            self._socks.pop(peer).close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, _name_bytes(self.name))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(self.cfg.timeout_s * 1000))
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_header_bytes)   # only acks come back
        sock.connect(address)
        self._socks[peer] = sock
        self._addresses[peer] = address
        self._poller.register(sock, zmq.POLLIN)

    def socket(self, peer: str) -> zmq.Socket:
        if self._ctx.closed:
            raise TransferError(f"sender {self.name} is closed")
        try:
            return self._socks[peer]
        except KeyError:
            raise TransferError(f"sender {self.name}: no peer '{peer}'; connect(peer, address) first "
                                f"(known: {sorted(self._socks)})") from None

    def poll_acks(self, timeout_ms: int) -> list[Ack]:
        acks: list[Ack] = []
        peers = {sock: peer for peer, sock in self._socks.items()}
        for sock, _ in self._poller.poll(timeout_ms):
            while sock.poll(0, zmq.POLLIN):
                ack = self._decode_ack(peers[sock], sock.recv_multipart())
                if ack is not None:
                    acks.append(ack)
        return acks

    def _decode_ack(self, peer: str, frames: list[bytes]) -> Ack | None:
        try:
            (raw,) = frames
            m = msgpack.unpackb(raw, raw=False)
            ack = Ack(peer=peer, request_id=m["request_id"], ok=m["ok"], reason=m["reason"])
            if not (isinstance(ack.request_id, str) and isinstance(ack.ok, bool) and isinstance(ack.reason, str)):
                raise TypeError(f"field types {m}")
            return ack
        except Exception as e:    # a malformed ack is the peer's bug; keep serving the others
            log.warning("sender %s: dropped a malformed ack from %s: %s", self.name, peer, e)
            return None

    def close(self) -> None:
        if self._ctx.closed:
            return
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        self._ctx.term()


class ChannelSender(KVSender):
    """What every channel-based sender shares: peers, acks, close."""

    def __init__(self, cfg: TransferConfig, name: str | None = None) -> None:
        self.cfg = cfg
        self.name = name or f"kv-sender-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._client = ChannelClient(self.name, cfg)

    def connect(self, peer: str, address: str) -> None:
        self._client.connect(peer, address)

    def poll_acks(self, timeout_ms: int = 0) -> list[Ack]:
        return self._client.poll_acks(timeout_ms)

    def close(self) -> None:
        self._client.close()


class ChannelReceiver(KVReceiver):
    """The receive loop of every channel-based transport: a header arrives on
    the ROUTER, is checked and sized, the subclass lands the data in a reused
    buffer, the checksum decides. Whatever a peer sends, poll() does not raise:
    a bad message becomes a payload with `error` (or, when it does not even
    name a request, is counted in num_rejected and logged)."""

    def __init__(self, cfg: TransferConfig, max_payloads_per_poll: int = 64) -> None:
        self.cfg = cfg
        self.max_payloads_per_poll = max_payloads_per_poll
        self._server = ChannelServer(cfg)
        self._buffers = ReceiveBuffers(pin_memory=cfg.pin_memory)
        self.address = self._server.address
        self.num_rejected = 0

    @abstractmethod
    def _receive_data(self, payload: KVPayload, into: torch.Tensor) -> str | None:
        """Fill `into` (flat uint8, payload.nbytes long) with the data of the
        message whose header was just read, consuming the rest of that message;
        return why it failed, or None."""

    def poll(self, timeout_ms: int = 0) -> list[KVPayload]:
        self._buffers.reclaim()
        arrived: list[KVPayload] = []
        if not self._server.wait(timeout_ms):
            return arrived
        # a multipart message is delivered whole, so once its first frame is here none of this blocks
        while len(arrived) < self.max_payloads_per_poll and self._server.wait(0):
            payload = self._recv_one()
            if payload is not None:
                arrived.append(payload)
        return arrived

    def _recv_one(self) -> KVPayload | None:
        envelope = self._server.recv_envelope()
        if envelope is None:
            self.num_rejected += 1
            return None
        origin, header = envelope
        try:
            p = decode_header(header.buffer, self.cfg.max_header_bytes, self.cfg.max_message_bytes)
        except PayloadError as e:
            self._server.drain()
            log.warning("receiver %s: rejected a message from %s: %s", self.address, origin, e)
            if e.request_id is None:
                self.num_rejected += 1
                return None
            return KVPayload.failed_header(e.request_id, origin, str(e))
        p.origin = origin
        flat = self._buffers.take(p.nbytes)[:p.nbytes]
        error = self._receive_data(p, flat)
        if error is not None:
            return p.failed(f"request {p.request_id}: {error}")
        p.data = flat.view(DTYPES[p.dtype]).view(p.shape)
        try:
            p.verify()
        except PayloadError as e:
            return p.failed(str(e))
        return p

    def ack(self, origin: str, request_id: str, ok: bool = True, reason: str = "") -> bool:
        return self._server.send_ack(origin, request_id, ok, reason)

    def close(self) -> None:
        self._server.close()
