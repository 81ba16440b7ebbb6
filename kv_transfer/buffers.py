"""ReceiveBuffers: the receiver's reusable landing buffers.

Arriving payload bytes are written straight into one contiguous buffer per
payload. Fresh memory page-faults at ~4 GB/s here, about the loopback's own
speed, so buffers are kept and lent again: a buffer lent during one poll()
comes back at the start of the next one (the payload's data is only valid
until then). Pinned buffers make the copy into a GPU cache asynchronous-capable.
"""
from __future__ import annotations

import torch

MiB = 1 << 20


class ReceiveBuffers:
    def __init__(self, pin_memory: bool = False, max_free: int = 4) -> None:
        self.pin_memory = pin_memory
        self.max_free = max_free
        self._free: list[torch.Tensor] = []      # sorted by size, smallest first
        self._lent: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least nbytes, lent until reclaim()."""
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                self._lent.append(self._free.pop(i))
                return self._lent[-1]
        # sizes rounded up to whole MiB so that payloads of similar size share buffers
        size = max(MiB, -(-nbytes // MiB) * MiB)
        self._lent.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory))
        return self._lent[-1]

    def reclaim(self) -> None:
        """Everything lent comes back; keep the largest max_free buffers."""
        self._free = sorted(self._free + self._lent, key=torch.Tensor.numel)[-self.max_free:]
        self._lent = []

    @property
    def nbytes_held(self) -> int:
        return sum(b.numel() for b in self._free + self._lent)
