"""StoreIndex: the KV store's bookkeeping, torch-free (mode=kvstore,
README.md "Architecture"). The real store process (store_service.py) keeps block bytes in it;
the simulator's modeled store node (testbed/runtime/sim_store.py) keeps only
sizes. Both therefore admit, evict and count exactly alike, which is what lets
a simulated hit rate equal a real one on the same workload.

A block is keyed by the chained prefix hash the BlockManager computes
(testbed/block_keys.py, the same in every process), so a key names a whole
token prefix, not only its own block. Capacity is in bytes. Unpinned blocks
are evicted least recently used first (a put or a get refreshes a block); a
block is pinned while a transfer reads it and is never evicted then. A put
that cannot make room (the block is larger than the store, or everything left
is pinned) is refused and counted: a full store degrades to no caching, never
to an error.

An optional second tier (`disk_capacity_bytes` > 0, a directory on disk in the
real store: DiskTier) takes the blocks DRAM evicts, LRU as well; a block read
from it moves back to DRAM. A block leaves the store (an eviction) only when
the last tier drops it. A tier's block that cannot be read back intact (its
file damaged, gone or unreadable: TierReadError) is dropped, counted, and
never served: whoever asked recomputes it. A block is in one tier at a time.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass
class StoreCounters:
    """Counted by the store, in blocks and bytes. Lookups count a prefix query:
    `lookup_blocks` asked, `hits` found (the leading run), `misses` the rest."""
    lookups: int = 0
    lookup_blocks: int = 0
    hits: int = 0
    misses: int = 0
    gets: int = 0
    blocks_served: int = 0
    get_misses: int = 0           # asked by a get but gone by then (evicted after the lookup)
    puts: int = 0
    blocks_stored: int = 0
    blocks_refreshed: int = 0     # put again while present: only its recency changes
    puts_rejected: int = 0        # blocks refused for want of room (full of pinned blocks, or too large)
    puts_corrupt: int = 0         # blocks whose bytes did not match their checksum
    evictions: int = 0            # blocks dropped from the store (from its last tier)
    demotions: int = 0            # blocks moved from DRAM to the disk tier
    disk_hits: int = 0            # blocks served from the disk tier (and moved back to DRAM)
    disk_corrupt: int = 0         # disk blocks read back damaged (short, or failing their checksum): dropped
    disk_read_errors: int = 0     # disk blocks that could not be read at all (file gone or unreadable): dropped
    disk_write_errors: int = 0    # blocks DRAM evicted that the disk tier could not take: they left the store
    bytes_to_store: int = 0
    bytes_from_store: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class TierReadError(Exception):
    """A second tier's block that cannot be given back intact; the text names
    where and why. `corrupt`: it was read, but its bytes are wrong."""

    def __init__(self, why: str, corrupt: bool):
        super().__init__(why)
        self.corrupt = corrupt


class SecondTier(Protocol):
    """Where the disk tier's bytes live (the simulator keeps none)."""

    def write(self, key: int, value: Any) -> bool:
        """False when the value could not be written (nothing of it is kept)."""

    def read(self, key: int) -> Any:
        """The value written under key; TierReadError when it cannot be read back intact."""

    def remove(self, key: int) -> None: ...


