"""The four scheduling policies on hand-built cases, with no model: the engine
runs over a null executor (instant; it samples a token that depends only on
the request and the position, so recomputation after a preemption must give
the same outputs). Asserts the exact slices of each iteration, the token
budget and max_num_seqs over random workloads, preemption by recompute
(newest first, counted, every block back at the end), aborts, and that each
policy's end-of-schedule() invariant check catches a broken batch."""
from __future__ import annotations

import random

import pytest

from testbed.batch import Batch, ScheduledSlice, StepResult
from testbed.block_manager import BlockManager
from testbed.engine import Engine, VirtualClock
from testbed.executor import Executor
from testbed.request import Request, RequestStatus
from testbed.schedulers import SCHEDULERS, SchedulerConfig, SchedulerContext, make_scheduler
from testbed.schedulers.sarathi import SarathiScheduler

BLOCK_SIZE = 4


class NullExecutor(Executor):
    """Instant forward pass that records the slices it was given; the sampled
    token is a function of (request, position) only."""
    kv_bytes_per_token = 0

    def __init__(self):
        self.batches: list[list[tuple[str, int]]] = []

    def execute(self, batch: Batch, on_layer_done=None) -> StepResult:
        self.batches.append([(s.request.request_id, s.num_tokens) for s in batch.slices])
        sampled = {s.request.request_id: token_at(s.request.request_id, s.end) for s in batch.slices if s.samples}
        return StepResult(sampled=sampled, duration_s=0.001)


class PerTokenPredictor:
    """A step-time predictor for the policies that need one: 10 µs per new token."""
    def iteration_time_s(self, slices, num_sampled=None) -> float:
        return 1e-5 * sum(q for q, _ in slices)


def context_for(policy: str, clock) -> SchedulerContext | None:
    return SchedulerContext(clock, 1000.0, 50.0, PerTokenPredictor()) if SCHEDULERS[policy].needs_predictor else None


def token_at(request_id: str, position: int) -> int:
    return (sum(map(ord, request_id)) * 31 + position) % 1000


def make_engine(policy: str, token_budget: int = 10, max_num_seqs: int = 8, num_blocks: int = 256,
                max_num_batched_tokens: int = 1000) -> Engine:
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    cfg = SchedulerConfig(token_budget=token_budget, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    clock = VirtualClock()
    return Engine(make_scheduler(policy, cfg, bm, context_for(policy, clock)), NullExecutor(), clock)


def req(rid: str, prompt_len: int, max_tokens: int = 10, first_token: int = 1) -> Request:
    return Request(rid, list(range(first_token, first_token + prompt_len)), max_tokens)


def step(engine: Engine) -> list[tuple[str, int]]:
    """One iteration; its slices as (request id, tokens), in schedule order."""
    assert engine.step() is not None, "nothing was scheduled"
    engine.bm.check_invariants()
    return engine.executor.batches[-1]


def expected_outputs(r: Request) -> list[int]:
    return [token_at(r.request_id, r.prompt_len + i) for i in range(r.max_tokens)]


# ---- exact batches, one policy at a time ------------------------------------------------

def test_sarathi_decodes_first_then_chunks_into_the_leftover_budget():
    e = make_engine("sarathi", token_budget=10)
    for r in (req("a", 4), req("b", 4)):
        e.add_request(r)
    assert step(e) == [("a", 4), ("b", 4)]               # two whole short prompts; 2 tokens left unused
    e.add_request(req("c", 12, first_token=100))
    e.add_request(req("d", 12, first_token=200))
    e.add_request(req("f", 3, first_token=300))
    assert step(e) == [("a", 1), ("b", 1), ("c", 8)]     # decodes, then c's first chunk fills the 8 left
    assert step(e) == [("a", 1), ("b", 1), ("c", 4), ("d", 4)]   # c's last chunk, d's first; f waits (FCFS)
    assert step(e) == [("a", 1), ("b", 1), ("c", 1), ("d", 7)]   # c decodes now
    assert step(e) == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("f", 3)]
    assert e.scheduler.num_preemptions == 0


def test_sarathi_chunks_of_two_prompts_share_an_iteration():
    e = make_engine("sarathi", token_budget=16)
    e.add_request(req("x", 10, first_token=0))
    e.add_request(req("y", 10, first_token=100))
    e.add_request(req("z", 20, first_token=200))
    assert step(e) == [("x", 10), ("y", 6)]
    x, y = e.scheduler.running
    assert (y.num_computed_tokens, y.is_prefill, y.num_output_tokens) == (6, True, 0)
    assert step(e) == [("x", 1), ("y", 4), ("z", 11)]    # y's last chunk and z's first chunk
    z = e.scheduler.running[2]
    assert (x.num_output_tokens, y.num_output_tokens, z.num_computed_tokens) == (2, 1, 11)
    assert step(e) == [("x", 1), ("y", 1), ("z", 9)]


