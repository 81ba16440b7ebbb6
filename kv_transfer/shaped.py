"""ShapedSender: a real sender behind an emulated slower link (e.g. 25 Gb/s
TCP between nodes, relative to this machine's compute).

The link serialises payloads: each occupies it for nbytes / rate after the
previous one has left (a token bucket with no burst allowance), then arrives
`latency` later; a background thread really waits until then and hands the
payload to the inner sender. send() returns at once, so a prefill worker
keeps computing while its layers are "on the wire" (what layer-wise streaming
overlaps); flush() waits for the link to drain. Only sending is shaped: the
receiving side is the inner transport's own receiver. A failed delivery fails
that peer only: its queued payloads are dropped, later sends to it raise
TransferError, and the link keeps serving the other peers.
"""
from __future__ import annotations

import collections
import threading
import time

from testbed.kv_transfer.base import Ack, KVSender, TransferError
from testbed.kv_transfer.payload import KVPayload


class ShapedSender(KVSender):
    def __init__(self, inner: KVSender, rate_bytes_per_s: float, latency_s: float = 0.0,
                 timeout_s: float = 30.0) -> None:
        if not rate_bytes_per_s > 0 or not latency_s >= 0:
            raise ValueError(f"shaped link: rate {rate_bytes_per_s} B/s must be > 0 and latency "
                             f"{latency_s} s >= 0")
        self.inner = inner
        self.name = inner.name
        self.takes_parts = inner.takes_parts
        self.rate_bytes_per_s = rate_bytes_per_s
        self.latency_s = latency_s
        self.timeout_s = timeout_s
        # zmq sockets are not thread-safe: the link thread and the caller take turns under this lock
        self._inner_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[float, str, KVPayload]] = collections.deque()
        self._link_free_at = 0.0          # monotonic time the link finishes its last queued payload
        self._num_queued = 0
        self._num_delivered = 0
        self._failed_peers: dict[str, BaseException] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"shaped-link-{self.name}", daemon=True)
        self._thread.start()

    def connect(self, peer: str, address: str) -> None:
        with self._inner_lock:
            self.inner.connect(peer, address)

    def send(self, peer: str, payload: KVPayload) -> None:
        # hashed now, not when the link thread sends it: blocks freed and rewritten in
        # between (an expired lease) must fail the receiver's check, not pass it
        payload = payload.with_checksum()
        with self._cond:
            self._raise_if_failed()
            if peer in self._failed_peers:
                raise TransferError(f"sender {self.name}: the link to {peer} failed: "
                                    f"{self._failed_peers[peer]}") from self._failed_peers[peer]
            start = max(time.monotonic(), self._link_free_at)
            self._link_free_at = start + payload.nbytes / self.rate_bytes_per_s
            self._queue.append((self._link_free_at + self.latency_s, peer, payload))
            self._num_queued += 1
            self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            done = self._cond.wait_for(lambda: self._closed or self._num_delivered == self._num_queued,
                                       max(0.0, deadline - time.monotonic()))
            self._raise_if_failed()
            if not done:
                raise TransferError(f"sender {self.name}: {self._num_queued - self._num_delivered} payloads "
                                    "still on the shaped link at the flush deadline")
        with self._inner_lock:
            self.inner.flush(max(0.0, deadline - time.monotonic()))

    def poll_acks(self, timeout_ms: int = 0) -> list[Ack]:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            with self._inner_lock:
                acks = self.inner.poll_acks(0)
            remaining = deadline - time.monotonic()
            if acks or remaining <= 0:
                return acks
            time.sleep(min(remaining, 0.001))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join()
        self.inner.close()

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise TransferError(f"sender {self.name} is closed")

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                if not self._queue:
                    self._cond.wait()
                    continue
                deliver_at, peer, payload = self._queue[0]
                wait_s = deliver_at - time.monotonic()
                if wait_s > 0:
                    self._cond.wait(wait_s)        # woken early by close() or a new send
                    continue
                self._queue.popleft()
            try:
                with self._inner_lock:
                    self.inner.send(peer, payload)
            except Exception as e:                 # that peer is gone: fail it, keep the link for the rest
                with self._cond:
                    self._failed_peers[peer] = e
                    dropped = [item for item in self._queue if item[1] == peer]
                    for item in dropped:
                        self._queue.remove(item)
                    self._num_delivered += 1 + len(dropped)
                    self._cond.notify_all()
                continue
            with self._cond:
                self._num_delivered += 1
                self._cond.notify_all()
