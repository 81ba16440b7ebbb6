"""The transport interface: how KVPayloads get from a prefill worker to a
decode worker, and how the decode worker answers.

Each worker process owns at most one KVReceiver (it binds; `address` is what
peers connect to) and one KVSender (connects to receivers by peer name). The
engine loop calls `receiver.poll(0)` each iteration; arrivals come back
verified, or with `error` set (corrupted, malformed): the receiver never
raises for what a peer sent. After writing a request's KV into its blocks, the
decode side calls `receiver.ack(origin, request_id)` (or `ok=False, reason=...`)
and the prefill side sees it in `sender.poll_acks()`, then frees its blocks.
Acks travel back over the same connection the data came in on, so a sender
needs no listening socket of its own.

Everything is closable: close() releases every port, socket file and thread.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # payload.py imports torch; the interface itself does not need it
    from testbed.kv_transfer.payload import KVPayload


class TransferError(RuntimeError):
    """A send could not complete (timeout, unknown peer, closed transport)."""


@dataclass(frozen=True)
class Ack:
    peer: str             # the receiver it came from: the name given to connect()
    request_id: str
    ok: bool
    reason: str = ""


class KVReceiver(ABC):
    address: str          # hand this to peers' KVSender.connect

    @abstractmethod
    def poll(self, timeout_ms: int = 0) -> list[KVPayload]:
        """Payloads that arrived (verified, or with `error` set), waiting up
        to timeout_ms for the first one. A payload's data is only guaranteed
        until the next poll() (torch_dist reuses its landing buffers):
        unpack_kv it, or copy it, before polling again."""

    def wake_socket(self):
        """The zmq socket that turns readable when this receiver has something
        to take, for a loop to sleep on between polls; None when it has none
        (the loop then polls on a short timer)."""
        return None

    @abstractmethod
    def ack(self, origin: str, request_id: str, ok: bool = True, reason: str = "") -> bool:
        """Tell the sender named `origin` (payload.origin) how request_id went.
        False when that sender is gone."""

    @abstractmethod
    def close(self) -> None:
        """Unbind, remove socket files, stop threads. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVSender(ABC):
    name: str             # receivers see it as payload.origin
    takes_parts = False   # send() takes a payload with `parts` (pack.view_kv) instead of packed data

    @abstractmethod
    def connect(self, peer: str, address: str) -> None:
        """Learn a receiver's address under the name `peer`."""

    @abstractmethod
    def send(self, peer: str, payload: KVPayload) -> None:
        """Hand a payload to the transport. It may return before the bytes have
        left: do not write into payload.data until flush() has returned."""

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every payload sent so far has left this process (its
        buffer may be reused). Raises TransferError on timeout or failure."""

    @abstractmethod
    def poll_acks(self, timeout_ms: int = 0) -> list[Ack]:
        """Acks that arrived, waiting up to timeout_ms for the first one."""

    @abstractmethod
    def close(self) -> None:
        """Drop anything unsent (flush() first to deliver it), disconnect,
        stop threads. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
