"""The KV store service of `mode=kvstore`: a real process, started by the
launcher like a worker (its process body: testbed/runtime/store_process.py), that holds KV blocks in DRAM for
every prefill worker, keyed by chained prefix hash (store_index.py).

It talks to the frontend like a worker does (a DEALER for commands, a PUSH for
events: `Ready` with its address, `StoreStats` when told to `Stop`) and serves
the prefill workers' store clients on a ROUTER of its own (store_wire.py).
One thread serves everything in arrival order. A get pins the blocks it sends
until zmq has let go of their memory (the send is zero-copy), so a block is
never evicted while a transfer reads it. A put's bytes are verified against
their checksum before anything is stored.
"""
from __future__ import annotations

import logging
from pathlib import Path

import zmq

from testbed.kv_transfer import store_wire as wire
from testbed.kv_transfer.store_config import KVStoreConfig
from testbed.kv_transfer.store_index import StoreIndex, TierReadError
from testbed.wire_text import shown

log = logging.getLogger(__name__)
MAX_FRAME_BYTES = 256 << 20     # a header (4 MiB at most) or one block of KV (5 MiB for llama2-70b in fp16)


class DiskTier:
    """The store's second tier: one file per block in `path` (8 bytes of
    checksum, then the block), verified when read back. A damaged, missing or
    unreadable file is a TierReadError naming the file, never a crash; so is
    a failed write (False) or removal (one log line): the disk is not ours
    alone, and what is on it may change under us."""

    def __init__(self, path: str):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kvstore.disk_path: cannot make '{path}' the disk tier's directory "
                             f"({type(e).__name__}: {e.strerror}); name a directory the store may create") from None

    def _file(self, key: int) -> Path:
        return self.path / f"{key:016x}.kv"

    def write(self, key: int, value) -> bool:
        checksum, block = value
        try:
            self._file(key).write_bytes(checksum.to_bytes(8, "little") + block)
        except OSError as e:
            log.warning("kv store: disk tier: cannot write %s (%s): the block leaves the store", self._file(key), e)
            return False
        return True

    def read(self, key: int):
        file = self._file(key)
        try:
            raw = file.read_bytes()
        except OSError as e:
            raise TierReadError(f"{file}: unreadable ({type(e).__name__}: {e.strerror})", corrupt=False) from None
        if len(raw) <= 8:
            raise TierReadError(f"{file}: {len(raw)} bytes, shorter than its checksum and a block", corrupt=True)
        checksum, block = int.from_bytes(raw[:8], "little"), raw[8:]
        if wire.block_checksum(block) != checksum:
            raise TierReadError(f"{file}: its {len(block)} bytes of block fail their checksum", corrupt=True)
        return checksum, block

    def remove(self, key: int) -> None:
        try:
            self._file(key).unlink(missing_ok=True)
        except OSError as e:         # e.g. a directory in its place: not ours to delete
            log.warning("kv store: disk tier: cannot remove %s (%s)", self._file(key), e)


class StoreServer:
    """The client-facing side: a bound ROUTER and the index behind it."""

    def __init__(self, cfg: KVStoreConfig, host: str, ctx: zmq.Context):
        self.cfg = cfg
        disk = DiskTier(cfg.disk_path) if cfg.disk_capacity_bytes else None
        self.index = StoreIndex(cfg.capacity_bytes, cfg.disk_capacity_bytes, disk)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a bigger frame than a header or a block could be: ZMQ drops its peer before allocating it
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._sending: list[tuple[zmq.MessageTracker, list[int]]] = []   # gets in flight and their pins
        self._served = 0                       # blocks served, for fault_corrupt_nth_get
        self.num_bad_requests = 0

    def serve(self) -> None:
        """Every request waiting on the socket, then unpin finished sends."""
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            if len(frames) < 2:
                self.num_bad_requests += 1
                log.warning("kv store: bad request: an empty message from %s", shown(frames[0].bytes))
                continue
            ident, header, data = frames[0].bytes, frames[1], frames[2:]
            request_id, pins = -1, []
            try:
                h = wire.decode(header.buffer)
                request_id = h["id"]
                op = wire.check_request(h, len(data))
                reply, out, pins = getattr(self, f"_{op}")(h, data)
            except wire.StoreWireError as e:
                self.num_bad_requests += 1
                log.warning("kv store: bad request from %s: %s", shown(ident), e)
                reply, out = {"id": request_id, "ok": False, "error": str(e)}, []
            self._reply(ident, reply, out, pins)
        self._unpin_sent()

    def _reply(self, ident: bytes, reply: dict, frames: list, pins: list[int]) -> None:
        parts = [ident, wire.encode(reply), *frames]
        try:
            if frames:
                tracker = self.sock.send_multipart(parts, copy=False, track=True, flags=zmq.NOBLOCK)
                self._sending.append((tracker, pins))
                return
            self.sock.send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:        # the client is gone: nothing to do
            log.warning("kv store: reply not sent: %s", e)
        self.index.unpin(pins)

    def _unpin_sent(self) -> None:
        still = []
        for tracker, keys in self._sending:
            if tracker.done:
                self.index.unpin(keys)
            else:
                still.append((tracker, keys))
        self._sending = still

    # -- ops: (header, data frames) -> (reply, reply frames, keys pinned until they are sent)
    def _contains(self, h, data):
        return {"id": h["id"], "ok": True, "n": self.index.lookup(wire.keys(h, "keys"))}, [], []

    def _get(self, h, data):
        found = self.index.get(wire.keys(h, "keys"))
        frames, meta = [], []
        for key, nbytes, value in found:
            checksum, block = value
            self._served += 1
            if self._served == self.cfg.fault_corrupt_nth_get:     # a test's corrupted block
                block = bytes([block[0] ^ 0xFF]) + block[1:]
            frames.append(block)
            meta.append([key, checksum, nbytes])
        pins = [k for k, _, _ in found]
        self.index.pin(pins)
        return {"id": h["id"], "ok": True, "blocks": meta}, frames, pins

    def _put(self, h, data):
        stored = rejected = corrupt = 0
        for (key, checksum, nbytes), frame in zip(wire.blocks(h), data):
            buf = frame.buffer
            if len(buf) != nbytes or wire.block_checksum(buf) != checksum:
                corrupt += 1
                self.index.counters.puts_corrupt += 1
                continue
            if self.index.put(key, nbytes, (checksum, bytes(buf))):
                stored += 1
            else:
                rejected += 1
        return {"id": h["id"], "ok": True, "stored": stored, "rejected": rejected, "corrupt": corrupt}, [], []

    def _stats(self, h, data):
        return {"id": h["id"], "ok": True, "counters": self.index.counters.to_dict(),
                "num_blocks": len(self.index), "used_bytes": self.index.used_bytes}, [], []

    def close(self) -> None:
        self.sock.close(0)
