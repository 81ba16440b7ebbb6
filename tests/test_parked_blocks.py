"""Private blocks (testbed/parked_blocks.py): a request's blocks no other request
can hold are marked, not hashed, and found again by its id after a preemption;
a hypothesis state machine holds a manager told where prompts turn private
against one that hashes everything."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from testbed.block_manager import BlockManager
from testbed.request import Request

from block_steps import ConstantHash, compute, req  # noqa: E402  (tests/ on sys.path: conftest)


def test_a_private_request_hashes_nothing_and_takes_its_blocks_back_after_a_preemption():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = Request("r", list(range(10)), max_tokens=4, private_from=0)
    compute(bm, r, 10)
    assert bm.num_cached_blocks() == 0                    # nothing hashed: no other request could match them
    table = list(bm.block_table("r"))
    bm.free("r")
    assert bm.num_free_blocks == 8 and bm.all_free()
    r.reset_for_recompute()
    assert bm.match_prefix(r) == 8 and bm.block_table("r") == table[:2]   # its two full blocks, not the last token
    bm.check_invariants()
    other = Request("o", list(range(10)), max_tokens=4, private_from=0)   # (a workload never repeats a private prompt)
    assert bm.match_prefix(other) == 0


def test_a_parked_block_evicted_or_reused_is_not_taken_back():
    bm = BlockManager(num_blocks=4, block_size=2)
    r = Request("r", [1, 2, 3, 4, 5, 6, 7], max_tokens=2, private_from=2)   # block 0 hashed, blocks 1-2 private
    compute(bm, r, 7)
    bm.free("r")
    # another private request takes two blocks: the oldest released, r's tail (block 2) and block 0's free one
    o = Request("o", [9, 9, 9, 9], max_tokens=2, private_from=0)
    compute(bm, o, 4)
    r.reset_for_recompute()
    assert bm.match_prefix(r) == 4                        # block 0 by hash, block 1 from the park, block 2 gone
    bm.check_invariants()
    bm.free("r")
    bm.free("o")
    o2 = Request("o2", [8] * 8, max_tokens=2, private_from=0)
    compute(bm, o2, 8)                                    # every block reused, marked with o2's serial
    r.reset_for_recompute()
    assert bm.match_prefix(r) == 0
    bm.check_invariants()


def test_parked_blocks_are_taken_back_only_after_the_whole_hashed_head():
    """A head block left unregistered (its key taken by other content: a collision)
    is not cached, so the chain breaks there: the private blocks parked after it
    are out of reach, as they would be by hash."""
    bm = ConstantHash(num_blocks=6, block_size=2)
    compute(bm, req("a", [5, 5, 5]), 3)                  # takes the one key
    r = Request("r", [1, 2, 3, 4, 5], max_tokens=2, private_from=2)
    compute(bm, r, 5)
    bm.free("r")
    r.reset_for_recompute()
    assert bm.match_prefix(r) == 0
    bm.check_invariants()


def test_parks_are_dropped_once_their_blocks_are_evicted():
    """A run of private requests through a small cache keeps a park only while
    one of its blocks is still cached: never more parks than cached blocks."""
    bm = BlockManager(num_blocks=6, block_size=2)
    for i in range(40):
        r = Request(f"r{i}", [i * 10 + k for k in range(5)], max_tokens=2, private_from=0)
        compute(bm, r, 5)
        bm.free(r.request_id)
        parks = bm._parked._parks
        assert 1 <= len(parks) <= len(bm._evictable)             # each park's first block is cached
        assert all(bm._marked(p.blocks[0], p.run.serial) for p in parks.values())
    bm.check_invariants()


def test_reset_prefix_cache_forgets_parked_and_private_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = (Request(rid, [i + 10 * k for i in range(6)], max_tokens=2, private_from=0) for k, rid in enumerate("ab"))
    compute(bm, a, 6)
    compute(bm, b, 6)
    bm.free("a")
    bm.reset_prefix_cache()
    bm.free("b")                                          # committed before the reset: not cached
    assert len(bm._free) == 8
    for r in (a, b):
        r.reset_for_recompute()
        assert bm.match_prefix(r) == 0
    bm.check_invariants()


class PrivateBlocksMachine(RuleBasedStateMachine):
    """The same requests on two managers, one told where each prompt turns
    private (a shared head, then tokens no other request has) and one not:
    every prefix hit, block table, free count and the LRU order agree, through
    preemptions, re-admissions and evictions on a tiny cache."""
    BLOCK_SIZE = 2
    NUM_BLOCKS = 10
    HEADS = ([], [0, 1], [0, 1, 0, 1], [1, 1, 0])

    @initialize()
    def setup(self):
        self.managers = (BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE), BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE))
        self.running: dict[str, tuple[Request, Request]] = {}
        self.waiting: dict[str, tuple[Request, Request]] = {}
        self.n = 0

    def admit(self, pair: tuple[Request, Request]) -> None:
        hits = [bm.match_prefix(r) for bm, r in zip(self.managers, pair)]
        assert hits[0] == hits[1], hits
        for r in pair:
            r.num_computed_tokens = hits[0]
        self.running[pair[0].request_id] = pair

    @rule(head=st.integers(0, 3), tail=st.integers(1, 5))
    def add(self, head, tail):
        prompt = list(self.HEADS[head]) + [100 + 10 * self.n + i for i in range(tail)]
        rid = f"r{self.n}"
        self.n += 1
        self.admit((Request(rid, prompt, max_tokens=3), Request(rid, prompt, 3, private_from=len(self.HEADS[head]))))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data):
        """A chunk (or one decode token) on both; a shortage preempts on both."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        pair = self.running[rid]
        r = pair[0]
        if r.num_computed_tokens == r.num_tokens:
            if r.num_output_tokens >= r.max_tokens:
                return
            token = data.draw(st.integers(0, 1))
            for q in pair:
                q.output_token_ids.append(token)
        end = r.num_computed_tokens + data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens))
        fits = [bm.allocate(q, end) for bm, q in zip(self.managers, pair)]
        assert fits[0] == fits[1]
        for bm, q in zip(self.managers, pair):
            if fits[0]:
                q.num_computed_tokens = end
                bm.commit(q)
            else:
                bm.free(rid)
                q.reset_for_recompute()
        if not fits[0]:
            self.waiting[rid] = self.running.pop(rid)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data):
        self.admit(self.waiting.pop(data.draw(st.sampled_from(sorted(self.waiting)))))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        for bm in self.managers:
            bm.free(rid)
        del self.running[rid]

    @invariant()
    def managers_agree(self):
        if not hasattr(self, "managers"):
            return
        hashed, private = self.managers
        for rid in self.running:
            assert hashed.block_table(rid) == private.block_table(rid), rid
        assert list(hashed._free) == list(private._free) and list(hashed._evictable) == list(private._evictable)
        for bm in self.managers:
            bm.check_invariants()


TestPrivateBlocksMachine = PrivateBlocksMachine.TestCase
TestPrivateBlocksMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
