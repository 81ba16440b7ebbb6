"""Engine: one iteration of the serving loop (DESIGN.md, "Two runtimes, one engine").

    Scheduler.schedule() -> Batch -> Executor.execute(Batch) -> StepResult
    -> update requests: computed tokens, sampled tokens, finished / handed off

The engine is the same under the real runtime (wall clock, a model) and the
simulator (virtual clock, a cost model): `Clock` says which time it reads.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from testbed.batch import Batch, StepResult
from testbed.clock import Clock, VirtualClock, WallClock  # noqa: F401  (re-exported: the engine's clocks)
from testbed.executor import Executor
from testbed.metrics import IterationRecord
from testbed.request import Request, RequestStatus
from testbed.schedulers.base import Scheduler


@dataclass
class StepOutput:
    iteration: IterationRecord        # its worker is set by the WorkerService that ran it
    new_tokens: list[tuple[Request, int]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    # prefill done and first token sampled: a prefill worker hands these off
    prefill_completed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def end_s(self) -> float:
        return self.iteration.start_s + self.iteration.duration_s


@dataclass
class DecodeRun:
    """Steady decode iterations run back to back (Engine.step_decode_run): the
    same requests each got one token per iteration and none finished.
    `first_index[i]`: the index of request i's first token here; `tokens[j]`:
    iteration j's tokens in request order; `ends_s[j]`: its end (each
    iteration's StepOutput.end_s, where the next one starts); `free_blocks`:
    the KV blocks free after the last of them (its IterationDone's figure)."""
    requests: list[Request]
    first_index: list[int]
    tokens: list[list[int]] = field(default_factory=list)
    ends_s: list[float] = field(default_factory=list)
    iterations: list[IterationRecord] = field(default_factory=list)
    free_blocks: int = 0


class Engine:
    """`prefill_only`: a disaggregated prefill worker. A request leaves the
    scheduler once its prompt is computed and its first token sampled, keeping
    its KV blocks until the hand-off releases them (`release`)."""

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Clock, prefill_only: bool = False):
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.prefill_only = prefill_only
        self.bm = scheduler.bm
        # a decode worker's requests whose KV arrived while every seat
        # (max_num_seqs) was taken: they keep their blocks and join the running
        # decodes, oldest first, as seats free up
        self.seat_queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        """A prompt that could never fit in this engine's KV blocks is refused
        (ValueError) rather than left waiting forever. A run's controller
        fails such a request at arrival, outputs counted, before it reaches a
        worker (ModeController._never_fits); an engine used on its own may be
        asked to decode until stopped (max_tokens past its cache), as the
        profiler's decode workers are."""
        need = -(-request.prompt_len // self.bm.block_size)
        if need > self.bm.num_blocks:
            raise ValueError(f"request {request.request_id}: a prompt of {request.prompt_len} tokens needs {need} "
                             f"KV blocks of {self.bm.block_size}, more than the engine's {self.bm.num_blocks} "
                             "(num_kv_blocks); raise num_kv_blocks or shorten the prompt")
        self.scheduler.add(request)

    def add_prefilled(self, request: Request) -> None:
        """A decode worker admits a request whose prompt KV already sits in its
        blocks (written by the transport): it joins the running decodes, or
        waits for a seat when max_num_seqs are already running."""
        request.num_computed_tokens = request.prompt_len
        self.seat_queue.append(request)
        self._seat_prefilled()

    def _seat_prefilled(self) -> None:
        queue, running = self.seat_queue, self.scheduler.running
        while queue and len(running) < self.scheduler.cfg.max_num_seqs:
            request = queue.popleft()
            request.status = RequestStatus.RUNNING
            running.append(request)

    def abort(self, request_id: str) -> Request | None:
        req = self.scheduler.find(request_id)
        if req is not None:
            self.scheduler.remove(req)
        else:
            req = next((r for r in self.seat_queue if r.request_id == request_id), None)
            if req is None:
                return None
            self.seat_queue.remove(req)
            self.bm.free(request_id)
        req.status = RequestStatus.ABORTED
        req.finish_s = self.clock.now()
        return req

    def release(self, request_id: str) -> None:
        """Free the KV blocks of a request that left the scheduler (hand-off done)."""
        self.bm.free(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.seat_queue)

    def step(self, on_layer_done: Callable[[int, Batch], None] | None = None) -> StepOutput | None:
        """`on_layer_done(layer, batch)` runs after each layer of the forward pass."""
        start = self.clock.now()
        if self.seat_queue:
            self._seat_prefilled()
        batch = self.scheduler.schedule()
        if not batch:
            return None
        return self._run(batch, start, on_layer_done)

    def step_steady_decodes(self, on_layer_done: Callable[[int, Batch], None] | None = None) -> StepOutput | None:
        """step() when the scheduler finds the next batch to be one decode of
        each running request (Scheduler.steady_decodes); None, having run
        nothing, otherwise. The same updates as _update's, for that batch alone
        without building it (the simulator runs most of its iterations here)."""
        if on_layer_done is not None or self.prefill_only or self.seat_queue:
            return None         # (a request waiting for a seat joins in step())
        steady = self.scheduler.steady_decodes()
        if steady is None:
            return None
        requests, token_budget = steady
        start = self.clock.now()
        tokens, duration, kv_bytes_read = self.executor.execute_decodes(requests)
        return self._decoded(requests, token_budget, start, tokens, duration, kv_bytes_read)

    def step_decode_run(self, until_s: float) -> tuple[DecodeRun | None, StepOutput | None]:
        """step_steady_decodes() again and again, in virtual time, while nothing
        but time changes: the iterations that finish no request and end before
        `until_s` make one DecodeRun (no StepOutput, event or batch each); the
        first that does not is run as step_steady_decodes runs it and comes
        second. The second is None, having run nothing more, where the next
        iteration is not a steady decode batch. The same requests, blocks and
        times as those calls, one by one (tests/test_sim_fast_forward.py)."""
        if self.prefill_only or self.seat_queue or not self.clock.virtual:
            return None, None
        scheduler, clock, bs = self.scheduler, self.clock, self.bm.block_size
        run, left, steps = None, 0, None
        observe = scheduler.observe_steady if scheduler.observes_steady else None
        context = longest = 0       # the decodes' contexts after the next iteration (for observe)
        while True:
            # the scheduler is asked again only where a request starts a KV block
            # (Scheduler.steady_decodes: else the same answer as last time)
            steady = scheduler.steady_decodes()
            if steady is None:
                return run, None
            requests, token_budget = steady
            if steps is None:
                # iterations until one of them may finish a request (an EOS may end any)
                left = min(r.max_tokens - len(r.output_token_ids) if r.sampling.ignore_eos else 1
                           for r in requests)
                steps = self.executor.decode_steps(requests)
                if observe is not None:
                    context, longest = _contexts_after_decode(requests)
            # the stretch's last iteration fills some request's block: the requests
            # are updated once per stretch, not once per iteration (~0.3 µs a token)
            stretch = min(bs - r.num_computed_tokens % bs for r in requests)
            tokens_of, ends = [], []
            free = self.bm.num_free_blocks      # after the stretch's allocations; its last iteration commits
            for _ in range(stretch):
                start = clock.t
                tokens, duration, kv_bytes_read = next(steps)
                end = start + duration
                ends_s = start + (end - start)
                if left <= 1 or ends_s >= until_s:
                    self._advance(requests, tokens_of, ends)
                    return run, self._decoded(requests, token_budget, start, tokens, duration, kv_bytes_read)
                if run is None:
                    run = DecodeRun(requests, [len(r.output_token_ids) for r in requests])
                    for req in requests:
                        if req.first_scheduled_s is None:
                            req.first_scheduled_s = start
                predicted = None
                if observe is not None:
                    predicted = observe(len(requests), context, longest, start, end)
                    context += len(requests)
                    longest += 1
                tokens_of.append(tokens)
                ends.append(end)
                run.tokens.append(tokens)
                run.ends_s.append(ends_s)
                run.iterations.append(IterationRecord(start, end - start, 0, len(requests), kv_bytes_read, None,
                                                      token_budget, predicted))
                run.free_blocks = free
                clock.t = ends_s
                left -= 1
            self._advance(requests, tokens_of, ends)
            run.free_blocks = self.bm.num_free_blocks

    def _advance(self, requests: list[Request], tokens_of: list[list[int]], ends: list[float]) -> None:
        """The decode run's updates of len(ends) iterations at once: iteration j
        sampled tokens_of[j] (in request order) at ends[j]; a block that filled
        in the last of them is committed (none fills before it)."""
        if not ends:
            return
        bs, commit, n = self.bm.block_size, self.bm.commit, len(ends)
        for req, tokens in zip(requests, zip(*tokens_of)):
            req.output_token_ids += tokens      # (the block reads the tokens before the last)
            req.token_times_s += ends
            req.num_computed_tokens = computed = req.num_computed_tokens + n
            if computed % bs == 0:
                commit(req)

    def _decoded(self, requests: list[Request], token_budget: int | None, start: float, tokens: list[int],
                 duration: float, kv_bytes_read: int) -> StepOutput:
        """step_steady_decodes' updates once the batch ran."""
        if self.clock.virtual:
            end = start + duration
            self.clock.t = end
        else:
            end = self.clock.now()
        predicted = None
        if self.scheduler.observes_steady:      # schedule()'s plan and on_step's look at the batch
            predicted = self.scheduler.observe_steady(len(requests), *_contexts_after_decode(requests), start, end)
        out = StepOutput(None)
        bs, commit = self.bm.block_size, self.bm.commit
        for req, token in zip(requests, tokens):
            if req.first_scheduled_s is None:
                req.first_scheduled_s = start
            req.num_computed_tokens = computed = req.num_computed_tokens + 1
            if computed % bs == 0:
                commit(req)
            self._sampled(req, token, end, out)
        out.iteration = IterationRecord(start, end - start, 0, len(requests), kv_bytes_read, None, token_budget,
                                        predicted)
        return out

    def _run(self, batch: Batch, start: float, on_layer_done: Callable[[int, Batch], None] | None) -> StepOutput:
        hook = None if on_layer_done is None else (lambda layer: on_layer_done(layer, batch))
        result = self.executor.execute(batch, hook)
        if self.clock.virtual:
            end = start + result.duration_s
            self.clock.t = end          # what follows this step (hand-offs, events) happens at its end
        else:
            end = self.clock.now()
        self.scheduler.on_step(batch, end - start)
        return self._update(batch, result, start, end)

    def _update(self, batch: Batch, result: StepResult, start: float, end: float) -> StepOutput:
        # One pass over the slices: with hundreds of decodes per iteration this
        # loop is most of the engine's own time (experiments/benchmarks/bench_scheduler.py).
        out = StepOutput(None, preempted=batch.preempted)
        sampled = result.sampled
        bs = self.bm.block_size
        commit = self.bm.commit
        prefill_only = self.prefill_only
        num_decode = num_prefill = 0
        for sl in batch.slices:
            req, n = sl.request, sl.num_tokens
            computed = req.num_computed_tokens
            if computed >= req.prompt_len:
                num_decode += n
            else:
                num_prefill += n
            if req.first_scheduled_s is None:
                req.first_scheduled_s = start
            req.num_computed_tokens = computed = computed + n
            if n > 1 or computed % bs == 0:      # a block may have filled: register it for prefix reuse
                commit(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            if self._sampled(req, token, end, out):
                continue
            if prefill_only and len(req.output_token_ids) == 1:
                self.scheduler.running.remove(req)     # keeps its blocks for the hand-off
                out.prefill_completed.append(req)
        out.iteration = IterationRecord(start, end - start, num_prefill, num_decode, result.kv_bytes_read, None,
                                        batch.token_budget, batch.predicted_s)
        return out

    def _sampled(self, req: Request, token: int, end: float, out: StepOutput) -> bool:
        """`token` sampled for `req` at `end`; True when that finished it."""
        req.output_token_ids.append(token)
        req.token_times_s.append(end)
        out.new_tokens.append((req, token))
        # the max_tokens test first: is_finished_generating() adds only the EOS check
        if len(req.output_token_ids) >= req.max_tokens or (not req.sampling.ignore_eos
                                                             and req.is_finished_generating()):
            req.status = RequestStatus.FINISHED
            req.finish_s = end
            self.scheduler.remove(req)
            out.finished.append(req)
            return True
        return False


def _contexts_after_decode(requests: list[Request]) -> tuple[int, int]:
    """The sum and the longest of the requests' contexts after one decode each."""
    contexts = [r.num_computed_tokens for r in requests]
    return sum(contexts) + len(requests), max(contexts) + 1
