"""Scheduler interface and the bookkeeping every policy shares: the waiting
queue, the running list, KV allocation with preemption by recompute, and the
invariants each `schedule()` ends by asserting.

A policy decides which slices run in the next iteration; it never touches the
model. The same classes run under the real engine and the simulator. Two
hooks let a policy adapt: `iteration_budget()` (the token budget of the next
iteration) and `on_step(batch, duration_s)` (each finished step's measured or
simulated duration); what else it needs comes in its `SchedulerContext`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

from testbed.batch import Batch, ScheduledSlice
from testbed.block_manager import BlockManager
from testbed.request import Request, RequestStatus
from testbed.schedulers.context import SchedulerContext


@dataclass(frozen=True)
class SchedulerConfig:
    """No defaults here: they live once, in testbed.config.RunConfig."""
    token_budget: int             # sarathi / adaptive: tokens per iteration
    max_num_seqs: int             # requests running at once
    max_num_batched_tokens: int   # whole-prefill policies: prompt tokens per iteration
    settings: Any = None          # the policy's own section of the run config (adaptive: AdaptiveConfig)

    def validate(self) -> None:
        for f in ("token_budget", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}: must be >= 1, got {getattr(self, f)}")


class Scheduler(ABC):
    name: ClassVar[str]
    needs_predictor: ClassVar[bool] = False     # its context must carry a step-time predictor

    def __init__(self, cfg: SchedulerConfig, block_manager: BlockManager, context: SchedulerContext | None = None):
        cfg.validate()
        self.cfg = cfg
        self.bm = block_manager
        self.context = context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out (finished, aborted, failed or handed off) and free its KV."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.bm.free(request.request_id)

    def find(self, request_id: str) -> Request | None:
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                return r
        return None

    # -- shared mechanics -------------------------------------------------
    def _preempt(self, victim: Request, batch: Batch) -> None:
        """Preemption by recompute: drop the victim's KV, requeue it at the front."""
        self.running.remove(victim)
        self.bm.free(victim.request_id)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        batch.preempted.append(victim)
        self.num_preemptions += 1

    def _grow_or_preempt(self, request: Request, num_new_tokens: int, batch: Batch) -> bool:
        """Allocate KV for `num_new_tokens` more tokens of a running request,
        preempting the newest other running requests while memory is short.
        False when `request` itself had to be preempted."""
        need = request.num_computed_tokens + num_new_tokens
        while not self.bm.allocate(request, need):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is request:
                return False
        return True

    def _grow(self, request: Request, num_new_tokens: int, batch: Batch) -> int:
        """`_grow_or_preempt` with the common case first: a 1-token slice that
        does not start a block already has its KV slot. Returns num_new_tokens,
        or 0 when the request itself was preempted."""
        if num_new_tokens == 1 and request.num_computed_tokens % self.bm.block_size:
            return 1
        return num_new_tokens if self._grow_or_preempt(request, num_new_tokens, batch) else 0

    def _try_admit(self, request: Request, max_new_tokens: int | None) -> int:
        """Give a waiting request its cached prefix and KV for its next slice of
        at most max_new_tokens (None: the whole remainder). Returns the slice's
        length, or 0 (and holds nothing) when memory is short."""
        if not self.bm.block_table(request.request_id):
            request.num_computed_tokens = self.bm.match_prefix(request)
        n = request.num_uncomputed_tokens
        if max_new_tokens is not None:
            n = min(n, max_new_tokens)
        if n < 1 or not self.bm.allocate(request, request.num_computed_tokens + n):
            self.bm.free(request.request_id)
            request.num_computed_tokens = 0
            return 0
        return n

    def _start(self, request: Request) -> None:
        """Move the head of the waiting queue (just admitted) to running."""
        assert self.waiting[0] is request
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _check(self, batch: Batch, token_budget: int | None) -> Batch:
        """Invariants every policy's schedule() ends with. One pass, cheap per
        slice: it runs every iteration over hundreds of decodes. A 1-token
        slice starting inside a block is covered by the blocks that hold the
        request's computed tokens (checked when they were scheduled), so only
        slices that start a block or span several look at the block table."""
        slices = batch.slices
        assert len({id(s.request) for s in slices}) == len(slices), "a request was scheduled twice in one iteration"
        assert len(self.running) <= self.cfg.max_num_seqs, "max_num_seqs exceeded"
        bs = self.bm.block_size
        table = self.bm.block_table
        total = 0
        for s in slices:
            req, n = s.request, s.num_tokens
            start = req.num_computed_tokens
            end = start + n
            total += n
            assert n >= 1 and end <= req.prompt_len + len(req.output_token_ids), \
                f"{req.request_id}: slice [{start}, {end}) outside its tokens"
            if n > 1 or start % bs == 0:
                assert len(table(req.request_id)) * bs >= end, f"{req.request_id}: KV blocks do not cover the slice"
        if token_budget is not None:
            assert total <= token_budget, f"token budget exceeded: {total} > {token_budget}"
        return batch

    @abstractmethod
    def schedule(self) -> Batch:
        """The slices to run in the next iteration."""

    # -- hooks ---------------------------------------------------------------
    def iteration_budget(self) -> int:
        """Tokens the next iteration may schedule (a budgeted policy's input)."""
        return self.cfg.token_budget

    def on_step(self, batch: Batch, duration_s: float) -> None:
        """A scheduled batch ran and took `duration_s` (wall or virtual time)."""

    def _admit_whole_prefills(self, batch: Batch) -> None:
        """FCFS whole prompts into `batch` while memory, max_num_seqs and
        max_num_batched_tokens allow (a prompt longer than the cap runs alone)."""
        tokens = batch.num_tokens
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and not batch.preempted:
            req = self.waiting[0]
            if tokens + req.num_uncomputed_tokens > self.cfg.max_num_batched_tokens and batch.slices:
                break
            n = self._try_admit(req, None)
            if n == 0:
                break
            self._start(req)
            batch.slices.append(ScheduledSlice(req, n))
            tokens += n

    def _continue_running(self, batch: Batch) -> None:
        """Every running request's remaining tokens (1 for a decode), preempting
        the newest when memory runs out."""
        slices = batch.slices
        for req in list(self.running):
            if batch.preempted and req.status is not RequestStatus.RUNNING:
                continue                         # preempted by an earlier request's allocation
            n = self._grow(req, req.num_tokens - req.num_computed_tokens, batch)
            if n:
                slices.append(ScheduledSlice(req, n))
        if batch.preempted:
            batch.slices = [s for s in slices if s.request.status is RequestStatus.RUNNING]
