"""EvictionQueue: the BlockManager's unreferenced cached blocks in LRU order
(testbed/block_manager.py), torch-free.

A block joins at the most recently released end when its last reference goes,
leaves from anywhere when a prefix hit revives it, and is evicted from the
least recently released end when an allocation runs out of free blocks.
"""
from __future__ import annotations

from collections.abc import Iterator


class EvictionQueue:
    """Unreferenced cached blocks, least recently released first: a doubly
    linked list threaded through two lists indexed by block id (as vLLM's
    FreeKVCacheBlockQueue), so that appending released blocks, taking the
    oldest and unlinking one that a prefix hit revives are a few list-slot
    writes each, with no node objects. Slot `num_blocks` is the sentinel."""

    def __init__(self, num_blocks: int):
        self._end = num_blocks
        self._prev = [num_blocks] * (num_blocks + 1)
        self._next = [num_blocks] * (num_blocks + 1)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        nxt, block_id = self._next, self._next[self._end]
        while block_id != self._end:
            yield block_id
            block_id = nxt[block_id]

    def extend(self, block_ids: list[int]) -> None:
        """Append blocks at the most recently released end, in order."""
        prev, nxt = self._prev, self._next
        last = prev[self._end]
        for block_id in block_ids:
            nxt[last] = block_id
            prev[block_id] = last
            last = block_id
        nxt[last] = self._end
        prev[self._end] = last
        self._len += len(block_ids)

    def remove(self, block_id: int) -> None:
        before, after = self._prev[block_id], self._next[block_id]
        self._next[before] = after
        self._prev[after] = before
        self._len -= 1

    def pop_oldest(self, n: int) -> list[int]:
        """Unlink and return the n least recently released blocks (n <= len)."""
        nxt, block_id, oldest = self._next, self._next[self._end], []
        for _ in range(n):
            oldest.append(block_id)
            block_id = nxt[block_id]
        nxt[self._end] = block_id
        self._prev[block_id] = self._end
        self._len -= n
        return oldest

    def clear(self) -> None:
        self._prev[self._end] = self._next[self._end] = self._end
        self._len = 0

    def check(self) -> None:
        """The links agree both ways and the length is right; for tests."""
        seen, before = 0, self._end
        for block_id in self:
            assert self._prev[block_id] == before, f"eviction queue: block {block_id}'s back link is broken"
            before = block_id
            seen += 1
            assert seen <= self._len, "eviction queue: longer than its length (a cycle?)"
        assert self._prev[self._end] == before and seen == self._len, "eviction queue: length or tail is wrong"
