"""BlockManager: exact block ids on tiny caches, prefix hits and collisions,
LRU eviction, and a hypothesis state machine that checks the invariants and
the content of every reused block after each operation."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from testbed.block_keys import ROOT_HASH
from testbed.block_manager import BlockManager
from testbed.request import Request

from block_steps import ConstantHash, compute, req  # noqa: E402  (tests/ on sys.path: conftest)


# ---- allocation, exact ids -------------------------------------------------------
def test_allocate_grow_free_exact_block_ids():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = req("a", range(5)), req("b", range(4))
    assert bm.blocks_needed(a, 5) == 2
    assert bm.allocate(a, 5) and bm.block_table("a") == [0, 1]
    assert bm.allocate(b, 4) and bm.block_table("b") == [2]
    assert bm.blocks_needed(a, 8) == 0 and bm.allocate(a, 8) and bm.block_table("a") == [0, 1]
    assert bm.allocate(a, 9) and bm.block_table("a") == [0, 1, 3]
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 4
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    bm.check_invariants()

    bm.free("a")
    assert bm.block_table("a") == [] and bm.num_free_blocks == 7
    assert [bm.ref_count(i) for i in range(8)] == [0, 0, 1, 0, 0, 0, 0, 0]
    bm.free("a")  # idempotent
    bm.free("never-seen")
    assert bm.num_free_blocks == 7
    # never-used blocks first, then the freed ones, tail of the table first
    c = req("c", range(28))
    assert bm.allocate(c, 28) and bm.block_table("c") == [4, 5, 6, 7, 3, 1, 0]
    bm.check_invariants()
    bm.free("b"), bm.free("c")
    assert bm.all_free() and bm.num_free_blocks == 8


def test_allocate_when_short_returns_false_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = req("a", range(9)), req("b", range(9))
    assert bm.allocate(a, 9) and bm.block_table("a") == [0, 1, 2]
    assert bm.can_allocate(b, 4) and not bm.can_allocate(b, 5)
    assert not bm.allocate(b, 5)
    assert bm.block_table("b") == [] and bm.block_table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 1 and bm.ref_count(3) == 0
    assert not bm.allocate(a, 17)  # growing an existing table: same rule
    assert bm.block_table("a") == [0, 1, 2] and bm.num_free_blocks == 1
    bm.check_invariants()
    assert bm.allocate(a, 16) and bm.block_table("a") == [0, 1, 2, 3]
    bm.free("a"), bm.free("b")
    assert bm.all_free()


def test_block_table_is_live():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", range(3))
    assert bm.block_table("a") == []
    bm.allocate(a, 2)
    table = bm.block_table("a")
    bm.allocate(a, 3)
    assert table == [0, 1] and table is bm.block_table("a")


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_blocks=0), "num_kv_blocks"),
    (dict(num_blocks=-3), "num_kv_blocks"),
    (dict(num_blocks=4, block_size=0), "block_size"),
])
def test_bad_sizes_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"{field}: must be >= 1"):
        BlockManager(**kwargs)


# ---- prefix caching ---------------------------------------------------------------
def test_shared_prefix_reuses_the_same_blocks():
    bm = BlockManager(num_blocks=10, block_size=16)
    a = req("a", range(40))
    compute(bm, a, 40)
    assert bm.block_table("a") == [0, 1, 2] and bm.num_cached_blocks() == 2
    b = req("b", list(range(32)) + list(range(900, 910)))
    assert bm.match_prefix(b) == 32
    assert bm.block_table("b") == [0, 1]
    assert [bm.ref_count(i) for i in range(3)] == [2, 2, 1]
    assert bm.allocate(b, 42) and bm.block_table("b") == [0, 1, 3]
    bm.check_invariants()
    bm.free("a")
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    assert bm.num_free_blocks == 7  # block 2 was never full: back to the free list
    bm.free("b")
    assert bm.all_free() and bm.num_free_blocks == 10 and bm.num_cached_blocks() == 2
    # a cached-but-unreferenced block comes back on a hit and stops being free
    c = req("c", list(range(16)) + [7])
    assert bm.match_prefix(c) == 16 and bm.block_table("c") == [0]
    assert bm.num_free_blocks == 9
    bm.check_invariants()
    bm.free("c")
    assert bm.all_free()


def test_identical_prompt_leaves_last_token_uncovered():
    bm = BlockManager(num_blocks=8, block_size=16)
    compute(bm, req("a", range(32)), 32)
    assert bm.num_cached_blocks() == 2
    same = req("same", range(32))
    assert bm.match_prefix(same) == 16 and bm.block_table("same") == [0]
    # computing the rest lands in a new block whose content is already cached:
    # it stays unregistered and the original keeps the key
    compute(bm, same, 32)
    assert bm.block_table("same") == [0, 2] and bm.num_cached_blocks() == 2
    one_more = req("one_more", list(range(32)) + [5])
    assert bm.match_prefix(one_more) == 32 and bm.block_table("one_more") == [0, 1]
    shorter = req("shorter", range(16))
    assert bm.match_prefix(shorter) == 0
    bm.check_invariants()
    for rid in ("a", "same", "one_more", "shorter"):
        bm.free(rid)
    assert bm.all_free()


def test_match_prefix_needs_a_request_without_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", range(5))
    bm.allocate(a, 2)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.match_prefix(a)


def test_outputs_are_cached_too():
    """A block filled partly by generated tokens is hashed over prompt+outputs."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", range(6))
    compute(bm, a, 6)
    a.output_token_ids += [50, 51, 52]
    compute(bm, a, 9)
    assert bm.num_cached_blocks() == 2
    b = req("b", [0, 1, 2, 3, 4, 5, 50, 51, 52])
    assert bm.match_prefix(b) == 8 and bm.block_table("b") == bm.block_table("a")[:2]
    assert bm.match_prefix(req("c", [0, 1, 2, 3, 4, 5, 50, 99, 52])) == 4


