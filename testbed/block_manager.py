"""BlockManager: the paged KV cache's bookkeeping, torch-free (README.md, "Architecture").

The scheduler grows a request's block table before each step (`allocate`,
which says False when memory is short; the policy then preempts), and after the step
registers the blocks that filled up (`commit`) so that a later request with the
same prefix reuses them (`match_prefix`). The executor only reads the block
tables; it owns the KV tensors `[num_layers, 2, num_blocks, block_size, ...]`
that the block ids index. When a request finishes, aborts or is preempted the
engine calls `free`.

Every block is in exactly one of three states:
- free: on the free list, holds nothing worth keeping;
- used: referenced by one or more block tables (ref count > 0);
- cached: unreferenced but holding a full, hashed block of KV; it stays
  findable by prefix hash until evicted, least recently released first.
Free and cached blocks both count as available (`num_free_blocks`); allocation
takes truly free blocks first and evicts cached ones only when it must.

A full block's key is chained (block_keys.py): hash(parent's key, its token ids), so
one dict lookup per block walks a prompt's prefix. A hit is then verified
exactly, never trusting the hash: each registered block gets a serial number
(never reused) naming the exact token prefix it ends, and it keeps its own
token ids (the bytes it hashed) and its parent's serial; a lookup compares
both against the block matched just before. By induction a matched chain
holds exactly the request's prefix, so a collision (even one that makes a
chain loop back on itself) is a miss, never wrong KV.

A request's private blocks (from `Request.private_from`'s block on: tokens no
other request holds there) are marked PRIVATE, not hashed; cached and evicted
as hashed ones, they are found again by their request's id after a preemption
(parked_blocks.py). A run of synthetic prompts hashes nothing, and finds
exactly what hashing would find.

The per-block state lives in flat lists and int64 arrays indexed by block id,
not in one object per block, and a block's token ids are its slice of the bytes
its commit hashed: a simulated run moves ~10^6 blocks through allocate, commit
and free, and every object made and freed per block costs time there.
"""
from __future__ import annotations

from array import array
from collections import deque
from typing import NamedTuple

import xxhash

from testbed.block_keys import ROOT_HASH, token_bytes
from testbed.eviction_queue import EvictionQueue
from testbed.parked_blocks import Park, ParkedBlocks, Run
from testbed.request import Request

# The serial of a prompt's first block's parent (its key's parent is ROOT_HASH).
ROOT_SERIAL = 0
# A private block's hash slot (xxh3 keys are >= 0): committed, never in the hash table.
PRIVATE = -1


class ChainEnd(NamedTuple):
    """Where a request's hash chain stands: its first `num_blocks` full blocks
    are committed, the last of them with this hash and prefix serial."""
    num_blocks: int
    hash: int
    serial: int


CHAIN_START = ChainEnd(0, ROOT_HASH, ROOT_SERIAL)