def test_sarathi_respects_max_num_seqs():
    e = make_engine("sarathi", token_budget=100, max_num_seqs=2)
    for rid in "abcd":
        e.add_request(req(rid, 5, max_tokens=2, first_token=ord(rid)))
    assert step(e) == [("a", 5), ("b", 5)]               # budget left, but only 2 may run
    assert step(e) == [("a", 1), ("b", 1)]               # both finish
    assert step(e) == [("c", 5), ("d", 5)]


def test_vllm_v0_prefill_only_iterations_pause_the_decodes():
    e = make_engine("vllm_v0", max_num_batched_tokens=20)
    for r in (req("a", 4), req("b", 4)):
        e.add_request(r)
    assert step(e) == [("a", 4), ("b", 4)]
    assert step(e) == [("a", 1), ("b", 1)]
    e.add_request(req("c", 12, first_token=100))
    e.add_request(req("d", 12, first_token=200))
    assert step(e) == [("c", 12)]                        # whole prompt, decodes paused; d would pass the cap
    assert step(e) == [("d", 12)]                        # still paused while prompts wait
    assert step(e) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_vllm_v0_runs_a_prompt_longer_than_the_cap_alone():
    e = make_engine("vllm_v0", max_num_batched_tokens=8)
    e.add_request(req("long", 30))
    e.add_request(req("short", 3, first_token=100))
    assert step(e) == [("long", 30)]
    assert step(e) == [("short", 3)]
    assert step(e) == [("long", 1), ("short", 1)]


def test_orca_runs_decodes_and_whole_prefills_together():
    e = make_engine("orca", max_num_batched_tokens=20)
    for r in (req("a", 4), req("b", 4)):
        e.add_request(r)
    assert step(e) == [("a", 4), ("b", 4)]
    e.add_request(req("c", 12, first_token=100))
    e.add_request(req("d", 12, first_token=200))
    assert step(e) == [("a", 1), ("b", 1), ("c", 12)]    # whole prompt next to the decodes; d would pass the cap
    assert step(e) == [("a", 1), ("b", 1), ("c", 1), ("d", 12)]


def test_request_level_nobody_joins_until_the_batch_drains():
    e = make_engine("request_level")
    e.add_request(req("a", 4, max_tokens=3))
    e.add_request(req("b", 5, max_tokens=2, first_token=50))
    assert step(e) == [("a", 4), ("b", 5)]
    # KV for the whole lifetime (prompt + max_tokens - 1 tokens), reserved up front
    assert e.bm.block_table("a") == [0, 1] and e.bm.block_table("b") == [2, 3]
    e.add_request(req("c", 3, max_tokens=2, first_token=100))
    assert step(e) == [("a", 1), ("b", 1)]               # b finishes
    assert step(e) == [("a", 1)]                         # a alone; c still waits
    assert step(e) == [("c", 3)]
    assert step(e) == [("c", 1)]
    assert not e.has_work() and e.bm.all_free()


# ---- properties over random workloads ----------------------------------------------------

@pytest.mark.parametrize("policy", sorted(SCHEDULERS))
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_respects_budget_and_max_num_seqs(policy, seed):
    rng = random.Random(seed)
    budget, max_seqs = rng.choice([1, 7, 16, 64]), rng.choice([2, 5, 16])
    # 20 blocks: any single request fits alone (<= 71 tokens, 18 blocks), a few at once do not
    e = make_engine(policy, token_budget=budget, max_num_seqs=max_seqs, num_blocks=20,
                    max_num_batched_tokens=rng.choice([16, 64]))
    requests = [req(f"r{i}", rng.randint(1, 60), rng.randint(1, 12), first_token=rng.randint(0, 10_000))
                for i in range(40)]
    arrivals = sorted(rng.randint(0, 60) for _ in requests)
    pending, it = list(zip(arrivals, requests)), 0
    while pending or e.has_work():
        while pending and pending[0][0] <= it:
            e.add_request(pending.pop(0)[1])
        if e.has_work():
            slices = step(e)
            if policy == "sarathi":
                assert sum(n for _, n in slices) <= budget
            assert len(e.scheduler.running) <= max_seqs
            assert len(slices) <= max_seqs
        it += 1
        assert it < 20_000, "no progress"
    assert e.bm.all_free()
    for r in requests:
        assert r.status == RequestStatus.FINISHED
        assert r.output_token_ids == expected_outputs(r), r.request_id    # recompute never changes outputs
    assert sum(r.num_preemptions for r in requests) == e.scheduler.num_preemptions
    if policy == "sarathi" and budget == 1:
        assert all(len(b) == 1 for b in e.executor.batches)


