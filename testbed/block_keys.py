"""Block keys: the chained 64-bit key of each full block of a token sequence,
torch-free. The BlockManager registers blocks under them (testbed/block_manager.py),
and the KV store and the cache-aware router name blocks by them (modes/kvstore.py,
modes/cache_aware.py), so every process names a block alike.

A block's key is xxh3 of its token ids as little-endian int64, seeded with its
parent block's key (the first block's parent is ROOT_HASH): one key names the
whole prefix the block ends.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from testbed.request import Request

# The "parent" of a prompt's first block: the seed of its key.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained 64-bit key of one full block: xxh3 of the token ids as
    little-endian int64, seeded with the parent's key (chaining without building
    a parent+tokens buffer). Deterministic across processes and machines, so a
    KV store shared by workers can use the same keys."""
    return xxhash.xxh3_64_intdigest(token_bytes(token_ids), parent_hash)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the little-endian int64 bytes that block keys hash."""
    return np.asarray(token_ids, dtype="<i8").tobytes()


def prefix_block_keys(request: Request, block_size: int, num_blocks: int) -> list[int]:
    """The chained keys of the request's first `num_blocks` full blocks: the
    hashes a BlockManager's `commit` registers them under, so a KV store shared
    by workers (modes/kvstore.py) names a block exactly as every block manager does."""
    data = token_bytes(request.token_array(0, num_blocks * block_size))
    nbytes, keys, h = 8 * block_size, [], ROOT_HASH
    digest = xxhash.xxh3_64_intdigest
    for off in range(0, num_blocks * nbytes, nbytes):
        h = digest(data[off:off + nbytes], h)
        keys.append(h)
    return keys
