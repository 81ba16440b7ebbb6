"""KVPort: how a disaggregated worker moves a request's KV to its peer.

The prefill side `send`s a request's blocks (one layer range at a time when
streaming layer by layer); the decode side `poll`s for arrivals, which are
already written into the reserved blocks and verified. The real runtime
implements it over a kv_transfer transport; the simulator over a link model."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class KVArrival:
    request_id: str
    last: bool                      # the request's KV is complete
    ok: bool = True
    error: str | None = None
    num_bytes: int = 0
    meta: dict = field(default_factory=dict)


class KVPort(ABC):
    @abstractmethod
    def send(self, request_id: str, peer: str, src_block_ids: list[int], dst_block_ids: list[int],
             num_tokens: int, layers: tuple[int, int], last: bool, meta: dict) -> int:
        """Send layers [start, end) of the request's KV; returns bytes sent."""

    @abstractmethod
    def poll(self) -> list[KVArrival]:
        """Arrivals since the last poll (decode side)."""

    def stats(self) -> dict[str, int]:
        """Counters for the worker's Stats: kv_peak_inflight_bytes, kv_sends_waited, kv_refused."""
        return {}

    def cancel(self, request_id: str) -> None:
        """The request is released on the sending side: drop what of its KV
        has not left yet (before its blocks are freed)."""

    def expect_senders(self, senders: list[str]) -> None:
        """Receiving side: the names of the run's KV senders; payloads from
        any other are refused (real transports)."""

    def connect(self, peer: str, address: str) -> None:
        """Learn a peer's address (real transports)."""

    def wake_socket(self):
        """Receiving side: a zmq socket that turns readable when KV arrives, so
        that a worker awaiting KV sleeps on it; None: poll on a short timer."""
        return None

    @property
    def address(self) -> str:
        return ""

    def close(self) -> None:
        pass
