"""SendWindow: a bound on the KV bytes a sender has in flight to each peer.

A request's KV is in flight to its decode peer from the moment it is packed
for sending until that peer acknowledges the request (or the request is
released on this side: aborted, lease expired, the peer died). A slow
receiver therefore holds at most about `max_bytes` of the sender's memory
(staging buffers, and frames queued in zmq, whose high-water mark is 0); what
does not fit waits unpacked, its KV still in the sender's paged cache, where
it is held until release anyway. Other peers have windows of their own, so a
slow peer delays nobody else's KV.

Admission is per request: once a request's first piece is in, its later
pieces (layer-wise streaming) go too, because its acknowledgement only comes
after its last piece. An empty window always admits, so a request larger than
the window still goes, alone. Torch-free.
"""
from __future__ import annotations

from collections import defaultdict


class SendWindow:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"transfer.max_inflight_mb: the window must be > 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._bytes: dict[str, int] = defaultdict(int)               # peer -> bytes in flight
        self._requests: dict[str, tuple[str, int]] = {}              # request id -> (peer, its bytes in flight)
        self.peak_bytes: dict[str, int] = defaultdict(int)           # peer -> the most it ever had in flight

    def in_flight(self, peer: str) -> int:
        return self._bytes[peer]

    def holds(self, request_id: str) -> bool:
        """request_id is admitted: it has bytes in flight."""
        return request_id in self._requests

    def admits(self, peer: str, request_id: str, nbytes: int) -> bool:
        if request_id in self._requests:
            return True
        used = self._bytes[peer]
        return used == 0 or used + nbytes <= self.max_bytes

    def sent(self, peer: str, request_id: str, nbytes: int) -> None:
        _, so_far = self._requests.get(request_id, (peer, 0))
        self._requests[request_id] = (peer, so_far + nbytes)
        self._bytes[peer] += nbytes
        self.peak_bytes[peer] = max(self.peak_bytes[peer], self._bytes[peer])

    def settle(self, request_id: str) -> None:
        """request_id's bytes are no longer in flight (acknowledged, or released)."""
        peer, nbytes = self._requests.pop(request_id, ("", 0))
        if nbytes:
            self._bytes[peer] -= nbytes