class BlockManager:
    """Fixed-size blocks, a free list, ref counts, chained prefix hashes (token
    ids compared against collisions), LRU eviction of unreferenced cached blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_blocks}; give the KV cache at least one block")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}; 16 is the usual value")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # per block id
        self._ref_counts = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks    # set while registered in the prefix cache
        # meaningful only while the block's hash is set: the serial naming the
        # exact token prefix it ends and its parent's (plain int64 slots, no int
        # objects), and its token ids: block `index` of the bytes `commit` fetched
        # them in (one object shared by the blocks of a fetch, not one per block)
        self._serials = array("q", [ROOT_SERIAL]) * num_blocks
        self._parent_serials = array("q", [ROOT_SERIAL]) * num_blocks
        self._token_chunks: list[bytes | None] = [None] * num_blocks
        self._token_index = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable = EvictionQueue(num_blocks)
        self._hash_to_block: dict[int, int] = {}
        self._tables: dict[str, list[int]] = {}
        # each request's committed full blocks, including any left unregistered
        # (their content was already cached in another block): the chain goes on past them
        self._chains: dict[str, ChainEnd] = {}
        self._next_serial = ROOT_SERIAL + 1
        self._parked = ParkedBlocks()

    def hash_block(self, parent_hash: int, tokens: bytes) -> int:
        """hash_block_tokens of one full block given as its bytes (what the
        prefix walk slices out of one fetch of the request's tokens)."""
        return xxhash.xxh3_64_intdigest(tokens, parent_hash)

    def _digest(self):
        """hash_block as digest(tokens, parent_hash): xxh3 itself unless a
        subclass hooks hash_block (tests do): a Python call fewer per block, on
        the simulator's hottest path (bench_kvstore.py speed)."""
        if type(self).hash_block is BlockManager.hash_block:
            return xxhash.xxh3_64_intdigest
        hash_block = self.hash_block
        return lambda tokens, parent_hash: hash_block(parent_hash, tokens)

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: truly free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    def num_cached_blocks(self) -> int:
        """Blocks findable by prefix hash, referenced or not."""
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_table(self, request_id: str) -> list[int]:
        """The live block table (not a copy); [] for a request holding none."""
        return self._tables.get(request_id, [])

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks `request` needs to hold `num_tokens` tokens in total."""
        table = self._tables.get(request.request_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        return need if need > 0 else 0

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """Whether `allocate(request, num_tokens)` would succeed, without doing it."""
        # blocks_needed inlined: called for every running request every step
        table = self._tables.get(request.request_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        return need <= 0 or need <= len(self._free) + len(self._evictable)

    def all_free(self) -> bool:
        """No request holds any block (cached-but-unreferenced counts as free)."""
        return len(self._free) + len(self._evictable) == self.num_blocks

    # ---- prefix cache ----------------------------------------------------------
    def match_prefix(self, request: Request) -> int:
        """Give a request that holds no blocks the longest run of cached full
        blocks matching its tokens; returns the number of tokens they cover.

        Never covers the last token: a step must compute at least one token to
        sample from. The caller sets `num_computed_tokens` from the result."""
        rid = request.request_id
        if self._tables.get(rid):
            raise ValueError(f"match_prefix: request {rid} already holds blocks; "
                             "call it only before the request's first allocation (or after free)")
        if not self.enable_prefix_caching:
            return 0
        table = self._tables.setdefault(rid, [])
        self._chains.setdefault(rid, CHAIN_START)
        num_full = (request.num_tokens - 1) // self.block_size
        if not num_full:
            return 0
        first = self._first_private(request)
        hashed = num_full if first is None else min(num_full, first)
        data = token_bytes(request.token_array(0, hashed * self.block_size)) if self._hash_to_block else b""
        nbytes = 8 * self.block_size
        ref_counts = self._ref_counts
        parent_hash, parent_serial = ROOT_HASH, ROOT_SERIAL
        digest = self._digest()
        for off in range(0, len(data), nbytes):
            tokens = data[off:off + nbytes]
            h = digest(tokens, parent_hash)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            if self._block_tokens(block_id) != tokens or self._parent_serials[block_id] != parent_serial:
                break  # hash collision: different content under the same key
            if ref_counts[block_id] == 0:
                self._evictable.remove(block_id)
            ref_counts[block_id] += 1
            table.append(block_id)
            parent_hash, parent_serial = h, self._serials[block_id]
        park = self._parked.take(rid)
        if park is not None and len(table) == park.run.first:
            self._unpark(rid, park, table, num_full)
        if table:
            self._chains[rid] = ChainEnd(len(table), parent_hash, parent_serial)
        return len(table) * self.block_size

    def _unpark(self, rid: str, park: Park, table: list[int], num_full: int) -> None:
        """Take back the request's parked private blocks that are still cached,
        in order up to the first that is not (evicted, and maybe reused since)."""
        run, ref_counts = park.run, self._ref_counts
        for block_id in park.blocks[:num_full - run.first]:
            if not self._marked(block_id, run.serial):
                break
            if ref_counts[block_id] == 0:
                self._evictable.remove(block_id)
            ref_counts[block_id] += 1
            table.append(block_id)
        self._parked.start(rid, run)

    def _marked(self, block_id: int, serial: int) -> bool:
        """Whether the block is a private block of the run marked `serial`."""
        return self._hashes[block_id] == PRIVATE and self._serials[block_id] == serial

    def commit(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens
        (hashed, or marked private from its first private block on). Cheap
        when no block filled since the last call."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        chain = self._chains.get(rid)
        if chain is None:
            return  # holds no blocks: never allocated, or already freed this step
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        done = chain.num_blocks
        if num_full <= done:
            return
        table = self._tables[rid]
        if num_full > len(table):
            raise AssertionError(f"commit: request {rid} has {request.num_computed_tokens} computed tokens "
                                 f"but only {len(table)} blocks of {bs}")
        first = self._first_private(request)
        hashed = num_full if first is None else min(num_full, first)
        if hashed > done:
            chain = self._commit_hashed(request, table, chain, hashed)
        if num_full > hashed:
            self._commit_private(rid, table, max(done, first), num_full, first)
            chain = ChainEnd(num_full, chain.hash, chain.serial)
        self._chains[rid] = chain

    def _commit_hashed(self, request: Request, table: list[int], chain: ChainEnd, end: int) -> ChainEnd:
        """Hash and register the request's blocks [chain.num_blocks, end); the chain's new end."""
        bs, done = self.block_size, chain.num_blocks
        parent_hash, parent_serial = chain.hash, chain.serial
        # one fetch for every block that filled, sliced per block as bytes: the
        # hot path of a simulated run with prefix caching (no tuple, no packing)
        data = token_bytes(request.token_array(done * bs, end * bs))
        nbytes = 8 * bs
        hash_to_block = self._hash_to_block
        hashes, serials, parent_serials = self._hashes, self._serials, self._parent_serials
        token_chunks, token_index = self._token_chunks, self._token_index
        next_serial = self._next_serial
        digest = self._digest()
        for index, block_id in enumerate(table[done:end]):
            tokens = data[index * nbytes:(index + 1) * nbytes]
            h = digest(tokens, parent_hash)
            cached_id = hash_to_block.get(h)
            if cached_id is None:
                hash_to_block[h] = block_id
                hashes[block_id], parent_serials[block_id] = h, parent_serial
                token_chunks[block_id], token_index[block_id] = data, index
                serials[block_id] = serial = next_serial
                next_serial += 1
            elif self._block_tokens(cached_id) == tokens and parent_serials[cached_id] == parent_serial:
                # the key is taken, so ours stays unregistered: by the same prefix
                # (another request computed it too), whose serial we share, ...
                serial = serials[cached_id]
            else:
                # ... or by a collision, and then our prefix gets a serial nobody can match
                serial = next_serial
                next_serial += 1
            parent_hash, parent_serial = h, serial
        self._next_serial = next_serial
        return ChainEnd(end, parent_hash, parent_serial)

    def _first_private(self, request: Request) -> int | None:
        """The request's first private block (Request.private_from), None where it has none."""
        return None if request.private_from is None else request.private_from // self.block_size

    def _commit_private(self, rid: str, table: list[int], start: int, end: int, first: int) -> None:
        """Mark the request's private blocks [start, end) committed: PRIVATE, with
        the serial its private run's blocks share (kept across preemptions)."""
        run = self._parked.run(rid)
        if run is None:
            run = Run(first, self._next_serial)
            self._parked.start(rid, run)
            self._next_serial += 1
        serial = run.serial
        hashes, serials = self._hashes, self._serials
        for block_id in table[start:end]:
            hashes[block_id] = PRIVATE
            serials[block_id] = serial

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: unreferenced ones return to the free list,
        referenced ones stay with their requests but can no longer be matched."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        for block_id in self._hash_to_block.values():
            self._hashes[block_id] = self._token_chunks[block_id] = None
        self._hash_to_block.clear()
        hashes = self._hashes
        for block_id, h in enumerate(hashes):
            if h == PRIVATE:
                hashes[block_id] = None
        self._parked.clear()

    def _block_tokens(self, block_id: int) -> bytes:
        """A registered block's token ids, as the bytes it was hashed from."""
        nbytes = 8 * self.block_size
        start = self._token_index[block_id] * nbytes
        return self._token_chunks[block_id][start:start + nbytes]

    # ---- allocation ------------------------------------------------------------
    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's block table to hold `num_tokens` tokens in total.
        Returns False, changing nothing, when there are not enough blocks."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            table = self._tables[rid] = []
            self._chains[rid] = CHAIN_START
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return True
        free = self._free
        if need > len(free) + len(self._evictable):
            return False
        if need <= len(free):
            new = [free.popleft() for _ in range(need)]
        else:
            new = list(free)
            free.clear()
            new += self._evict(need - len(new))
        ref_counts = self._ref_counts
        for block_id in new:
            ref_counts[block_id] = 1
        table += new
        return True

    def _evict(self, n: int) -> list[int]:
        """Take the n least recently released cached blocks out of the cache."""
        evicted = self._evictable.pop_oldest(n)
        hash_to_block, hashes, token_chunks = self._hash_to_block, self._hashes, self._token_chunks
        for block_id in evicted:
            h = hashes[block_id]
            if h != PRIVATE:
                del hash_to_block[h]
            hashes[block_id] = token_chunks[block_id] = None
        return evicted

    def free(self, request_id: str) -> None:
        """Drop the request's references. Hashed and private blocks reaching ref 0
        stay cached (most recently released last), the private ones parked under
        the request's id; the rest return to the free list. Freeing an unknown
        id does nothing."""
        table = self._tables.pop(request_id, None)
        chain = self._chains.pop(request_id, None)
        self._parked.release(request_id, table or [], chain.num_blocks if chain else 0, self._marked)
        if not table:
            return
        ref_counts, hashes, free, cached = self._ref_counts, self._hashes, self._free, []
        # release the tail first so a prompt's later blocks are evicted before
        # its earlier ones: evicting an early block strands the rest of the chain
        for block_id in reversed(table):
            ref = ref_counts[block_id] - 1
            ref_counts[block_id] = ref
            if not ref:
                (free if hashes[block_id] is None else cached).append(block_id)
        self._evictable.extend(cached)

    # ---- checking ----------------------------------------------------------------
    def check_invariants(self) -> None:
        """O(num_blocks + table sizes); for tests. Raises AssertionError."""
        assert self._chains.keys() == self._tables.keys(), "block tables and hash chains name different requests"
        refs = [0] * self.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {rid} holds a block twice: {table}"
            assert self._chains[rid].num_blocks <= len(table), f"request {rid} has more hashes than blocks"
            for block_id in table:
                refs[block_id] += 1
        self._evictable.check()
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, f"blocks both free and cached: {free & evictable}"
        for bid in range(self.num_blocks):
            ref_count, h = self._ref_counts[bid], self._hashes[bid]
            assert ref_count >= 0, f"block {bid} has ref_count {ref_count}"
            assert ref_count == refs[bid], f"block {bid}: ref_count {ref_count} but {refs[bid]} block tables hold it"
            if bid in free:
                assert ref_count == 0 and h is None, f"free block {bid} is referenced or hashed"
            elif bid in evictable:
                assert ref_count == 0, f"cached block {bid} is in the evictable set while referenced"
                assert h is not None, f"evictable block {bid} has no hash"
            else:
                assert ref_count > 0, f"block {bid} is in no state: not free, cached nor referenced"
            if h is not None and h != PRIVATE:
                assert self._hash_to_block.get(h) == bid, f"block {bid}'s hash is not registered to it"
        serials = []
        for h, bid in self._hash_to_block.items():
            assert self._hashes[bid] == h, f"hash {h:#x} maps to block {bid} which holds another hash"
            assert self._token_chunks[bid] is not None and len(self._block_tokens(bid)) == 8 * self.block_size, \
                f"cached block {bid} has no token ids"
            assert ROOT_SERIAL <= self._parent_serials[bid] < self._serials[bid] < self._next_serial, \
                f"block {bid}'s serials"
            serials.append(self._serials[bid])
        assert len(set(serials)) == len(serials), "two cached blocks share a prefix serial"
        for rid, chain in self._chains.items():
            assert chain.serial < self._next_serial, f"request {rid}'s chain ends at an unissued serial"
        assert self._parked.holders() <= self._tables.keys(), "a request without blocks has private blocks"
        for bid in range(self.num_blocks):
            if self._hashes[bid] == PRIVATE:
                assert ROOT_SERIAL < self._serials[bid] < self._next_serial, f"private block {bid}'s serial"
