"""ReceiveBuffers: the receivers' reusable landing buffers, one contiguous
buffer per payload.

Fresh memory page-faults at ~4 GB/s here, about the loopback's own speed, so
buffers are kept and lent again. The receiver releases a buffer when its
payload failed, or at the poll() after the one that returned it (the
payload's data is valid until then). Pinned buffers let a GPU cache copy
from them directly.
"""
from __future__ import annotations

import torch

MiB = 1 << 20


class ReceiveBuffers:
    def __init__(self, pin_memory: bool = False, max_free: int = 4) -> None:
        if max_free < 1:
            raise ValueError(f"max_free={max_free} must be >= 1")
        self.pin_memory = pin_memory
        self.max_free = max_free
        self._free: list[torch.Tensor] = []      # sorted by size, smallest first
        self.num_lent = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of exactly nbytes (a view of a pooled one)."""
        self.num_lent += 1
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i)[:nbytes]
        # sizes rounded up to whole MiB so that payloads of similar size share buffers
        size = max(MiB, -(-nbytes // MiB) * MiB)
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)[:nbytes]

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer from take(); the largest max_free are kept."""
        self.num_lent -= 1
        whole = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())
        self._free = sorted(self._free + [whole], key=torch.Tensor.numel)[-self.max_free:]

    @property
    def nbytes_free(self) -> int:
        return sum(b.numel() for b in self._free)
