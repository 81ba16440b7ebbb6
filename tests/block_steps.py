"""What the block-manager tests share: requests, the engine's step around a
block manager, and a manager whose keys always collide."""
from __future__ import annotations

from testbed.block_keys import ROOT_HASH
from testbed.block_manager import BlockManager
from testbed.request import Request


def req(rid: str, tokens, max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), max_tokens=max_tokens)


def compute(bm: BlockManager, r: Request, upto: int) -> None:
    """What the engine does around a step: grow, compute, commit."""
    assert bm.allocate(r, upto)
    r.num_computed_tokens = upto
    bm.commit(r)


class ConstantHash(BlockManager):
    """Every block gets the same key, the root's own: collisions we cannot
    cause with xxh3, including a chain that loops back to its first block."""
    def hash_block(self, parent_hash, tokens):
        return ROOT_HASH