def test_collision_cannot_loop_a_chain_onto_itself():
    bm = ConstantHash(num_blocks=6, block_size=2)
    compute(bm, req("a", [0, 0, 0, 0, 0]), 5)   # block 1's key and parent's key equal block 0's
    assert bm.num_cached_blocks() == 1
    b = req("b", [0, 0, 0, 0, 0])
    assert bm.match_prefix(b) == 2 and bm.block_table("b") == [0]
    bm.check_invariants()


class ParentBlindHash(BlockManager):
    """Keys ignore the parent, so equal blocks in different chains collide."""
    def hash_block(self, parent_hash, tokens):
        return hash(tokens)


def test_hash_collision_is_rejected_by_token_ids():
    bm = ConstantHash(num_blocks=6, block_size=4)
    a = req("a", range(5))
    compute(bm, a, 5)
    assert bm.num_cached_blocks() == 1
    b = req("b", range(100, 105))
    assert bm.match_prefix(b) == 0 and bm.block_table("b") == []
    compute(bm, b, 5)  # its block collides on commit: left unregistered
    assert bm.num_cached_blocks() == 1
    assert bm.match_prefix(req("c", range(5))) == 4  # the real hit still works
    bm.check_invariants()


def test_hash_collision_with_another_parent_is_rejected():
    bm = ParentBlindHash(num_blocks=12, block_size=4)
    t = [10, 11, 12, 13]
    compute(bm, req("a", [0, 1, 2, 3] + t + [9]), 9)      # registers key(t) with parent key(a-block)
    compute(bm, req("b", [5, 6, 7, 8] + t + [9]), 9)      # key(t) taken: b's second block unregistered
    assert bm.num_cached_blocks() == 3
    c = req("c", [5, 6, 7, 8] + t + [9])
    # block 0 hits b's block; block 1's key finds a's block, same tokens, wrong parent
    assert bm.match_prefix(c) == 4 and bm.block_table("c") == bm.block_table("b")[:1]
    bm.check_invariants()


def test_commit_hashes_only_new_full_blocks():
    calls = []

    class Counting(BlockManager):
        def hash_block(self, parent_hash, tokens):
            calls.append(tuple(np.frombuffer(tokens, dtype="<i8").tolist()))
            return super().hash_block(parent_hash, tokens)

    bm = Counting(num_blocks=8, block_size=4)
    a = req("a", range(11))
    compute(bm, a, 9)
    assert calls == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for n in (9, 10, 11):
        compute(bm, a, n)
    assert len(calls) == 2
    a.output_token_ids.append(99)
    compute(bm, a, 12)
    assert calls[2:] == [(8, 9, 10, 99)]


