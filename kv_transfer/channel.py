"""ZMQ plumbing shared by the transports: the receiver's bound ROUTER socket
(`ChannelServer`), the sender's DEALER socket per peer (`ChannelClient`), and
what every sender built on them shares (`ChannelSender`: peers, acks).

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
from pathlib import Path

import msgpack
import zmq

from testbed.kv_transfer.base import Ack, KVSender, TransferError
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.curve import CurveKeys, client_keys, server_keys, stop_authenticator
from testbed.wire_text import shown

log = logging.getLogger(__name__)

# sender -> receiver messages: [HEADER, msgpack header, transport extras...], data chunks
# of the open payload as single-frame messages (a kind frame before each chunk costs ~15%
# of the loopback's throughput here), and [TRAILER, checksum] after them (zmq_transport.py)
HEADER = b"H"
# [TRAILER, 8 bytes]: the checksum of the payload whose data just ended, when its header had none
TRAILER = b"T"


def _name_bytes(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def _name_str(raw: bytes) -> str:
    # surrogateescape round-trips any routing id, even one a raw zmq peer made up
    return raw.decode("utf-8", "surrogateescape")


class ChannelServer:
    """One ROUTER bound to a random tcp port on cfg.host, or to a socket file
    in a private temporary directory (ipc). Beyond loopback it needs the run's
    CURVE keys (kv_transfer/curve.py), or refuses to bind."""

    def __init__(self, cfg: TransferConfig, curve: CurveKeys | dict | None = None) -> None:
        self.cfg = cfg
        self._ctx = zmq.Context(io_threads=1)
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # unroutable ack: an error, not a silent drop
        # zmq allocates each incoming frame whole: bound it before any header is read
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(cfg.max_message_bytes, cfg.max_header_bytes))
        if cfg.socket_buffer_bytes:
            self.sock.setsockopt(zmq.RCVBUF, cfg.socket_buffer_bytes)
        self._ipc_dir: Path | None = None
        self._auth = None
        if cfg.protocol == "tcp":
            try:
                self._auth = server_keys(self.sock, curve, cfg.host, "transfer.host")
            except Exception:      # refused: leave no socket for the context's term to wait on
                self.sock.close(linger=0)
                self._ctx.term()
                raise
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

    @staticmethod
    def origin(routing_id: bytes) -> str:
        return _name_str(routing_id)

    def send_ack(self, origin: str, request_id: str, ok: bool, reason: str) -> bool:
        msg = msgpack.packb({"request_id": request_id, "ok": ok, "reason": reason[:1000]})
        try:
            self.sock.send_multipart([_name_bytes(origin), msg], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:                       # EHOSTUNREACH: the sender is gone
            log.warning("ack for %s to %s not delivered: %s", shown(request_id), shown(origin), e)
            return False

    def close(self) -> None:
        if self._ctx.closed:
            return
        self.sock.close(linger=0)
        stop_authenticator(self._auth)
        self._ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


class ChannelClient:
    """A DEALER per peer, identified to the peer by `name`."""

    def __init__(self, name: str, cfg: TransferConfig, curve: CurveKeys | dict | None = None) -> None:
        self.name = name
        self.cfg = cfg
        self.curve = curve
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
        # no high-water mark: queued frames are zero-copy views of payloads the caller keeps until
        # flush(), so a send never blocks halfway through a payload
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_header_bytes)   # only acks come back
        if self.cfg.socket_buffer_bytes:
            sock.setsockopt(zmq.SNDBUF, self.cfg.socket_buffer_bytes)
        client_keys(sock, self.curve)
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
            log.warning("sender %s: dropped a malformed ack from %s: %s", self.name, peer, shown(str(e), 200))
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

    def __init__(self, cfg: TransferConfig, name: str | None = None, curve: CurveKeys | dict | None = None) -> None:
        self.cfg = cfg
        self.name = name or f"kv-sender-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._client = ChannelClient(self.name, cfg, curve)

    def connect(self, peer: str, address: str) -> None:
        self._client.connect(peer, address)

    def poll_acks(self, timeout_ms: int = 0) -> list[Ack]:
        return self._client.poll_acks(timeout_ms)

    def close(self) -> None:
        self._client.close()