# ---- preemption -----------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["sarathi", "orca", "vllm_v0"])
def test_preemption_recomputes_the_newest_request(policy):
    """4 blocks of 4 slots; three 4-token prompts hold one block each. Their
    first decodes need a second block each: a takes the free one, b needs
    another and the newest running request, c, is preempted to give it one."""
    e = make_engine(policy, token_budget=16, num_blocks=4)
    a, b, c = req("a", 4, max_tokens=3), req("b", 4, max_tokens=3, first_token=50), req("c", 4, 3, 90)
    for r in (a, b, c):
        e.add_request(r)
    assert step(e) == [("a", 4), ("b", 4), ("c", 4)]
    assert [e.bm.block_table(x) for x in "abc"] == [[0], [1], [2]]
    first_output_of_c = list(c.output_token_ids)
    assert step(e) == [("a", 1), ("b", 1)]
    assert (e.scheduler.num_preemptions, c.num_preemptions, c.status) == (1, 1, RequestStatus.WAITING)
    assert list(e.scheduler.waiting) == [c]
    assert c.num_computed_tokens == 0 and c.output_token_ids == first_output_of_c
    # c's (full, hashed) block went to the prefix cache on release; b evicted it
    assert (e.bm.block_table("a"), e.bm.block_table("b"), e.bm.block_table("c")) == ([0, 3], [1, 2], [])
    assert step(e) == [("a", 1), ("b", 1)]               # no room for c until a and b finish
    assert step(e) == [("c", 5)]                         # recompute: the prompt and its first output
    assert step(e) == [("c", 1)]
    assert not e.has_work() and e.bm.all_free()
    assert c.output_token_ids == expected_outputs(c)
    assert (a.num_preemptions, b.num_preemptions) == (0, 0)


# ---- aborts ---------------------------------------------------------------------------------

def test_abort_running_waiting_and_preempted_requests_frees_their_blocks():
    e = make_engine("sarathi", token_budget=6, num_blocks=6)
    long_, short, queued = req("long", 16), req("short", 2, first_token=40), req("queued", 4, first_token=80)
    for r in (long_, short, queued):
        e.add_request(r)
    assert step(e) == [("long", 6)]
    assert (long_.is_prefill, len(e.bm.block_table("long"))) == (True, 2)
    assert e.abort("queued") is queued and queued.status == RequestStatus.ABORTED
    assert list(e.scheduler.waiting) == [short]
    assert e.abort("long") is long_                     # mid-prefill
    assert e.bm.all_free() and e.bm.block_table("long") == []
    assert e.abort("long") is None                       # a second abort finds nothing
    assert step(e) == [("short", 2)]
    assert e.abort("short") is short                     # mid-decode
    assert not e.has_work() and e.bm.all_free()
    e.bm.check_invariants()


# ---- the invariant check catches broken policies ---------------------------------------------

class OverBudget(SarathiScheduler):
    name = "over_budget"

    def schedule(self) -> Batch:
        batch = Batch()
        self._continue_running(batch)          # whole remainders, ignoring token_budget
        while self.waiting:
            r = self.waiting[0]
            n = self._try_admit(r, None)
            self._start(r)
            batch.slices.append(ScheduledSlice(r, n))
        return self._check(batch, self.cfg.token_budget)


class NoBlocks(SarathiScheduler):
    name = "no_blocks"

    def schedule(self) -> Batch:
        batch = Batch()
        r = self.waiting.popleft()
        self.running.append(r)
        batch.slices.append(ScheduledSlice(r, r.num_uncomputed_tokens))   # never allocated KV
        return self._check(batch, self.cfg.token_budget)


class Twice(SarathiScheduler):
    name = "twice"

    def schedule(self) -> Batch:
        batch = super().schedule()
        batch.slices.append(batch.slices[0])
        return self._check(batch, None)


class Crowded(SarathiScheduler):
    name = "crowded"

    def schedule(self) -> Batch:
        batch = Batch()
        for r in list(self.waiting):            # admits everyone, ignoring max_num_seqs
            self._try_admit(r, None)
            self.waiting.remove(r)
            self.running.append(r)
            batch.slices.append(ScheduledSlice(r, r.num_uncomputed_tokens))
        return self._check(batch, None)


@pytest.mark.parametrize("policy,message", [(OverBudget, "token budget exceeded: 12 > 10"),
                                            (NoBlocks, "KV blocks do not cover the slice"),
                                            (Twice, "scheduled twice"),
                                            (Crowded, "max_num_seqs exceeded")])
def test_invariant_check_catches_a_broken_schedule(policy, message):
    bm = BlockManager(64, BLOCK_SIZE)
    s = policy(SchedulerConfig(token_budget=10, max_num_seqs=2, max_num_batched_tokens=100), bm)
    s.add(req("a", 6))
    s.add(req("b", 6, first_token=50))
    if policy is Crowded:
        s.add(req("c", 1, first_token=90))
    with pytest.raises(AssertionError, match=message):
        s.schedule()


def test_the_real_policies_pass_the_same_check():
    for name in SCHEDULERS:
        bm = BlockManager(64, BLOCK_SIZE)
        s = make_scheduler(name, SchedulerConfig(token_budget=10, max_num_seqs=2, max_num_batched_tokens=100), bm,
                           context_for(name, VirtualClock()))
        s.add(req("a", 6))
        s.add(req("b", 6, first_token=50))
        assert s.schedule()