def test_commit_after_free_is_a_no_op():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a", range(9))
    compute(bm, a, 9)
    bm.free("a")
    bm.commit(a)                  # an engine may commit a request it just finished
    bm.commit(req("never", range(3)))
    bm.check_invariants()
    assert bm.block_table("a") == [] and bm.all_free() and bm.num_cached_blocks() == 2


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    compute(bm, req("a", range(9)), 9)
    assert bm.num_cached_blocks() == 0
    assert bm.match_prefix(req("b", range(9))) == 0
    bm.free("a")
    bm.free("b")
    assert bm.all_free() and bm.num_free_blocks == 4
    bm.check_invariants()


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute(bm, req("a", range(9)), 9)
    compute(bm, req("b", range(20, 29)), 9)
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks() == 0 and bm.num_free_blocks == 5
    assert bm.match_prefix(req("a2", range(9))) == 0
    assert bm.match_prefix(req("b2", range(20, 29))) == 0
    bm.check_invariants()
    bm.free("b")
    bm.free("a2")
    bm.free("b2")
    assert bm.all_free() and bm.num_cached_blocks() == 0
    bm.check_invariants()


# ---- LRU eviction -------------------------------------------------------------------
def test_lru_evicts_least_recently_released_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = req("a", range(5)), req("b", range(10, 15))
    compute(bm, a, 5)
    compute(bm, b, 5)
    assert bm.block_table("a") == [0, 1] and bm.block_table("b") == [2, 3]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks() == 2
    # truly free blocks (1, 3) go first, then the cached block released first (0)
    c = req("c", range(100, 112))
    assert bm.allocate(c, 12) and bm.block_table("c") == [1, 3, 0]
    assert bm.num_cached_blocks() == 1
    assert bm.match_prefix(req("a2", range(5))) == 0
    assert bm.match_prefix(req("b2", range(10, 15))) == 4 and bm.block_table("b2") == [2]
    bm.check_invariants()


def test_cached_block_in_use_is_never_evicted():
    bm = BlockManager(num_blocks=3, block_size=4)
    compute(bm, req("a", range(5)), 5)
    bm.free("a")
    holder = req("holder", range(5))
    assert bm.match_prefix(holder) == 4 and bm.block_table("holder") == [0]
    assert bm.num_free_blocks == 2
    big = req("big", range(50, 62))
    assert not bm.can_allocate(big, 12) and not bm.allocate(big, 12)
    assert bm.allocate(big, 8) and bm.block_table("big") == [2, 1]
    assert bm.num_cached_blocks() == 1 and bm.block_table("holder") == [0]
    bm.check_invariants()


def test_tail_blocks_evicted_before_head_and_hits_refresh_recency():
    bm = BlockManager(num_blocks=6, block_size=2)
    compute(bm, req("a", range(7)), 7)      # blocks 0,1,2 full and cached, 3 partial
    compute(bm, req("b", range(50, 53)), 3)  # block 4 cached, 5 partial
    bm.free("a")
    bm.free("b")
    # LRU order: a's tail first (2, 1, 0), then b's block 4; blocks 3 and 5 are free
    hit = req("hit", [0, 1, 9])              # touches block 0: no longer the oldest
    assert bm.match_prefix(hit) == 2 and bm.block_table("hit") == [0]
    bm.free("hit")                           # LRU now 2, 1, 4, 0
    x = req("x", range(100, 108))
    assert bm.allocate(x, 8) and bm.block_table("x") == [3, 5, 2, 1]
    assert bm.match_prefix(req("a2", range(7))) == 2          # block 0 survived, 1 and 2 did not
    assert bm.match_prefix(req("b2", range(50, 53))) == 2      # block 4 survived
    bm.check_invariants()


def test_eviction_queue_keeps_release_order():
    from testbed.eviction_queue import EvictionQueue
    q = EvictionQueue(6)
    q.extend([3, 1, 4])
    q.extend([0, 5])
    q.remove(4)                                   # revived by a prefix hit
    q.check()
    assert list(q) == [3, 1, 0, 5] and len(q) == 4
    assert q.pop_oldest(2) == [3, 1] and list(q) == [0, 5]
    q.extend([4])
    q.remove(5)
    q.check()
    assert list(q) == [0, 4] and q.pop_oldest(2) == [0, 4] and len(q) == 0
    q.check()
    q.extend([2])
    q.clear()
    q.check()
    assert list(q) == []


