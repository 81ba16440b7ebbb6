"""CorruptingSender: fault injection for tests of the receiver's checks.

Wraps a sender and flips one byte in the middle of the n-th payload's data
after its checksum was computed, as a bad link or buggy DMA would; the
receiver must report that payload (and so its request) as failed. Chosen by
`transfer.fault_corrupt_nth`; never on in a real run.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from testbed.kv_transfer.base import Ack, KVSender
from testbed.kv_transfer.payload import DTYPES, KVPayload


class CorruptingSender(KVSender):
    def __init__(self, inner: KVSender, nth: int) -> None:
        if nth < 1:
            raise ValueError(f"nth={nth}: the payload to corrupt is counted from 1")
        self.inner = inner
        self.name = inner.name
        self.nth = nth
        self.num_sent = 0
        self.takes_parts = inner.takes_parts

    def connect(self, peer: str, address: str) -> None:
        self.inner.connect(peer, address)

    def send(self, peer: str, payload: KVPayload) -> None:
        self.num_sent += 1
        if self.num_sent == self.nth:
            # a copy: the caller's buffer (and cache, which parts are views of) stay intact; the
            # checksum is of the bytes before the flip, also where the sender would hash them in flight
            payload = payload.with_checksum()
            raw = np.concatenate(payload.byte_parts())
            raw[len(raw) // 2] ^= 0xFF
            data = torch.from_numpy(raw).view(DTYPES[payload.dtype]).view(payload.shape)
            payload = dataclasses.replace(payload, data=data, parts=None)
        self.inner.send(peer, payload)

    def flush(self, timeout_s: float | None = None) -> None:
        self.inner.flush(timeout_s)

    def poll_acks(self, timeout_ms: int = 0) -> list[Ack]:
        return self.inner.poll_acks(timeout_ms)

    def close(self) -> None:
        self.inner.close()
