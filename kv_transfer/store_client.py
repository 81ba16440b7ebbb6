"""StoreClient: a prefill worker's connection to the KV store process
(store_service.py), torch-free: blocks are bytes here.

Every call is one request and one reply (store_wire.py) with a deadline of
`timeout_s`. A store that misses it, or that is gone, raises `StoreDown`, and
the client then leaves the store alone for `retry_s` (each call in that time
raises at once) before it tries again on a fresh socket: a dead store costs
one timeout, not one per request, and nothing ever waits on it for longer.
The caller falls back to recompute (vLLM's kv_load_failure_policy=recompute).
Received blocks are verified against their checksums; a block that fails is
dropped with every block after it, since a prefix is only usable up to its
first hole.
"""
from __future__ import annotations

import itertools
import logging
import time

import zmq

from testbed.kv_transfer import store_wire as wire

log = logging.getLogger(__name__)


class StoreDown(RuntimeError):
    """The store did not answer in time (or the client is waiting out retry_s)."""


class StoreClient:
    def __init__(self, address: str, timeout_s: float, retry_s: float, name: str = "store-client"):
        self.address, self.timeout_s, self.retry_s, self.name = address, timeout_s, retry_s, name
        self._ctx = zmq.Context(io_threads=1)
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._down_until = 0.0
        self.num_corrupt = 0            # blocks received that failed their checksum
        self.num_timeouts = 0

    def _socket(self) -> zmq.Socket:
        if time.monotonic() < self._down_until:
            raise StoreDown(f"the KV store at {self.address} timed out less than {self.retry_s} s ago")
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.address)
        return self._sock

    def _call(self, header: dict, frames: list = ()) -> tuple[dict, list[zmq.Frame]]:
        sock = self._socket()
        header["id"] = rid = next(self._ids)
        sock.send_multipart([wire.encode(header), *frames], copy=False)
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1):
                self._mark_down(f"no reply to {header['op']} in {self.timeout_s} s")
            parts = sock.recv_multipart(copy=False)
            try:
                reply = wire.decode(parts[0].buffer)
            except wire.StoreWireError as e:
                log.warning("%s: dropped a reply: %s", self.name, e)
                continue
            if reply["id"] != rid:
                continue                 # a reply to a put_nowait, or to a call that timed out earlier
            if reply.get("ok") is not True:
                raise StoreDown(f"the KV store refused {header['op']}: {str(reply.get('error'))[:200]}")
            return reply, parts[1:]

    def _mark_down(self, why: str):
        self.num_timeouts += 1
        self._down_until = time.monotonic() + self.retry_s
        if self._sock is not None:         # a fresh socket next time: nothing stale queued on it
            self._sock.close(0)
            self._sock = None
        raise StoreDown(f"KV store at {self.address}: {why}")

    # -- the three operations -------------------------------------------------------
    def contains(self, keys: list[int]) -> int:
        """How many of `keys`, from the first, the store holds."""
        if not keys:
            return 0
        reply, _ = self._call({"op": "contains", "keys": keys})
        return min(wire.reply_int(reply, "n"), len(keys))

    def get(self, keys: list[int]) -> list[memoryview]:
        """The bytes of the leading run of `keys` the store still holds and
        that arrived intact (possibly fewer than asked: evicted meanwhile, or
        corrupted on the way)."""
        if not keys:
            return []
        reply, frames = self._call({"op": "get", "keys": keys})
        blocks = wire.blocks(reply)
        out = []
        for want, (key, checksum, nbytes), frame in zip(keys, blocks, frames):
            buf = frame.buffer
            if key != want or len(buf) != nbytes:
                break
            if wire.block_checksum(buf) != checksum:
                self.num_corrupt += 1
                log.warning("%s: block %#x failed its checksum: dropped, recomputed", self.name, key)
                break
            out.append(buf)
        return out

    def put(self, keys: list[int], blocks: list) -> tuple[int, int]:
        """Store blocks (bytes-like, one per key); returns (stored, refused)."""
        if not keys:
            return 0, 0
        reply, _ = self._call(self._put_header(keys, blocks), list(blocks))
        return wire.reply_int(reply, "stored"), wire.reply_int(reply, "rejected") + wire.reply_int(reply, "corrupt")

    def put_nowait(self, keys: list[int], blocks: list) -> bool:
        """Send a put and return at once (its reply is skipped by the next
        call): publishing is off the request's path, and the store keeps a
        connection's messages in order, so this worker's own later lookups
        see it. False when the store is known down or its queue is full."""
        if not keys:
            return True
        try:
            sock = self._socket()
            header = self._put_header(keys, blocks)
            header["id"] = next(self._ids)
            sock.send_multipart([wire.encode(header), *blocks], copy=False, flags=zmq.NOBLOCK)
        except (StoreDown, zmq.Again):
            return False
        return True

    @staticmethod
    def _put_header(keys: list[int], blocks: list) -> dict:
        meta = [[k, wire.block_checksum(b), memoryview(b).nbytes] for k, b in zip(keys, blocks)]
        return {"op": "put", "blocks": meta}

    def flush(self) -> None:
        """Return once the store has taken every put sent before: one round
        trip, answered after them since the store keeps a connection's
        messages in order. StoreDown when it does not answer in time."""
        if self._sock is not None:
            self._call({"op": "stats"})

    def stats(self) -> dict:
        reply, _ = self._call({"op": "stats"})
        return {**reply["counters"], "num_blocks": reply["num_blocks"], "used_bytes": reply["used_bytes"]}

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.term()