class StoreIndex:
    """`capacity_bytes=None`: unbounded. Values are opaque (bytes in the real
    store, None in the simulator)."""

    def __init__(self, capacity_bytes: int | None, disk_capacity_bytes: int = 0, disk: SecondTier | None = None):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"kvstore.capacity_bytes: must be >= 0 or null (unbounded), got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.disk_capacity_bytes, self.disk_used_bytes, self._disk_tier = disk_capacity_bytes, 0, disk
        self._disk: OrderedDict[int, int] = OrderedDict()        # key -> nbytes, least recently used first
        # key -> (nbytes, value), least recently used first
        self._blocks: OrderedDict[int, tuple[int, Any]] = OrderedDict()
        self._pins: dict[int, int] = {}
        self.counters = StoreCounters()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks or key in self._disk

    @property
    def num_disk_blocks(self) -> int:
        return len(self._disk)

    def num_on_disk(self, keys: list[int]) -> int:
        """How many of these keys only the disk tier holds (a read costs more)."""
        return sum(k in self._disk for k in keys)

    def num_leading(self, keys: list[int]) -> int:
        """How many of `keys`, from the first, are stored, uncounted (the
        router's shadow asks it of every routed prompt)."""
        blocks, disk, n = self._blocks, self._disk, 0
        for key in keys:
            if key not in blocks and key not in disk:
                break
            n += 1
        return n

    def lookup(self, keys: list[int]) -> int:
        """How many of `keys`, from the first, are stored (the cached prefix)."""
        n = self.num_leading(keys)
        c = self.counters
        c.lookups += 1
        c.lookup_blocks += len(keys)
        c.hits += n
        c.misses += len(keys) - n
        return n

    def get(self, keys: list[int]) -> list[tuple[int, int, Any]]:
        """(key, nbytes, value) of the leading run of `keys` still stored,
        each refreshed; the caller pins them while it sends (pin/unpin)."""
        out = []
        for key in keys:
            entry = self._blocks.get(key)
            if entry is None:
                entry = self._from_disk(key)
                if entry is None:
                    break
            else:
                self._blocks.move_to_end(key)
            out.append((key, *entry))
        c = self.counters
        c.gets += 1
        c.blocks_served += len(out)
        c.get_misses += len(keys) - len(out)
        c.bytes_from_store += sum(n for _, n, _ in out)
        return out

    def put(self, key: int, nbytes: int, value: Any = None) -> bool:
        """Store one block (or refresh it when present). False, storing nothing,
        when no room can be made."""
        c = self.counters
        c.puts += 1
        if key in self._blocks or key in self._disk:
            (self._blocks if key in self._blocks else self._disk).move_to_end(key)
            c.blocks_refreshed += 1
            return True
        if not self._make_room(nbytes):
            c.puts_rejected += 1
            return False
        self._blocks[key] = (nbytes, value)
        self.used_bytes += nbytes
        c.blocks_stored += 1
        c.bytes_to_store += nbytes
        return True

    def put_many(self, keys: Iterable[int], nbytes: int) -> int:
        """put(key, nbytes) of each key in turn, values None (the simulator's store
        node and the cache-aware router's shadow of it: ~10^6 blocks a run); the
        number stored or refreshed. The usual case, DRAM only and nothing pinned,
        is inlined: a new block evicts the least recently used ones from the
        front, exactly as put would. Its counters are added up once at the end
        (0.40 -> 0.25 s for 1.2M keys into a full store)."""
        blocks, cap = self._blocks, self.capacity_bytes
        if self._pins or self._disk or self.disk_capacity_bytes or cap is None or nbytes > cap:
            return sum(self.put(key, nbytes) for key in keys)
        entry, used = (nbytes, None), self.used_bytes
        kept = stored = evicted = 0
        for key in keys:
            kept += 1
            if key in blocks:
                blocks.move_to_end(key)
            else:
                used += nbytes
                while used > cap:
                    _, (size, _) = blocks.popitem(last=False)
                    used -= size
                    evicted += 1
                blocks[key] = entry
                stored += 1
        self.used_bytes = used
        c = self.counters
        c.puts += kept
        c.blocks_refreshed += kept - stored
        c.blocks_stored += stored
        c.bytes_to_store += stored * nbytes
        c.evictions += evicted
        return kept

    def _make_room(self, nbytes: int) -> bool:
        cap = self.capacity_bytes
        if cap is None:
            return True
        if nbytes > cap:
            return False
        if self.used_bytes + nbytes <= cap:
            return True
        victims, freed = [], 0
        for key, (size, _) in self._blocks.items():       # least recently used first
            if key in self._pins:
                continue
            victims.append(key)
            freed += size
            if self.used_bytes - freed + nbytes <= cap:
                break
        else:
            return False            # everything else is pinned: refuse, evict nothing
        for key in victims:
            self._evict(key)
        return True

    def _evict(self, key: int) -> None:
        size, value = self._blocks.pop(key)
        self.used_bytes -= size
        if not self._to_disk(key, size, value):
            self.counters.evictions += 1

    # -- the disk tier ---------------------------------------------------------------
    def _to_disk(self, key: int, size: int, value: Any) -> bool:
        cap = self.disk_capacity_bytes
        if size > cap:
            return False
        assert key not in self._disk, f"block {key:#x} in both tiers"
        if self._disk_tier is not None and not self._disk_tier.write(key, value):
            self.counters.disk_write_errors += 1
            return False
        while self.disk_used_bytes + size > cap:
            old, old_size = self._disk.popitem(last=False)
            self.disk_used_bytes -= old_size
            if self._disk_tier is not None:
                self._disk_tier.remove(old)
            self.counters.evictions += 1
        self._disk[key] = size
        self.disk_used_bytes += size
        self.counters.demotions += 1
        return True

    def _from_disk(self, key: int) -> tuple[int, Any] | None:
        """A disk block read back and moved to DRAM (where room can be made)."""
        size = self._disk.get(key)
        if size is None:
            return None
        del self._disk[key]
        self.disk_used_bytes -= size
        value = None
        if self._disk_tier is not None:
            try:
                value = self._disk_tier.read(key)
            except TierReadError as e:         # gone from the store, recomputed by whoever wanted it
                if e.corrupt:
                    self.counters.disk_corrupt += 1
                else:
                    self.counters.disk_read_errors += 1
                self.counters.evictions += 1
                log.warning("kv store: disk block %#x dropped, never served: %s", key, e)
                return None
            finally:
                self._disk_tier.remove(key)
        self.counters.disk_hits += 1
        if self._make_room(size):
            self._blocks[key] = (size, value)
            self.used_bytes += size
        else:
            self.counters.evictions += 1       # served, but DRAM is all pinned: it leaves the store
        return size, value

    def pin(self, keys: list[int]) -> None:
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: list[int]) -> None:
        for key in keys:
            n = self._pins.get(key, 0) - 1
            if n > 0:
                self._pins[key] = n
            else:
                self._pins.pop(key, None)

    def num_pinned(self) -> int:
        return len(self._pins)

    def keys(self) -> list[int]:
        """Stored keys, least recently used first (tests)."""
        return list(self._blocks)
