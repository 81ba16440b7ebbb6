"""BlockManager: the paged KV cache's bookkeeping, torch-free (DESIGN.md, "Paged KV cache").

The scheduler asks it whether a request fits (`can_allocate`), grows the
request's block table before each step (`allocate`), and after the step
registers the blocks that filled up (`commit`) so that a later request with the
same prefix reuses them (`match_prefix`). The executor only reads the block
tables; it owns the KV tensors `[num_layers, 2, num_blocks, block_size, ...]`
that the block ids index. When a request finishes, aborts or is preempted the
engine calls `free`.

Every block is in exactly one of three states:
- free: on the free list, holds nothing worth keeping;
- used: referenced by one or more block tables (ref_count > 0);
- cached: unreferenced but holding a full, hashed block of KV; it stays
  findable by prefix hash until evicted, least recently released first.
Free and cached blocks both count as available (`num_free_blocks`); allocation
takes truly free blocks first and evicts cached ones only when it must.

A full block's key is chained: hash(parent block's hash, its token ids), so
one dict lookup per block walks a prompt's prefix. A hit is then verified
exactly, never trusting the hash: each registered block gets a serial number
(never reused) naming the exact token prefix it ends, and it stores its own
token ids (as the bytes it hashed) and its parent's serial; a lookup compares
both against the block matched just before. By induction a matched chain holds exactly the request's
prefix, so a collision (even one that makes a chain loop back on itself) is a
miss, never wrong KV.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from testbed.request import Request

# The "parent" of a prompt's first block: the seed of its hash and its serial.
ROOT_HASH = 0
ROOT_SERIAL = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained 64-bit key of one full block: xxh3 of the token ids as
    little-endian int64, seeded with the parent's key (chaining without building
    a parent+tokens buffer). Deterministic across processes and machines, so a
    KV store shared by workers can use the same keys."""
    return xxhash.xxh3_64_intdigest(token_bytes(token_ids), parent_hash)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the little-endian int64 bytes that block keys hash."""
    return np.asarray(token_ids, dtype="<i8").tobytes()


class NoFreeBlocks(RuntimeError):
    """Raised by callers that cannot proceed without blocks (the BlockManager
    itself reports a shortage by returning False)."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # set while the block is registered in the prefix cache
    hash: int | None = None
    serial: int | None = None          # names the exact token prefix this block ends
    parent_serial: int | None = None
    tokens: bytes | None = None         # its token ids, little-endian int64


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
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        # unreferenced cached blocks, least recently released first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self._tables: dict[str, list[int]] = {}
        # (chain hash, prefix serial) of each request's committed full blocks,
        # kept even for blocks left unregistered (their content was already
        # cached in another block) so the chain continues past them
        self._chains: dict[str, list[tuple[int, int]]] = {}
        self._next_serial = ROOT_SERIAL + 1

    def hash_block(self, parent_hash: int, tokens: bytes) -> int:
        """hash_block_tokens of one full block given as its bytes (what the
        prefix walk slices out of one fetch of the request's tokens)."""
        return xxhash.xxh3_64_intdigest(tokens, parent_hash)

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
        return self._blocks[block_id].ref_count

    def block_table(self, request_id: str) -> list[int]:
        """The live block table (not a copy); [] for a request holding none."""
        return self._tables.get(request_id, [])

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Extra blocks `request` needs to hold `num_tokens` tokens in total."""
        table = self._tables.get(request.request_id)
        need = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        return need if need > 0 else 0

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
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
        chain = self._chains.setdefault(rid, [])
        num_full = (request.num_tokens - 1) // self.block_size
        if not num_full or not self._hash_to_block:
            return 0
        data = token_bytes(request.token_array(0, num_full * self.block_size))
        nbytes = 8 * self.block_size
        parent_hash, parent_serial = ROOT_HASH, ROOT_SERIAL
        for off in range(0, len(data), nbytes):
            tokens = data[off:off + nbytes]
            h = self.hash_block(parent_hash, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.tokens != tokens or block.parent_serial != parent_serial:
                break  # hash collision: different content under the same key
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
            table.append(block_id)
            parent_hash, parent_serial = h, block.serial
            chain.append((h, parent_serial))
        return len(table) * self.block_size

    def commit(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens.
        Cheap when no block filled since the last call."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        chain = self._chains.get(rid)
        if chain is None:
            return  # holds no blocks: never allocated, or already freed this step
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        done = len(chain)
        if num_full <= done:
            return
        table = self._tables[rid]
        if num_full > len(table):
            raise AssertionError(f"commit: request {rid} has {request.num_computed_tokens} computed tokens "
                                 f"but only {len(table)} blocks of {bs}")
        parent_hash, parent_serial = chain[-1] if chain else (ROOT_HASH, ROOT_SERIAL)
        # one fetch for every block that filled, sliced per block as bytes: the
        # hot path of a simulated run with prefix caching (no tuple, no packing)
        data = token_bytes(request.token_array(done * bs, num_full * bs))
        nbytes = 8 * bs
        blocks, hash_to_block, hash_block = self._blocks, self._hash_to_block, self.hash_block
        for i in range(done, num_full):
            off = (i - done) * nbytes
            tokens = data[off:off + nbytes]
            h = hash_block(parent_hash, tokens)
            cached_id = hash_to_block.get(h)
            if cached_id is None:
                block = blocks[table[i]]
                block.hash, block.tokens, block.parent_serial = h, tokens, parent_serial
                block.serial = serial = self._next_serial
                self._next_serial += 1
                hash_to_block[h] = block.block_id
            else:
                # the key is taken, so ours stays unregistered: by the same prefix
                # (another request computed it too), whose serial we share, or by
                # a collision, and then our prefix gets a serial nobody can match
                cached = blocks[cached_id]
                if cached.tokens == tokens and cached.parent_serial == parent_serial:
                    serial = cached.serial
                else:
                    serial = self._next_serial
                    self._next_serial += 1
            chain.append((h, serial))
            parent_hash, parent_serial = h, serial

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: unreferenced ones return to the free list,
        referenced ones stay with their requests but can no longer be matched."""
        for block_id in self._evictable:
            self._clear_hash(self._blocks[block_id])
            self._free.append(block_id)
        self._evictable.clear()
        for block_id in self._hash_to_block.values():
            self._clear_hash(self._blocks[block_id])
        self._hash_to_block.clear()

    # ---- allocation ------------------------------------------------------------
    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's block table to hold `num_tokens` tokens in total.
        Returns False, changing nothing, when there are not enough blocks."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            table = self._tables[rid] = []
            self._chains[rid] = []
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return True
        free = self._free
        if need > len(free) + len(self._evictable):
            return False
        blocks = self._blocks
        from_free = min(need, len(free))
        for _ in range(from_free):
            block_id = free.popleft()
            blocks[block_id].ref_count = 1
            table.append(block_id)
        if need > from_free:
            # evict the least recently released cached blocks
            evict, hash_to_block = self._evictable.popitem, self._hash_to_block
            for _ in range(need - from_free):
                block_id, _ = evict(last=False)
                block = blocks[block_id]
                del hash_to_block[block.hash]
                block.hash = block.serial = block.parent_serial = block.tokens = None
                block.ref_count = 1
                table.append(block_id)
        return True

    def free(self, request_id: str) -> None:
        """Drop the request's references. Hashed blocks reaching ref 0 stay
        cached (most recently released last); the rest return to the free list.
        Freeing an unknown id does nothing."""
        table = self._tables.pop(request_id, None)
        self._chains.pop(request_id, None)
        if not table:
            return
        blocks = self._blocks
        # release the tail first so a prompt's later blocks are evicted before
        # its earlier ones: evicting an early block strands the rest of the chain
        for block_id in reversed(table):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    @staticmethod
    def _clear_hash(block: Block) -> None:
        block.hash = block.serial = block.parent_serial = block.tokens = None

    # ---- checking ----------------------------------------------------------------
    def check_invariants(self) -> None:
        """O(num_blocks + table sizes); for tests. Raises AssertionError."""
        refs = [0] * self.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {rid} holds a block twice: {table}"
            assert len(self._chains.get(rid, ())) <= len(table), f"request {rid} has more hashes than blocks"
            for block_id in table:
                refs[block_id] += 1
        assert self._chains.keys() == self._tables.keys(), "block tables and hash chains name different requests"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, f"blocks both free and cached: {free & evictable}"
        for block in self._blocks:
            bid = block.block_id
            assert block.ref_count >= 0, f"block {bid} has ref_count {block.ref_count}"
            assert block.ref_count == refs[bid], \
                f"block {bid}: ref_count {block.ref_count} but {refs[bid]} block tables hold it"
            if bid in free:
                assert block.ref_count == 0 and block.hash is None, f"free block {bid} is referenced or hashed"
            elif bid in evictable:
                assert block.ref_count == 0, f"cached block {bid} is in the evictable set while referenced"
                assert block.hash is not None, f"evictable block {bid} has no hash"
            else:
                assert block.ref_count > 0, f"block {bid} is in no state: not free, cached nor referenced"
            if block.hash is not None:
                assert self._hash_to_block.get(block.hash) == bid, f"block {bid}'s hash is not registered to it"
        serials = []
        for h, bid in self._hash_to_block.items():
            block = self._blocks[bid]
            assert block.hash == h, f"hash {h:#x} maps to block {bid} which holds another hash"
            assert block.serial is not None and block.parent_serial is not None and block.tokens is not None
            assert ROOT_SERIAL <= block.parent_serial < block.serial < self._next_serial, f"block {bid}'s serials"
            serials.append(block.serial)
        assert len(set(serials)) == len(serials), "two cached blocks share a prefix serial"
