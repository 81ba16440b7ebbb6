"""ModeController: the frontend's side of a run. It routes arriving requests
to workers, reacts to their events, and keeps one RequestRecord per request.

A request's record leaves for `self.sink` (testbed/record_log.py: requests.jsonl)
the moment the request is terminal, with every map entry it had here, so what
the controller holds grows with the requests in flight, never with the run.

It talks to workers only through `send(worker_id, command)` and `on_event`, so
the same controller drives real processes (testbed/runtime/real.py) and the
simulator (testbed/runtime/sim.py). What it knows of each worker (outstanding
requests, queued prompt tokens, free blocks) lives in `self.pool`, which the
mode's routers (modes/routers.py) read."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

from testbed.metrics import RequestRecord
from testbed.modes.pool import PoolState
from testbed.record_log import RecordList, RecordSink
from testbed.request import Request
from testbed.runtime.messages import (Abort, Command, Event, Finished, FreeBlocks, IterationDone, Preempted,
                                      RequestMsg, Tokens, request_to_msg)

Send = Callable[[str, Command], None]


@dataclass
class WorkerInfo:
    worker_id: str
    role: str               # colocated | prefill | decode
    num_blocks: int
    block_size: int
    # positions the worker's model was trained for (the real engine's model.max_position_embeddings);
    # None: no limit (the simulator extrapolates its cost model past a preset's context)
    max_model_len: int | None = None


class ModeController(ABC):
    record_cls: type[RequestRecord] = RequestRecord     # a mode may record more per request
    # whether its reaction to a worker's event may send a command (False: only arrivals do,
    # so the simulator may run a worker ahead to the next arrival: runtime/sim.py)
    commands_on_events: ClassVar[bool] = True

    def __init__(self, workers: list[WorkerInfo], send: Send, copy_prompts: bool = True):
        self.workers = {w.worker_id: w for w in workers}
        self.send = send
        # worker processes get the prompt as a list of ids; the simulator, whose workers
        # share this process, passes the (possibly lazy, 1M-token) prompt without copying it
        self.copy_prompts = copy_prompts
        self.pool = PoolState({w.worker_id: w.num_blocks for w in workers})
        # the tightest context any worker's model takes (None: no limit): each arrival is checked against it
        self.max_model_len = min((w.max_model_len for w in workers if w.max_model_len is not None), default=None)
        # the runtime streams records to its RecordLog; a controller driven by hand keeps them in a list
        self.sink: RecordSink = RecordList()
        self.records: dict[str, RequestRecord] = {}      # requests in flight (and records a mode still completes)
        self.arrival_index: dict[str, int] = {}          # their place among the run's arrivals
        self.num_arrivals = 0
        self.unresolved: set[str] = set()
        self.location: dict[str, set[str]] = {}      # request id -> workers holding state for it
        self.dead: set[str] = set()
        # tokens that arrived before an earlier one of the same request (index -> token), and
        # a `finished` waiting for them: disagg's first token comes from the prefill worker, the
        # rest from the decode worker, on separate sockets that a busy frontend reads out of order
        self.early_tokens: dict[str, dict[int, int]] = {}
        self.early_finish: dict[str, Finished] = {}

    # -- called by the runtime -------------------------------------------------
    def on_arrival(self, req: Request, now: float) -> None:
        self.records[req.request_id] = self.record_cls(
            request_id=req.request_id, status="waiting", prompt_len=req.prompt_len, output_token_ids=[],
            arrival_s=req.arrival_s, first_scheduled_s=None, first_token_s=None, token_times_s=[],
            finish_s=None, num_preemptions=0, error=None)
        self.arrival_index[req.request_id] = self.num_arrivals
        self.num_arrivals += 1
        self.unresolved.add(req.request_id)
        self.location[req.request_id] = set()
        if not self._fail_if_past_context(req, now):
            self.route(req, now)

    def request_msg(self, req: Request) -> RequestMsg:
        return request_to_msg(req, self.copy_prompts)

    def on_event(self, ev: Event, now: float) -> None:
        kind = type(ev)
        if kind is Tokens:
            for rid, token, _engine_t, index in ev.items:
                if rid in self.unresolved:
                    # else produced before the worker heard of the end: never delivered to the client
                    self._deliver(rid, index, token, now)
        elif kind is IterationDone:
            self.sink.iteration(ev.record)
            self.on_free_blocks(ev.record.worker, ev.free_blocks, now)
        elif kind is FreeBlocks:     # blocks released between iterations (a dropped reservation)
            self.on_free_blocks(ev.worker, ev.free_blocks, now)
        elif kind is Finished:
            self._finish(ev, now)
        elif kind is Preempted:
            if ev.id in self.unresolved:      # else its end already counted the preemptions
                self.records[ev.id].num_preemptions += 1
        else:
            self.on_mode_event(ev, now)

    def abort(self, request_id: str, now: float, status: str = "aborted",
              error: str = "aborted by the client") -> None:
        """The client gave up on the request (the runtime: it timed out, status failed)."""
        if request_id not in self.unresolved:
            return
        for w in self.location[request_id]:
            self.send(w, Abort(request_id))
        self.forget(request_id)
        self._resolve(request_id, status, error, now)

    def end_run(self, error: str) -> None:
        """The run is over: a request still unresolved fails with `error` (no
        finish time: it never ended), and every record still here goes to the sink."""
        for rid in sorted(self.unresolved, key=self.arrival_index.__getitem__):
            self.forget(rid)
            self._resolve(rid, "failed", error, None)
        for rid in sorted(self.records, key=self.arrival_index.__getitem__):
            self._emit(rid)

    def on_worker_died(self, worker_id: str, now: float, reason: str | None = None) -> None:
        """The worker is gone (or was killed for hanging): the requests it held
        fail with `reason` (default "worker W died"), the rest stay."""
        self.dead.add(worker_id)
        for rid in [r for r in self.unresolved if worker_id in self.location[r]]:
            for other in self.location[rid] - {worker_id}:
                self.send(other, Abort(rid))
            self.forget(rid)
            self._resolve(rid, "failed", reason or f"worker {worker_id} died", now)

    def done(self) -> bool:
        return not self.unresolved

    def held_by(self) -> dict[str, list[str]]:
        """Per worker, the unresolved requests it holds something for: what the
        frontend still counts on, so the heartbeat renews those leases."""
        out: dict[str, list[str]] = {}
        for rid, workers in self.location.items():
            for w in workers:
                out.setdefault(w, []).append(rid)
        return out

    # -- shared helpers ----------------------------------------------------------
    def _deliver(self, rid: str, index: int, token: int, now: float) -> None:
        """Token `index` of the request reached the frontend; it and any held
        after it reach the client now, in order."""
        rec = self.records[rid]
        if index == len(rec.output_token_ids) and rid not in self.early_tokens:
            # in order, nothing held: the common case, once per token
            rec.output_token_ids.append(token)
            rec.token_times_s.append(now)
            if rec.first_token_s is None:
                rec.first_token_s = now
            return
        early = self.early_tokens.setdefault(rid, {})
        early[index] = token
        while len(rec.output_token_ids) in early:
            rec.output_token_ids.append(early.pop(len(rec.output_token_ids)))
            rec.token_times_s.append(now)
            if rec.first_token_s is None:
                rec.first_token_s = now
        if not early:
            del self.early_tokens[rid]
            if rid in self.early_finish:
                self._finish(self.early_finish.pop(rid), now)

    def _finish(self, ev: Finished, now: float) -> None:
        rid = ev.id
        if rid not in self.unresolved:
            return
        if rid in self.early_tokens and ev.status == "finished":
            self.early_finish[rid] = ev          # ends once the token it is missing arrives
            return
        rec = self.records[rid]
        rec.num_preemptions = max(rec.num_preemptions, ev.num_preemptions)
        if ev.first_scheduled_s is not None and rec.first_scheduled_s is None:
            rec.first_scheduled_s = ev.first_scheduled_s
        self.on_request_end(rid, ev, now)
        self._resolve(rid, ev.status, ev.error, now)

    def _fail_if_past_context(self, req: Request, now: float) -> bool:
        """As vLLM's max_model_len: a request whose prompt and outputs pass the
        positions its model was trained for fails at arrival (a checkpoint's
        RoPE past its context gives fluent garbage, not an error)."""
        error = self._past_context(req)
        if error is not None:
            self._resolve(req.request_id, "failed", error, now)
        return error is not None

    def _past_context(self, req: Request) -> str | None:
        limit = self.max_model_len
        if limit is None or req.prompt_len + req.max_tokens <= limit:
            return None
        return (f"prompt of {req.prompt_len} tokens plus {req.max_tokens} outputs passes the model's context of "
                f"{limit} positions (model.max_position_embeddings); clip workload.max_prompt_len / "
                "workload.max_output_len")

    def _fail_if_never_fits(self, req: Request, pool: list[str], what: str, now: float,
                            outputs: bool = True) -> bool:
        """A request whose KV needs more blocks than any worker of `pool` has
        would wait (or preempt itself) forever and block the queue behind it:
        fail it at once instead of at the run's timeout. `outputs`: the worker
        holds the outputs' KV too (a replica, a decode worker); else the
        prompt's alone (a prefill worker)."""
        error = self._never_fits(req, pool, what, outputs)
        if error is not None:
            self._resolve(req.request_id, "failed", error, now)
        return error is not None

    def _never_fits(self, req: Request, pool: list[str], what: str, outputs: bool = True) -> str | None:
        most = max(self.workers[w].num_blocks for w in pool)
        tokens = req.prompt_len + (req.max_tokens - 1 if outputs else 0)
        need = -(-tokens // self.workers[pool[0]].block_size)
        if need <= most:
            return None
        held = f"prompt of {req.prompt_len} tokens" + (f" plus {req.max_tokens} outputs" if outputs else "")
        return (f"{held} needs {need} KV blocks, more than a {what} has ({most}, num_kv_blocks); raise "
                f"num_kv_blocks (with num_kv_blocks=auto: the pool's parallel.tp or gpu_memory_utilization) "
                f"or clip workload.max_prompt_len / workload.max_output_len")

    def _resolve(self, rid: str, status: str, error: str | None, now: float | None) -> None:
        """`now` None: the request never ended (the run did), so it has no finish time."""
        rec = self.records[rid]
        rec.status, rec.error, rec.finish_s = status, error, now
        self.unresolved.discard(rid)
        self.location.pop(rid, None)
        self.early_tokens.pop(rid, None)
        self.early_finish.pop(rid, None)
        if not self.completes_later(rid):
            self._emit(rid)

    def _emit(self, rid: str) -> None:
        """The record is final: to the sink, and nothing of the request stays here."""
        self.sink.request(self.records.pop(rid), self.arrival_index.pop(rid))

    def completes_later(self, rid: str) -> bool:
        """Whether the resolved request's record still waits for an event
        (the mode then emits it, or end_run does)."""
        return False

    def forget(self, rid: str) -> None:
        """Drop the mode's own bookkeeping for a request that ends early."""

    def on_free_blocks(self, worker_id: str, free_blocks: int, now: float) -> None:
        """A worker reported how many KV blocks it has free."""

    def alive(self, pool: list[str]) -> list[str]:
        return [w for w in pool if w not in self.dead]

    def on_request_end(self, rid: str, ev: Finished, now: float) -> None:
        """A worker reported the request finished (or failed)."""

    # -- the mode's policy ---------------------------------------------------------
    @abstractmethod
    def route(self, req: Request, now: float) -> None:
        """Send a newly arrived request to its worker(s)."""

    def on_mode_event(self, ev: Event, now: float) -> None:
        raise ValueError(f"unexpected event '{ev.kind}'")
