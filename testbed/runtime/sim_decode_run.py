"""The simulator's short paths through an engine whose scheduler implements
SteadyDecodes (testbed/runtime/sim_fast_forward.py):

- `steady_step`: Engine.step for a batch of one decode per running request,
  without building the Batch (most of a simulation's iterations);
- `decode_run`: such iterations back to back in virtual time while nothing
  but time changes, as one DecodeRun (no StepOutput, event or Batch each),
  and `worker_decode_run` on a worker's engine;
- `deliver_run`: a controller's on_event of a DecodeRun's tokens at once.

Each gives the same requests, blocks, records and times as Engine.step, one
iteration at a time (tests/test_sim_fast_forward.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from testbed.batch import Batch
from testbed.engine import Engine, StepOutput
from testbed.metrics import IterationRecord
from testbed.modes.base import ModeController
from testbed.request import Request
from testbed.worker import WorkerService


@dataclass
class DecodeRun:
    """Steady decode iterations run back to back: the same requests each got
    one token per iteration and none finished. `first_index[i]`: the index of
    request i's first token here; `tokens[j]`: iteration j's tokens in
    request order; `ends_s[j]`: its end (where the next one starts);
    `free_blocks`: the KV blocks free after the last of them (its
    IterationDone's figure)."""
    requests: list[Request]
    first_index: list[int]
    tokens: list[list[int]] = field(default_factory=list)
    ends_s: list[float] = field(default_factory=list)
    iterations: list[IterationRecord] = field(default_factory=list)
    free_blocks: int = 0


def steady_step(engine: Engine, on_layer_done: Callable[[int, Batch], None] | None = None) -> StepOutput | None:
    """engine.step() when the next batch is one decode of each running
    request (SteadyDecodes.steady_decodes); None, having run nothing, otherwise."""
    if on_layer_done is not None or engine.prefill_only or engine.seat_queue:
        return None         # (a request waiting for a seat joins in Engine.step)
    steady = engine.scheduler.steady_decodes()
    if steady is None:
        return None
    requests, token_budget = steady
    start = engine.clock.now()
    tokens, duration, kv_bytes_read = engine.executor.execute_decodes(requests)
    return _decoded(engine, requests, token_budget, start, tokens, duration, kv_bytes_read)


def decode_run(engine: Engine, until_s: float) -> tuple[DecodeRun | None, StepOutput | None]:
    """steady_step() again and again while nothing but time changes: the
    iterations that finish no request and end before `until_s` make one
    DecodeRun; the first that does not is run as steady_step runs it and
    comes second. The second is None, having run nothing more, where the next
    iteration is not a steady decode batch."""
    if engine.prefill_only or engine.seat_queue or not engine.clock.virtual:
        return None, None
    scheduler, clock, bm = engine.scheduler, engine.clock, engine.bm
    bs = bm.block_size
    run, left, steps = None, 0, None
    observe = scheduler.observe_steady if scheduler.observes_steady else None
    context = longest = 0       # the decodes' contexts after the next iteration (for observe)
    while True:
        # asked again only where a request starts a KV block: else the same answer as last time
        steady = scheduler.steady_decodes()
        if steady is None:
            return run, None
        requests, token_budget = steady
        if steps is None:
            # iterations until one of them may finish a request (an EOS may end any)
            left = min(r.max_tokens - len(r.output_token_ids) if r.sampling.ignore_eos else 1
                       for r in requests)
            steps = engine.executor.decode_steps(requests)
            if observe is not None:
                context, longest = _contexts_after_decode(requests)
        # the stretch's last iteration fills some request's block: the requests
        # are updated once per stretch, not once per iteration
        stretch = min(bs - r.num_computed_tokens % bs for r in requests)
        tokens_of, ends = [], []
        free = bm.num_free_blocks      # after the stretch's allocations; its last iteration commits
        for _ in range(stretch):
            start = clock.t
            tokens, duration, kv_bytes_read = next(steps)
            end = start + duration
            ends_s = start + (end - start)
            if left <= 1 or ends_s >= until_s:
                _advance(engine, requests, tokens_of, ends)
                return run, _decoded(engine, requests, token_budget, start, tokens, duration, kv_bytes_read)
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
        _advance(engine, requests, tokens_of, ends)
        run.free_blocks = bm.num_free_blocks


def worker_decode_run(svc: WorkerService, until_s: float) -> tuple[DecodeRun | None, StepOutput | None]:
    """decode_run on the worker's engine: the run's iterations emit nothing
    (the caller hands the run to the controller and its records to the
    sink); the iteration after it, if any, emits as the worker's step does."""
    run = None

    def step(engine, _hook):
        nonlocal run
        run, out = decode_run(engine, until_s)
        return out
    out = svc.step(step)
    if run is not None:
        for record in run.iterations:
            record.worker = svc.worker_id
    return run, out


def deliver_run(controller: ModeController, run: DecodeRun) -> None:
    """controller.on_event of each of the run's Tokens at its end, less the
    per-token calls (the runtime hands the run's records to the sink)."""
    ends = run.ends_s
    records, unresolved, early = controller.records, controller.unresolved, controller.early_tokens
    for req, first, tokens in zip(run.requests, run.first_index, zip(*run.tokens)):
        rid = req.request_id
        if rid not in unresolved:
            continue
        rec = records[rid]
        if first == len(rec.output_token_ids) and rid not in early:
            rec.output_token_ids += tokens
            rec.token_times_s += ends
            if rec.first_token_s is None:
                rec.first_token_s = ends[0]
            continue
        for index, token, now in zip(range(first, first + len(ends)), tokens, ends):
            if rid in unresolved:
                controller._deliver(rid, index, token, now)


def _advance(engine: Engine, requests: list[Request], tokens_of: list[list[int]], ends: list[float]) -> None:
    """The run's updates of len(ends) iterations at once: iteration j sampled
    tokens_of[j] (in request order) at ends[j]; a block that filled in the
    last of them is committed (none fills before it)."""
    if not ends:
        return
    bs, commit, n = engine.bm.block_size, engine.bm.commit, len(ends)
    for req, tokens in zip(requests, zip(*tokens_of)):
        req.output_token_ids += tokens      # (the block reads the tokens before the last)
        req.token_times_s += ends
        req.num_computed_tokens = computed = req.num_computed_tokens + n
        if computed % bs == 0:
            commit(req)


def _decoded(engine: Engine, requests: list[Request], token_budget: int | None, start: float, tokens: list[int],
             duration: float, kv_bytes_read: int) -> StepOutput:
    """Engine.step's updates once a steady decode batch ran."""
    clock, scheduler = engine.clock, engine.scheduler
    if clock.virtual:
        end = start + duration
        clock.t = end
    else:
        end = clock.now()
    predicted = None
    if scheduler.observes_steady:      # schedule()'s plan and on_step's look at the batch
        predicted = scheduler.observe_steady(len(requests), *_contexts_after_decode(requests), start, end)
    out = StepOutput(None)
    bs, commit, sampled = engine.bm.block_size, engine.bm.commit, engine._sampled
    for req, token in zip(requests, tokens):
        if req.first_scheduled_s is None:
            req.first_scheduled_s = start
        req.num_computed_tokens = computed = req.num_computed_tokens + 1
        if computed % bs == 0:
            commit(req)
        sampled(req, token, end, out)
    out.iteration = IterationRecord(start, end - start, 0, len(requests), kv_bytes_read, None, token_budget,
                                    predicted)
    return out


def _contexts_after_decode(requests: list[Request]) -> tuple[int, int]:
    """The sum and the longest of the requests' contexts after one decode each."""
    contexts = [r.num_computed_tokens for r in requests]
    return sum(contexts) + len(requests), max(contexts) + 1
