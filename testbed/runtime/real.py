"""The real runtime: every worker is a process with its own engine and KV
cache; the frontend (this process) releases requests at their arrival times on
the wall clock, routes them through the mode controller, and timestamps every
streamed token on arrival.

Sockets (all on 127.0.0.1): the frontend binds a ROUTER for commands and a
PULL for events; each worker connects a DEALER (identity = worker id) and a
PUSH. Messages are msgpack (testbed/runtime/protocol.py). KV moves worker to
worker over the configured transport, never through the frontend."""
from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import msgpack
import zmq

from testbed.config import RunConfig, to_dict
from testbed.engine import WallClock
from testbed.metrics import IterationRecord, RequestRecord
from testbed.modes.base import ModeController, WorkerInfo
from testbed.request import Request
from testbed.runtime.worker_process import worker_main

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


@dataclass
class RunResult:
    records: list[RequestRecord]
    iterations: list[IterationRecord]
    worker_stats: dict[str, dict] = field(default_factory=dict)
    duration_s: float = 0.0
    interrupted: bool = False


def worker_layout(cfg: RunConfig) -> list[WorkerInfo]:
    if cfg.mode == "colocated":
        specs = [(f"replica{i}", "colocated") for i in range(cfg.replicas)]
    else:
        specs = ([(f"prefill{i}", "prefill") for i in range(cfg.prefill_workers)]
                 + [(f"decode{i}", "decode") for i in range(cfg.decode_workers)])
    return [WorkerInfo(w, role, cfg.num_kv_blocks, cfg.block_size) for w, role in specs]


def make_controller(cfg: RunConfig, workers: list[WorkerInfo], send) -> ModeController:
    if cfg.mode == "colocated":
        from testbed.modes.colocated import ColocatedController
        return ColocatedController(workers, send, cfg.router)
    from testbed.modes.disagg import DisaggController
    return DisaggController(workers, send)


