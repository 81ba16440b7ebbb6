"""StorePort: how a kvstore prefill worker reads and writes the shared KV
store (modes/kvstore_roles.py), whatever the runtime: over a real store
process (real_store_port.py) or a modeled store node (sim/store_model.py).

`fetch` looks the prefix's block keys up and reads the leading run it finds;
the answer comes through a callback, at once on the real runtime (the worker
blocks on the store's socket) and when the bytes have crossed the modeled
link on the simulator. `write` lands fetched blocks in the worker's own KV
blocks, `publish` stores blocks the worker computed. Nothing here raises for
the store's sake: a store that is gone, full or serving a corrupted block
only means fewer blocks come back (recompute) or fewer are kept."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Fetched:
    request_id: str
    num_found: int                 # blocks the lookup found
    blocks: list[Any] = field(default_factory=list)   # the leading blocks that arrived intact (None: modeled)
    fetch_s: float = 0.0           # lookup plus read
    error: str | None = None       # why fewer than num_found arrived, if it was not eviction

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class StorePort(ABC):
    @abstractmethod
    def fetch(self, request_id: str, keys: list[int], on_done: Callable[[Fetched], None]) -> None:
        """Look `keys` (a prompt's block keys past the locally cached ones) up
        and read the leading run found."""

    @abstractmethod
    def write(self, fetched: Fetched, block_ids: list[int]) -> None:
        """Copy the first len(block_ids) fetched blocks into these KV blocks."""

    @abstractmethod
    def publish(self, keys: list[int], block_ids: list[int]) -> int:
        """Store the KV of these blocks under these keys; returns how many were kept."""

    def cancel(self, request_id: str) -> None:
        """Forget a fetch still under way (the request ended)."""

    def flush(self) -> None:
        """Return once the store holds what was published before (a stopping
        worker's last blocks are counted, not dropped with its socket)."""

    def close(self) -> None:
        pass