# ---- state machine ---------------------------------------------------------------------
class BlockManagerMachine(RuleBasedStateMachine):
    """Random add / match / grow / decode / free sequences on a tiny cache.

    Alongside the manager it keeps a shadow KV cache: each slot holds the full
    token prefix whose last token was computed there (a token's KV depends on
    its whole prefix). A request's blocks must always hold exactly its own
    prefixes, which is what a prefix hit has to guarantee."""
    manager_cls = BlockManager
    BLOCK_SIZE = 2
    NUM_BLOCKS = 8

    @initialize(caching=st.booleans())
    def setup(self, caching):
        self.bm = self.manager_cls(self.NUM_BLOCKS, self.BLOCK_SIZE, enable_prefix_caching=caching)
        self.kv = [[None] * self.BLOCK_SIZE for _ in range(self.NUM_BLOCKS)]
        self.running: dict[str, Request] = {}
        self.n = 0

    def check_request_kv(self, r: Request) -> None:
        bs, table, tokens = self.BLOCK_SIZE, self.bm.block_table(r.request_id), r.all_token_ids()
        for p in range(r.num_computed_tokens):
            assert self.kv[table[p // bs]][p % bs] == tuple(tokens[: p + 1]), (r.request_id, p)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def add(self, tokens):
        r = Request(f"r{self.n}", tokens, max_tokens=3)
        self.n += 1
        hit = self.bm.match_prefix(r)
        assert hit % self.BLOCK_SIZE == 0 and hit < r.num_tokens
        assert len(self.bm.block_table(r.request_id)) == hit // self.BLOCK_SIZE
        r.num_computed_tokens = hit
        self.check_request_kv(r)
        self.running[r.request_id] = r

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data):
        """Compute a chunk (or one decode token); on a shortage, preempt."""
        r = data.draw(st.sampled_from(sorted(self.running.values(), key=lambda r: r.request_id)))
        if r.num_computed_tokens == r.num_tokens:
            if r.num_output_tokens >= r.max_tokens:
                return
            r.output_token_ids.append(data.draw(st.integers(0, 1)))
        k = data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens))
        end = r.num_computed_tokens + k
        before = (list(self.bm.block_table(r.request_id)), self.bm.num_free_blocks, self.bm.num_cached_blocks())
        fits = self.bm.can_allocate(r, end)
        assert self.bm.allocate(r, end) == fits
        if not fits:
            after = (list(self.bm.block_table(r.request_id)), self.bm.num_free_blocks, self.bm.num_cached_blocks())
            assert after == before
            self.bm.free(r.request_id)
            del self.running[r.request_id]
            return
        table, tokens = self.bm.block_table(r.request_id), r.all_token_ids()
        for p in range(r.num_computed_tokens, end):
            self.kv[table[p // self.BLOCK_SIZE]][p % self.BLOCK_SIZE] = tuple(tokens[: p + 1])
        r.num_computed_tokens = end
        self.bm.commit(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.bm.free(rid)
        self.bm.free(rid)
        del self.running[rid]

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        for r in self.running.values():
            self.check_request_kv(r)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for rid in list(self.running):
            self.bm.free(rid)
        self.bm.check_invariants()
        assert self.bm.all_free() and self.bm.num_free_blocks == self.NUM_BLOCKS


class CollidingBlockManager(BlockManager):
    """Few distinct keys, parent ignored: collisions on most commits."""
    def hash_block(self, parent_hash, tokens):
        return sum(np.frombuffer(tokens, dtype="<i8").tolist()) % 3


class CollidingMachine(BlockManagerMachine):
    manager_cls = CollidingBlockManager


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCollidingMachine = CollidingMachine.TestCase
TestCollidingMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_root_hash_is_the_first_blocks_parent():
    bm = BlockManager(num_blocks=2, block_size=2)
    from testbed.block_keys import hash_block_tokens, token_bytes
    h0 = hash_block_tokens(ROOT_HASH, [1, 2])
    assert h0 == hash_block_tokens(ROOT_HASH, (1, 2)) == bm.hash_block(ROOT_HASH, token_bytes([1, 2]))
    assert token_bytes([1, 2]) == struct.pack("<2q", 1, 2)
    assert h0 != hash_block_tokens(h0, [1, 2]) and h0 != hash_block_tokens(ROOT_HASH, [2, 1])
    compute(bm, req("a", [1, 2, 3]), 3)
    assert bm.match_prefix(req("b", [1, 2, 3])) == 2