class RealRuntime:
    """`on_event(runtime, event)` is a hook for tests that cause faults at
    precise moments (kill a worker when its KV is in flight, abort a request)."""

    def __init__(self, cfg: RunConfig, on_event: Callable[["RealRuntime", dict], None] | None = None,
                 progress: Callable[[int, int], None] | None = None):
        self.cfg, self.on_event, self.progress = cfg, on_event, progress
        self.workers = worker_layout(cfg)
        self.clock = WallClock()
        self.ctx = zmq.Context()
        self.procs: dict[str, mp.Process] = {}
        self.stats: dict[str, dict] = {}
        self.controller: ModeController | None = None

    # -- sockets -------------------------------------------------------------------
    def _send(self, worker_id: str, msg: dict) -> None:
        if self.controller is not None and worker_id in self.controller.dead:
            return
        try:
            self.cmd.send_multipart([worker_id.encode(), msgpack.packb(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass     # the worker is gone: liveness checks resolve its requests

    def _recv(self, timeout_ms: int) -> list[dict]:
        out = []
        if self.events.poll(timeout_ms):
            while True:
                try:
                    out.append(msgpack.unpackb(self.events.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return out

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        self.cmd = self.ctx.socket(zmq.ROUTER)
        self.cmd.setsockopt(zmq.LINGER, 0)
        self.cmd.setsockopt(zmq.ROUTER_MANDATORY, 1)
        cmd_port = self.cmd.bind_to_random_port("tcp://127.0.0.1")
        self.events = self.ctx.socket(zmq.PULL)
        self.events.setsockopt(zmq.LINGER, 0)
        ev_port = self.events.bind_to_random_port("tcp://127.0.0.1")
        mpctx = mp.get_context("spawn")
        cfg_dict = to_dict(self.cfg)
        dist_addr = None
        if self.cfg.mode == "disagg":
            from testbed.runtime.real_kv_port import uses_torch_dist
            if uses_torch_dist(self.cfg):
                from testbed.kv_transfer import start_rendezvous
                self._store, dist_addr = start_rendezvous(self.cfg.transfer.host, self.cfg.transfer.timeout_s)
        for rank, w in enumerate(self.workers):
            spec = {"worker_id": w.worker_id, "role": w.role, "cfg": cfg_dict, "rank": rank,
                    "world_size": len(self.workers), "cmd_addr": f"tcp://127.0.0.1:{cmd_port}",
                    "event_addr": f"tcp://127.0.0.1:{ev_port}", "t0": self.clock.t0, "dist_addr": dist_addr}
            p = mpctx.Process(target=worker_main, args=(spec,), name=w.worker_id, daemon=True)
            p.start()
            self.procs[w.worker_id] = p
        addresses = self._wait_ready()
        self.controller = make_controller(self.cfg, self.workers, self._send)
        for w in self.workers:
            if w.role == "prefill":
                for peer, addr in addresses.items():
                    if addr:
                        self._send(w.worker_id, {"type": "connect", "peer": peer, "address": addr})

    def _wait_ready(self) -> dict[str, str]:
        addresses: dict[str, str] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(addresses) < len(self.workers):
            for ev in self._recv(100):
                if ev["type"] == "ready":
                    addresses[ev["worker"]] = ev.get("kv_address", "")
                elif ev["type"] == "error":
                    raise RuntimeError(f"worker {ev['worker']} failed to start: {ev['error']}")
            dead = [w for w, p in self.procs.items() if not p.is_alive() and w not in addresses]
            if dead:
                raise RuntimeError(f"worker(s) {dead} exited during start-up (exit codes "
                                   f"{[self.procs[w].exitcode for w in dead]})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {READY_TIMEOUT_S:.0f} s")
        # ROUTER needs the DEALERs connected before it can route to them
        deadline = time.monotonic() + 10
        pending = {w.worker_id for w in self.workers}
        while pending and time.monotonic() < deadline:
            for w in list(pending):
                try:
                    self.cmd.send_multipart([w.encode(), msgpack.packb({"type": "ping"})], flags=zmq.NOBLOCK)
                    pending.discard(w)
                except zmq.ZMQError:
                    time.sleep(0.01)
        return addresses

    def run(self, requests: list[Request]) -> RunResult:
        self.start()
        ctl = self.controller
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        total, interrupted = len(pending), False
        run_start = self.clock.now()
        deadline = run_start + self.cfg.timeout_s + (pending[-1].arrival_s if pending else 0.0)
        next_liveness = 0.0
        try:
            while pending or not ctl.done():
                now = self.clock.now()
                while pending and run_start + pending[0].arrival_s <= now:
                    req = pending.popleft()
                    req.arrival_s = now            # the time the client actually sent it
                    ctl.on_arrival(req, now)
                wait = 50 if not pending else max(0, min(50, int((run_start + pending[0].arrival_s - now) * 1000)))
                for ev in self._recv(wait):
                    self._dispatch(ev)
                now = self.clock.now()
                if now >= next_liveness:
                    next_liveness = now + 0.2
                    for w, p in self.procs.items():
                        if not p.is_alive() and w not in ctl.dead:
                            ctl.on_worker_died(w, now)
                if self.progress:
                    self.progress(total - len(pending) - len(ctl.unresolved), total)
                if now > deadline:
                    for rid in list(ctl.unresolved):
                        ctl.abort(rid, now)
                        ctl.records[rid].status = "failed"
                        ctl.records[rid].error = f"timed out after timeout_s={self.cfg.timeout_s}"
                    break
        except KeyboardInterrupt:
            interrupted = True
            now = self.clock.now()
            for rid in list(ctl.unresolved):
                ctl.abort(rid, now)
                ctl.records[rid].error = "interrupted (Ctrl-C)"
        duration = self.clock.now() - run_start
        self.shutdown()
        records = [ctl.records[r.request_id] for r in requests if r.request_id in ctl.records]
        return RunResult(records, ctl.iterations, self.stats, duration, interrupted)

    def _dispatch(self, ev: dict) -> None:
        if ev["type"] == "stats":
            self.stats[ev["worker"]] = ev
            return
        if ev["type"] == "error":
            raise RuntimeError(f"worker {ev['worker']} crashed: {ev['error']}")
        self.controller.on_event(ev, self.clock.now())
        if self.on_event is not None:
            self.on_event(self, ev)

    def kill(self, worker_id: str) -> None:
        """Kill a worker process for real (fault tests)."""
        p = self.procs[worker_id]
        p.kill()
        p.join(5)

    def shutdown(self) -> None:
        """Stop every worker, collect their final stats, leave no process or port behind."""
        alive = [w for w, p in self.procs.items() if p.is_alive()]
        for w in alive:
            self._send(w, {"type": "stop"})
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(w not in self.stats for w in alive) and time.monotonic() < deadline:
            for ev in self._recv(50):
                if ev["type"] == "stats":
                    self.stats[ev["worker"]] = ev
                elif ev["type"] == "iteration" and self.controller is not None:
                    # the last step's record trails its requests' "finished" events
                    # (and precedes the stats on the same socket): keep it
                    self.controller.on_event(ev, self.clock.now())
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        self.cmd.close(0)
        self.events.close(0)
        self.ctx.term()
        # the rendezvous store listens until it is destroyed, and the controller's
        # bound self._send makes this object live until a garbage-collector pass
        self._store = None
