"""The simulated runtime (`runtime=sim`): the same workers, modes, schedulers
and block managers as the real runtime, in one process, driven by a
discrete-event loop over a virtual clock. Only the executor (cost model) and
the KV transport (link model) are models.

Events are (time, seq, action) in a heap. A worker steps whenever it is idle
and has work; the events it emits reach the controller when its iteration
ends. Commands from the controller reach workers at once (control messages are
small next to iterations)."""
from __future__ import annotations

import heapq
import itertools
from typing import Callable

from testbed.config import RunConfig
from testbed.engine import VirtualClock
from testbed.request import Request
from testbed.runtime.build import build_engine
from testbed.runtime.kv_port import KVArrival, KVPort
from testbed.runtime.real import RunResult, make_controller, worker_layout
from testbed.sim.cost_executor import CostModelExecutor
from testbed.sim.cost_model import CostModel
from testbed.sim.link_model import LinkModel
from testbed.worker import WorkerService


class SimKVPort(KVPort):
    """KV over a modeled link. A prefill worker's egress is one LinkModel, so
    concurrent hand-offs queue behind each other. With layer-wise streaming
    all but the last layer were sent while the final chunk computed: only
    what the link could not hide arrives after the first token."""

    def __init__(self, runtime: "SimRuntime", worker_id: str, link: LinkModel, kv_bytes_per_token: int,
                 num_layers: int):
        self.runtime, self.worker_id, self.link = runtime, worker_id, link
        self.kv_bytes_per_token, self.num_layers = kv_bytes_per_token, num_layers
        self.inbox: list[KVArrival] = []

    def send(self, request_id, peer, src_block_ids, dst_block_ids, num_tokens, layers, last, meta) -> int:
        now = self.runtime.clock.now()
        per_layer = num_tokens * self.kv_bytes_per_token // self.num_layers
        num_bytes = per_layer * (layers[1] - layers[0])
        if layers[0] > 0:
            # layer-wise: layers 0..L-2 left during the final iteration, layer i at (i+1)/L of it
            iter_s = meta.get("last_iteration_s", 0.0)
            start = now - iter_s
            arrive = start
            for i in range(self.num_layers - 1):
                _, arrive = self.link.reserve(start + (i + 1) * iter_s / self.num_layers, per_layer)
            _, arrive = self.link.reserve(now, num_bytes)
            total = per_layer * self.num_layers
        else:
            _, arrive = self.link.reserve(now, num_bytes)
            total = num_bytes
        if last:
            arrival = KVArrival(request_id, True, num_bytes=total, meta=meta)
            self.runtime.at(arrive, lambda: self.runtime.deliver_kv(peer, arrival))
        return total

    def poll(self) -> list[KVArrival]:
        out, self.inbox = self.inbox, []
        return out


class SimRuntime:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.clock = VirtualClock()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.workers = worker_layout(cfg)
        cost = CostModel(cfg.model, cfg.hardware, cfg.parallel)
        self.services: dict[str, WorkerService] = {}
        self.ports: dict[str, SimKVPort] = {}
        self.busy_until: dict[str, float] = {}
        self.step_scheduled: set[str] = set()
        self.outbox: dict[str, list[dict]] = {}
        for w in self.workers:
            engine = build_engine(cfg, w.role, self.clock, executor_factory=lambda _bt: CostModelExecutor(cost))
            port = None
            if cfg.mode == "disagg":
                port = SimKVPort(self, w.worker_id, LinkModel(cfg.link), cfg.model.kv_bytes_per_token,
                                 cfg.model.num_layers)
                self.ports[w.worker_id] = port
            self.outbox[w.worker_id] = []
            self.services[w.worker_id] = WorkerService(w.worker_id, w.role, engine, self.outbox[w.worker_id].append,
                                                       port, cfg.transfer.layerwise)
            self.busy_until[w.worker_id] = 0.0
        self.controller = make_controller(cfg, self.workers, self._send)

    # -- event plumbing ------------------------------------------------------------
    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), action))

    def _flush(self, worker_id: str) -> None:
        box = self.outbox[worker_id]
        if box:
            events = list(box)
            box.clear()
            now = self.clock.now()
            for ev in events:
                self.controller.on_event(ev, now)

    def _send(self, worker_id: str, msg: dict) -> None:
        self.services[worker_id].handle(msg)
        self._flush(worker_id)
        self._kick(worker_id)

    def _kick(self, worker_id: str) -> None:
        if worker_id in self.step_scheduled or not self.services[worker_id].has_work():
            return
        self.step_scheduled.add(worker_id)
        self.at(max(self.clock.now(), self.busy_until[worker_id]), lambda: self._step(worker_id))

    def _step(self, worker_id: str) -> None:
        self.step_scheduled.discard(worker_id)
        svc = self.services[worker_id]
        out = svc.step()
        if out is None:
            self._flush(worker_id)
            return
        end = out.end_s
        self.busy_until[worker_id] = end
        # the iteration's events reach the frontend when it ends
        events = list(self.outbox[worker_id])
        self.outbox[worker_id].clear()
        self.at(end, lambda: self._deliver(worker_id, events))

    def _deliver(self, worker_id: str, events: list[dict]) -> None:
        now = self.clock.now()
        for ev in events:
            self.controller.on_event(ev, now)
        self._kick(worker_id)

    def deliver_kv(self, worker_id: str, arrival: KVArrival) -> None:
        self.ports[worker_id].inbox.append(arrival)
        self._kick(worker_id)

    # -- the loop --------------------------------------------------------------------
    def run(self, requests: list[Request]) -> RunResult:
        for req in requests:
            self.at(req.arrival_s, lambda r=req: self.controller.on_arrival(r, self.clock.now()))
        ctl = self.controller
        while self._heap:
            t, _, action = heapq.heappop(self._heap)
            self.clock.t = t
            action()
        stats = {w: svc.stats() for w, svc in self.services.items()}
        for rid in list(ctl.unresolved):     # nothing left to happen: these can never finish
            ctl.records[rid].status, ctl.records[rid].error = "failed", "simulation ended with the request unfinished"
        records = [ctl.records[r.request_id] for r in requests if r.request_id in ctl.records]
        return RunResult(records, ctl.iterations, stats, self.clock.now())
