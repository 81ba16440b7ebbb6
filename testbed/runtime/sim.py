"""The simulated runtime (`runtime=sim`): the same workers, modes, schedulers
and block managers as the real runtime, in one process, driven by a
discrete-event loop over a virtual clock. Only the executor (cost model) and
the KV transport (link model) are models.

Events are (time, seq, action, arg) in a heap; arrivals wait in their own
sorted stream beside it (sim_arrivals.py: a 100K-request workload never sits
in the heap). A worker steps whenever it is idle and has work; the events it
emits reach the controller when its iteration ends. Commands from the
controller and events from workers take hardware.frontend_hop_ms, and the
frontend spends frontend_message_ms on each command it sends (0 on the GPU
presets: control messages are small next to iterations; the CPU preset's are
measured). Commands carry the request's prompt as it is: a lazy 1M-token
prompt is never copied, only materialized for a worker whose block manager
hashes it (materialize_prompt).

With runtime.sim_fast_forward, a worker that nothing can reach runs ahead of
the heap, its steady decodes on the short paths of sim_decode_run.py where
its scheduler and controller implement sim_fast_forward.py's protocols."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import itertools
import sys
from typing import Any, Callable, Iterable, Iterator

from testbed.config import RunConfig
from testbed.engine import StepOutput, VirtualClock
from testbed.modes.registry import get_role
from testbed.record_log import RecordLog
from testbed.request import Request
from testbed.runtime.build import build_engine, build_worker, pool_config, pool_parallel
from testbed.runtime.deployment import RunResult, build_mode, record_log
from testbed.runtime.kv_port import KVArrival
from testbed.runtime.sim_kv_port import SimKVPort
from testbed.runtime.messages import Command, Event, IterationDone, RequestMsg, Tokens
from testbed.sim.cost_executor import CostModelExecutor
from testbed.sim.cost_model import CostModel
from testbed.sim.jitter import StepJitter
from testbed.sim.kv_sharding import handoff_links
from testbed.sim.link_model import LinkModel
from testbed.sim.memory import format_footprint, kv_footprint
from testbed.runtime.sim_arrivals import Arrivals
from testbed.runtime.sim_decode_run import deliver_run, steady_step, worker_decode_run
from testbed.runtime.sim_fast_forward import ShowsApart, SteadyDecodes
from testbed.runtime.sim_iteration_order import IterationOrder
from testbed.runtime.sim_store import SimStoreNode, SimStorePort
from testbed.worker import WorkerService
from testbed.workloads.tokens import stream_key

_JITTER_STREAM = 0x6A17   # keeps each worker's jitter draws apart from the workload's streams


def materialize_prompt(request_msg: RequestMsg) -> RequestMsg:
    """A worker that hashes prompt blocks reads the whole prompt, a chunk at
    a time: a lazy prompt computes each read, an array slices it. So it gets
    the prompt once as an array (8 bytes a token); a decode worker, which
    does not hash, gets it lazy, and so does a prompt private from its first
    token (Request.private_from), whose blocks no worker hashes."""
    numpy = getattr(request_msg.prompt, "numpy", None)
    if numpy is None or request_msg.private_from == 0:
        return request_msg
    return dataclasses.replace(request_msg, prompt=numpy())


class SimRuntime:
    def __init__(self, cfg: RunConfig, log: Callable[[str], None] | None = None, record_dir=None,
                 records: RecordLog | None = None):
        """records: where the run's records stream to (default: record_log's, into record_dir)."""
        self.cfg = cfg
        self.records = records if records is not None else record_log(cfg, record_dir)
        self.clock = VirtualClock()
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        self.mode = build_mode(cfg)
        self.workers = self.mode.workers()
        # frontend <-> worker messages (commands, events) take this long; KV
        # goes worker to worker over the link model instead
        self.hop_s = cfg.hardware.frontend_hop_ms * 1e-3
        self.message_s = cfg.hardware.frontend_message_ms * 1e-3
        self.frontend_free_s = 0.0
        # when an idle worker, woken by a command, reads its socket: the hop is
        # mostly that wake-up, so commands sent before it are read with the first
        self.wakes_at: dict[str, float] = {}
        # one cost model per parallel config: each worker is priced with its pool's (runtime/build.py)
        costs: dict[str, CostModel] = {}
        footprints, printed = {}, set()
        for pool in sorted({get_role(w.role).pool or "" for w in self.workers}):
            pcfg = pool_config(cfg, pool or None)
            costs[pool] = CostModel(cfg.model, cfg.hardware, pcfg.parallel, cfg.engine)
            footprints[pool] = kv_footprint(costs[pool], pcfg.num_kv_blocks, cfg.block_size,
                                            getattr(cfg, "hardware_defaults_note", ""))
            # a pool with its own parallel config gets its own line; the run's is printed once
            line = format_footprint(footprints[pool])
            line = line if pcfg is cfg else f"[{pool} pool] {line}"
            if line not in printed:
                printed.add(line)
                (log or _stderr)(line)
        self.footprint = footprints.get("", next(iter(footprints.values())))
        engine = next(iter(costs.values())).engine
        (log or _stderr)(f"engine: {engine.name} (" + "; ".join(f"{k}: {v}" for k, v in engine.term_provenance().items())
                         + ")")
        # a hand-off crosses from the prefill pool's layout to the decode pool's (sim/kv_sharding.py)
        links = handoff_links(cfg.model, pool_parallel(cfg, "prefill"), pool_parallel(cfg, "decode"))
        self.services: dict[str, WorkerService] = {}
        self.ports: dict[str, SimKVPort] = {}
        self.busy_until: dict[str, float] = {}
        self.step_scheduled: set[str] = set()
        self.outbox: dict[str, list[Event]] = {}
        self.store = None
        if self.mode.needs_store:      # one modeled store node on the same network as the KV links
            kv = cfg.kvstore
            self.store = SimStoreNode(kv.capacity_bytes, cfg.model.kv_bytes_per_token * cfg.block_size, cfg.link,
                                      kv.disk_capacity_bytes, kv.disk_gb_per_s)
        for index, w in enumerate(self.workers):
            jitter = (StepJitter(cfg.hardware.step_jitter_ms, stream_key(cfg.seed, _JITTER_STREAM, index))
                      if cfg.hardware.step_jitter_ms else None)
            cost = costs[get_role(w.role).pool or ""]
            engine = build_engine(cfg, w.role, self.clock,
                                  executor_factory=lambda _bt, j=jitter, c=cost: CostModelExecutor(c, j))
            port = None
            if self.mode.needs_kv_port:
                port = SimKVPort(self, w.worker_id, LinkModel(cfg.link), cfg.model.kv_bytes_per_token,
                                 cfg.model.num_layers, links)
                self.ports[w.worker_id] = port
            self.outbox[w.worker_id] = []
            store = (SimStorePort(self.store, self, w.worker_id)
                     if self.store is not None and get_role(w.role).uses_store else None)
            self.services[w.worker_id] = build_worker(w.worker_id, w.role, engine, self.outbox[w.worker_id].append,
                                                      port, cfg.transfer.layerwise, store)
            self.busy_until[w.worker_id] = 0.0
        self.controller = self.mode.controller(self.workers, self._send, copy_prompts=False)
        self.order = IterationOrder(self.records, self.clock, [w.worker_id for w in self.workers])
        self.controller.sink = self.order
        # fast-forward (_run_ahead): only without frontend hops, whose delivery times would
        # let a worker's later events overtake its earlier ones
        self.fast_forward = cfg.runtime.sim_fast_forward and not (self.hop_s or self.message_s)
        # workers whose scheduler has the steady-decode short path
        self.steady = {w for w, svc in self.services.items() if isinstance(svc.engine.scheduler, SteadyDecodes)}
        # _step tries the short path first only where the controller answers events: a disagg decode
        # worker steps most of its iterations there, a colocated one runs ahead at once instead
        self.steady_in_step = self.steady if self.fast_forward and self.controller.commands_on_events else set()
        self._apart_from = self.controller.apart_from if isinstance(self.controller, ShowsApart) else None
        self.arrivals = Arrivals([], self.controller, len(self.workers))     # run()'s
        # iterations run ahead, iterations on the steady-decode short path (run ahead or not), and
        # iterations in a DecodeRun
        self.num_run_ahead = self.num_steady = self.num_in_runs = 0
        # workers whose block manager hashes prompt blocks: they get the prompt as an array
        self.hashing = {w for w, svc in self.services.items() if svc.engine.bm.enable_prefix_caching}

    # -- event plumbing ------------------------------------------------------------
    def at(self, t: float, action: Callable[[Any], None], arg: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), action, arg))

    def _flush(self, worker_id: str) -> None:
        """Events a worker emitted outside an iteration (replies to commands)."""
        box = self.outbox[worker_id]
        if box:
            events = list(box)
            box.clear()
            if self.hop_s:
                self.at(self.clock.t + self.hop_s, self._to_controller, events)
            else:
                self._to_controller(events)

    def _to_controller(self, events: list[Event]) -> None:
        now, on_event = self.clock.t, self.controller.on_event
        for ev in events:
            on_event(ev, now)

    def _send(self, worker_id: str, msg: Command) -> None:
        if self.hop_s or self.message_s:
            # the frontend sends one command after another, each a hop away;
            # a worker idle in its poll wakes a hop after the first and then
            # reads every command already in its socket (a burst of arrivals
            # is prefilled together, as the real worker loop does)
            leave = max(self.clock.t, self.frontend_free_s)
            self.frontend_free_s = leave + self.message_s
            arrive = leave + self.hop_s
            wake = self.wakes_at.get(worker_id, -1.0)
            if leave <= wake:
                arrive = wake
            elif worker_id not in self.step_scheduled and self.busy_until[worker_id] <= leave:
                self.wakes_at[worker_id] = arrive
            self.at(arrive, self._handle, (worker_id, msg))
        else:
            self._handle((worker_id, msg))

    def _handle(self, arg: tuple[str, Command]) -> None:
        worker_id, msg = arg
        if worker_id in self.hashing and getattr(msg, "request", None) is not None:
            msg = dataclasses.replace(msg, request=materialize_prompt(msg.request))
        self.services[worker_id].handle(msg)
        self._flush(worker_id)
        self._kick(worker_id)

    def _kick(self, worker_id: str) -> None:
        if worker_id in self.step_scheduled or not self.services[worker_id].has_work():
            return
        self.step_scheduled.add(worker_id)
        self.at(max(self.clock.t, self.busy_until[worker_id]), self._step, worker_id)

    def _step(self, worker_id: str) -> None:
        self.step_scheduled.discard(worker_id)
        svc = self.services[worker_id]
        out = svc.step(steady_step) if worker_id in self.steady_in_step else None
        if out is not None:
            self.num_steady += 1
        else:
            out = svc.step()
        if out is None:
            self._flush(worker_id)
            return
        if self.fast_forward:
            out = self._run_ahead(worker_id, out)
            if out is None:        # it went back to the heap's order
                return
        end = out.end_s
        self.busy_until[worker_id] = end
        box = self.outbox[worker_id]
        events = list(box)
        box.clear()
        if self.hop_s:
            # the worker goes on at once; its events reach the frontend a hop later
            self.at(end, self._free, worker_id)
            self.at(end + self.hop_s, self._to_controller, events)
        else:
            self.at(end, self._deliver, (worker_id, events))

    def _run_ahead(self, worker_id: str, out: StepOutput) -> StepOutput | None:
        """Fast-forward: while nothing can reach the worker before its iteration
        ends (`_horizon`), the heap would hand the frontend the iteration's
        events at its end and start the worker's next iteration then: do it
        now, iteration after iteration. Where nothing but an arrival can reach
        it (colocated), or its controller shows which workers' events cannot
        (ShowsApart), the steady decode iterations before the last go as one
        DecodeRun; IterationOrder puts the records back in time order. Returns
        the last iteration, whose events go through the heap as usual, or None
        where the worker went back to the heap's order."""
        svc, box, clock, heap = self.services[worker_id], self.outbox[worker_id], self.clock, self._heap
        steady = worker_id in self.steady
        bounded_by_heap = self.controller.commands_on_events
        # colocated: only an arrival reaches it
        until, runs = (self.arrivals.next_s if bounded_by_heap else self.arrivals.planned_s(worker_id)), True
        while svc.has_work():
            end = out.end_s
            if bounded_by_heap:
                until, runs = self._horizon(worker_id)
            if end >= until:
                break
            if bounded_by_heap and heap and end >= heap[0][0] and not _only_progress(box):
                # events of workers apart from it come first: its own go now only where they
                # commute with theirs (tokens and free blocks; a request's end or KV landing
                # releases a prefill worker's blocks, in time order with theirs: the heap's)
                break
            events = list(box)
            box.clear()
            clock.t = self.busy_until[worker_id] = end
            self._to_controller(events)
            if bounded_by_heap:
                until, runs = self._horizon(worker_id)
            if worker_id in self.step_scheduled or until <= end:
                # the controller's reaction sent it a command, or made something
                # happen at this instant: the heap decides what goes first
                self._free(worker_id)
                return None
            self.num_run_ahead += 1
            out = None
            if runs and steady:
                # the controller only records what the iterations before it emit: run them as one
                run, out = worker_decode_run(svc, until)
                if run is not None:
                    ends = run.ends_s
                    self.num_run_ahead += len(ends)
                    self.num_steady += len(ends)
                    self.num_in_runs += len(ends)
                    clock.t = self.busy_until[worker_id] = ends[-1]
                    deliver_run(self.controller, run)
                    self.order.iterations(run.iterations, ends)
                    if bounded_by_heap:
                        self.controller.on_free_blocks(worker_id, run.free_blocks, ends[-1])
            elif steady:
                out = svc.step(steady_step)
            if out is not None:
                self.num_steady += 1
            else:
                out = svc.step()
                if out is None:
                    self._flush(worker_id)
                    return None
        return out

    def _horizon(self, worker_id: str) -> tuple[float, bool]:
        """The instant before which nothing can reach the worker, and whether
        its steady decodes may run as one DecodeRun up to it. Colocated: the
        next arrival. A controller that may answer any event with a command:
        also the heap's next event, except the events of the workers its
        controller shows apart from this one (ShowsApart; then runs are
        allowed), unless a worker outside them has work and nothing in the
        heap (waiting for memory: any event might start it)."""
        arrival = self.arrivals.next_s
        if not self.controller.commands_on_events:
            return arrival, True
        heap = self._heap
        apart = self._apart_from(worker_id) if self._apart_from is not None else None
        if apart is None:
            return (min(arrival, heap[0][0]) if heap else arrival), False
        until, owners = arrival, set()
        for when, _, action, arg in heap:
            owner = self._owner(action, arg)
            owners.add(owner)
            if owner not in apart and when < until:
                until = when
        for w, svc in self.services.items():
            if w != worker_id and w not in apart and w not in owners and svc.has_work():
                return (min(arrival, heap[0][0]) if heap else arrival), False
        return until, True

    def _owner(self, action: Callable[[Any], None], arg: Any) -> str | None:
        """The worker a heap event is about (None: the frontend's or the store's)."""
        func = getattr(action, "__func__", None)
        if func is SimRuntime._step or func is SimRuntime._free:
            return arg
        if func is SimRuntime._deliver or func is SimRuntime.deliver_kv or func is SimRuntime._handle:
            return arg[0]
        return None

    def _deliver(self, arg: tuple[str, list[Event]]) -> None:
        """The iteration's events reach the frontend as the worker frees up."""
        worker_id, events = arg
        self._to_controller(events)
        self._free(worker_id)

    def _free(self, worker_id: str) -> None:
        if worker_id in self.step_scheduled or not self.services[worker_id].has_work():
            return
        heap = self._heap
        if not heap or heap[0][0] > self.clock.t:
            # nothing else happens at this instant: step now rather than
            # through the heap (the same order, one push and pop fewer)
            self._step(worker_id)
        else:
            self._kick(worker_id)

    def wake(self, worker_id: str) -> None:
        """Something outside the worker's commands gave it work (a store fetch arrived)."""
        self._flush(worker_id)
        self._kick(worker_id)

    def deliver_kv(self, arg: tuple[str, KVArrival]) -> None:
        worker_id, arrival = arg
        self.ports[worker_id].inbox.append(arrival)
        self._kick(worker_id)

    # -- the loop --------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> RunResult:
        """Serve `requests`: a list (sorted here), or an iterator already in
        arrival order, pulled as the clock reaches each arrival (a 1M-request
        workload is never in memory at once)."""
        arrivals = self.arrivals = Arrivals(requests, self.controller, len(self.workers))
        ctl, clock, heap, pop, order = self.controller, self.clock, self._heap, heapq.heappop, self.order
        with _cyclic_gc_paused():
            while arrivals.next is not None or heap:
                # an arrival goes before a worker event at the same instant
                if arrivals.next is not None and (not heap or arrivals.next_s <= heap[0][0]):
                    req = arrivals.pop()
                    clock.t = req.arrival_s
                    order.release_before(clock.t)
                    ctl.on_arrival(req, req.arrival_s)
                    continue
                t, _, action, arg = pop(heap)
                clock.t = t
                order.release_before(t)
                action(arg)
            order.release_all()
        stats = {w: svc.stats().to_dict() for w, svc in self.services.items()}
        stuck = [w for w, svc in self.services.items() if svc.has_work()]
        # nothing left to happen: what is unresolved can never finish
        ctl.end_run("simulation ended with the request unfinished (workers with work they "
                    f"could not schedule: {stuck or 'none'})")
        self.records.close()
        return RunResult(self.records, stats, self.clock.now(),
                         store_stats=self.store.stats() if self.store is not None else None)


def _only_progress(events: list[Event]) -> bool:
    """An iteration's events that only deliver tokens and report free blocks."""
    return all(type(ev) is Tokens or type(ev) is IterationDone for ev in events)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """The event loop allocates millions of short-lived objects and makes no
    reference cycles to speak of: the cyclic collector waits until the loop
    is over (reference counting still frees everything as it goes)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
