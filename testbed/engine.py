"""Engine: one iteration of the serving loop.

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

