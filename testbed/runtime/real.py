"""The real runtime: every worker is a process with its own engine and KV
cache, started by the configured launcher (testbed/launchers/); the frontend
(this process) releases requests at their arrival times on the wall clock,
routes them through the mode controller, and timestamps every streamed token
on arrival (testbed/clock.py says why those times stay comparable).

Sockets (bound on `runtime.host`, 127.0.0.1 by default): the frontend binds a
ROUTER for commands and a ROUTER for events; each worker connects a DEALER to
each, its identity its worker id, so every event names its sender
(testbed/runtime/event_gate.py refuses the ones it did not earn). Messages are typed dataclasses in their one
msgpack encoding (testbed/runtime/wire.py). KV moves worker to worker over the
configured transport, never through the frontend."""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import replace
from typing import Callable

import zmq

from testbed.config import RunConfig, to_dict
from testbed.engine import WallClock
from testbed.launchers import WorkerSpec, make_launcher
from testbed.modes.base import ModeController
from testbed.modes.registry import get_role
from testbed.interrupts import deferred
from testbed.request import Request
from testbed.metrics import IterationRecord, RequestRecord
from testbed.record_log import RecordLog
from testbed.runtime.deployment import RunResult, build_mode, record_log
from testbed.runtime.event_gate import EventGate
from testbed.runtime.messages import (Busy, Command, Connect, Event, ExpectSenders, IterationDone, Ping, Pong, Ready,
                                      Stats, Stop, StoreStats, WorkerError)
from testbed.runtime.wire import MAX_MESSAGE_BYTES, WireError, decode, encode
from testbed.wire_text import shown

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
STORE_STOP_S = 2.0             # of STOP_TIMEOUT_S, kept for the KV store, stopped after the workers
STORE_ID = "kvstore"          # the KV store service's id (a mode that needs_store)
STORE_ENTRY = "testbed.runtime.store_process:store_main"
MAX_CMD_REPLY_BYTES = 4096    # nothing is sent to the frontend's command socket: whatever comes is dropped


def child_error(ev: WorkerError) -> str:
    """A worker's (or the store's) reported failure as the frontend's one line.
    A ValueError is a setting it refused, which names its field, and that line
    says all; anything else is a crash, and its traceback (which the child no
    longer prints itself: launchers/local.py) goes to stderr first."""
    if ev.traceback and not ev.error.startswith("ValueError:"):
        print(f"{ev.worker}: {ev.traceback.rstrip()}", file=sys.stderr)
    return ev.error


class _Retiring:
    """The controller's sink: each record to the run's RecordLog, and the
    event gate told that its request ended."""

    def __init__(self, log: RecordLog, gate: EventGate):
        self.log, self.gate = log, gate

    def request(self, record: RequestRecord, arrival_index: int) -> None:
        self.gate.retire(record.request_id, time.monotonic())
        self.log.request(record, arrival_index)

    def iteration(self, record: IterationRecord) -> None:
        self.log.iteration(record)


class RealRuntime:
    """`on_event(runtime, event)` is a hook for tests that cause faults at
    precise moments (kill a worker when its KV is in flight, abort a request);
    `on_send(worker_id, command)` returning False loses that command (a
    dropped acknowledgement)."""

    def __init__(self, cfg: RunConfig, on_event: Callable[["RealRuntime", Event], None] | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 on_send: Callable[[str, Command], bool] | None = None, record_dir=None):
        self.cfg, self.on_event, self.progress, self.on_send = cfg, on_event, progress, on_send
        self.records = record_log(cfg, record_dir)     # where the run's records stream to
        self.mode = build_mode(cfg)
        self.workers = self.mode.workers()
        self.clock = WallClock()
        self.launcher = make_launcher(cfg.launcher, cfg)    # first: it may move this process's network
        self.ctx = zmq.Context()
        self.stats: dict[str, dict] = {}
        self.controller: ModeController | None = None
        self._store = None
        self.store_addr: str | None = None
        self.store_stats: dict | None = None
        self._auth = None           # the ZAP authenticator when runtime.curve (kv_transfer/curve.py)
        self._last_seen: dict[str, float] = {}    # worker -> time.monotonic() of its last event
        self._next_ping = 0.0
        self.gate = EventGate([*(w.worker_id for w in self.workers), *([STORE_ID] if self.mode.needs_store else [])],
                              grace_s=cfg.transfer.lease_s)

    # -- sockets -------------------------------------------------------------------
    def _send(self, worker_id: str, msg: Command) -> None:
        if self.controller is not None and worker_id in self.controller.dead:
            return
        self.gate.on_command(worker_id, msg)
        if self.on_send is not None and not self.on_send(worker_id, msg):
            return
        try:
            self.cmd.send_multipart([worker_id.encode(), encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass     # the worker is gone: liveness checks resolve its requests

    def _recv(self, timeout_ms: int) -> list[Event]:
        out = []
        ready = dict(self.poller.poll(timeout_ms))
        if self.cmd in ready:
            self._drain_cmd()
        if self.events in ready:
            while True:
                try:
                    frames = self.events.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                ev = self._checked(frames)
                if ev is not None:
                    out.append(ev)
                    sender = frames[0].decode()         # the gate checked it is one of the run's
                    if sender in self._last_seen:
                        self._last_seen[sender] = time.monotonic()
        return out

    def _checked(self, frames: list[bytes]) -> Event | None:
        """The event in `frames` ([sender, message]), or None (dropped, one log line)."""
        sender, why = frames[0], None
        if len(frames) != 2:
            why = f"a message of {len(frames) - 1} frames from {shown(sender)}, expected 1"
        else:
            try:
                ev = decode(frames[1])
            except WireError as e:
                why = f"a frame from {shown(sender)}: {e}"
            else:
                if not isinstance(ev, Event):
                    why = f"a '{ev.kind}' command from {shown(sender)}, sent as an event"
                elif self.controller is not None and sender.decode(errors="replace") in self.controller.dead:
                    # sent before it died, read after its requests were resolved or moved: stale
                    why = f"a late '{ev.kind}' from {shown(sender)}, a worker already declared dead"
                else:
                    why = self.gate.refusal(sender, ev)
        if why is None:
            return ev
        print(f"frontend: dropped {why}", file=sys.stderr)
        return None

    def _drain_cmd(self) -> None:
        """Workers never send on the command socket: anything there is a stranger's."""
        while True:
            try:
                frames = self.cmd.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            print(f"frontend: dropped a message from {shown(frames[0])} on the command socket (which takes none)",
                  file=sys.stderr)

    def _heartbeat(self, targets, held: Callable[[], dict[str, list[str]]] | None = None) -> None:
        """Ping `targets` once every runtime.heartbeat_s: they answer Pong (the
        frontend sees a hung worker), and hearing it tells them the frontend
        lives; `held()` (worker -> requests) renews the leases of what they hold."""
        now = time.monotonic()
        if now >= self._next_ping:
            self._next_ping = now + self.cfg.runtime.heartbeat_s
            leases = held() if held is not None else {}
            for w in targets:
                self._send(w, Ping(leases.get(w, [])))

    def _hung(self) -> list[str]:
        """Live workers silent for longer than runtime.hang_timeout_s."""
        limit = time.monotonic() - self.cfg.runtime.hang_timeout_s
        return [w for w, seen in self._last_seen.items() if seen < limit and w not in self.controller.dead]

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> None:
        from testbed.kv_transfer.curve import CurveKeys, check_bind, server_keys
        host = self.cfg.runtime.host
        keys = CurveKeys.generate().to_dict() if self.cfg.runtime.curve else None
        if self.mode.needs_kv_port:     # refused here, before any worker starts
            check_bind(self.cfg.transfer.host, keys, "transfer.host")
        self.cmd = self.ctx.socket(zmq.ROUTER)
        self.cmd.setsockopt(zmq.LINGER, 0)
        self.cmd.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.cmd.setsockopt(zmq.MAXMSGSIZE, MAX_CMD_REPLY_BYTES)    # a bigger frame: ZMQ drops its peer unread
        self._auth = server_keys(self.cmd, keys, host, "runtime.host")
        cmd_port = self.cmd.bind_to_random_port(f"tcp://{host}")
        self.events = self.ctx.socket(zmq.ROUTER)
        self.events.setsockopt(zmq.LINGER, 0)
        self.events.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        server_keys(self.events, keys, host, "runtime.host", auth=self._auth)
        ev_port = self.events.bind_to_random_port(f"tcp://{host}")
        self.poller = zmq.Poller()
        self.poller.register(self.cmd, zmq.POLLIN)
        self.poller.register(self.events, zmq.POLLIN)
        cfg_dict = to_dict(self.cfg)
        dist_addr = None
        if self.mode.needs_kv_port:
            from testbed.runtime.real_kv_port import uses_torch_dist
            if uses_torch_dist(self.cfg.transfer):
                from testbed.kv_transfer import start_rendezvous
                self._store, dist_addr = start_rendezvous(self.cfg.transfer.host, self.cfg.transfer.timeout_s)
        store = WorkerSpec(
            worker_id=STORE_ID, role=STORE_ID, needs_kv_port=False, rank=-1, world_size=len(self.workers),
            cmd_addr=f"tcp://{host}:{cmd_port}", event_addr=f"tcp://{host}:{ev_port}", t0=self.clock.t0,
            dist_addr=None, cfg=cfg_dict, entry=STORE_ENTRY, curve=keys) if self.mode.needs_store else None
        specs = [WorkerSpec(
            worker_id=w.worker_id, role=w.role, needs_kv_port=self.mode.needs_kv_port, rank=rank,
            world_size=len(self.workers), cmd_addr=f"tcp://{host}:{cmd_port}",
            event_addr=f"tcp://{host}:{ev_port}", t0=self.clock.t0, dist_addr=dist_addr, cfg=cfg_dict,
            curve=keys)
            for rank, w in enumerate(self.workers)]
        # every process placed before the first starts: placing (Ray: actors up) blocks this loop, and a
        # store already serving would hear no heartbeat meanwhile
        self.launcher.prepare([*([store] if store else []), *specs])
        if store is not None:          # the store first: the workers are told where it serves
            self.launcher.start(store)
            self.store_addr = self._wait_store_ready()
            specs = [replace(s, store_addr=self.store_addr) for s in specs]
        for spec in specs:
            self.launcher.start(spec)
        addresses = self._wait_ready()
        self.kv_addresses = {w: a for w, a in addresses.items() if a}    # where each KV receiver listens
        self.controller = self.mode.controller(self.workers, self._send, copy_prompts=True)
        self.controller.sink = _Retiring(self.records, self.gate)
        # every worker that sends KV learns where each receiver listens; every receiver learns who may send
        senders = [w.worker_id for w in self.workers if get_role(w.role).sends_kv]
        for w in self.workers:
            if get_role(w.role).sends_kv:
                for peer, addr in addresses.items():
                    if addr:
                        self._send(w.worker_id, Connect(peer, addr))
            if get_role(w.role).receives_kv:
                self._send(w.worker_id, ExpectSenders(senders))

    def _wait_store_ready(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self._heartbeat([STORE_ID])
            for ev in self._recv(100):
                if type(ev) is Ready and ev.worker == STORE_ID:
                    return ev.kv_address
                if type(ev) is WorkerError:
                    raise RuntimeError(f"the KV store failed to start: {child_error(ev)}")
            if not self.launcher.alive(STORE_ID):
                raise RuntimeError(f"the KV store exited during start-up (exit code "
                                   f"{self.launcher.exit_code(STORE_ID)})")
        raise TimeoutError(f"the KV store was not ready after {READY_TIMEOUT_S:.0f} s")

    def _wait_ready(self) -> dict[str, str]:
        addresses: dict[str, str] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(addresses) < len(self.workers):
            # the ready ones (and the store) hear the heartbeat while the others start
            self._heartbeat([*addresses, *([STORE_ID] if self.store_addr else [])])
            for ev in self._recv(100):
                if type(ev) is Ready:
                    addresses[ev.worker] = self.launcher.kv_address(ev.worker, ev.kv_address)
                elif type(ev) is WorkerError:
                    raise RuntimeError(f"worker {ev.worker} failed to start: {child_error(ev)}")
            dead = [w.worker_id for w in self.workers
                    if w.worker_id not in addresses and not self.launcher.alive(w.worker_id)]
            if dead:
                raise RuntimeError(f"worker(s) {dead} exited during start-up (exit codes "
                                   f"{[self.launcher.exit_code(w) for w in dead]})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {READY_TIMEOUT_S:.0f} s")
        # ROUTER needs the DEALERs connected before it can route to them
        deadline = time.monotonic() + 10
        pending = {w.worker_id for w in self.workers}
        while pending and time.monotonic() < deadline:
            for w in list(pending):
                try:
                    self.cmd.send_multipart([w.encode(), encode(Ping())], flags=zmq.NOBLOCK)
                    pending.discard(w)
                except zmq.ZMQError:
                    time.sleep(0.01)
        self._last_seen = {w.worker_id: time.monotonic() for w in self.workers}
        return addresses

    def run(self, requests: list[Request]) -> RunResult:
        """Serve `requests`; whatever goes wrong (a start-up failure, a crashed
        worker, an error in a hook), the workers are stopped before it propagates."""
        try:
            try:
                self.start()
            except KeyboardInterrupt:      # Ctrl-C or SIGTERM (testbed/interrupts.py) before serving began
                with deferred():
                    self.launcher.join(0.0)     # nothing served yet: a worker still starting is killed, not awaited
                self.shutdown()
                # no request had arrived (their clock starts with serving): none is recorded, as
                # when a run is interrupted before a later request's arrival
                self.records.close()
                return RunResult(self.records, self.stats, 0.0, True, self.store_stats)
            return self._serve(requests)
        except BaseException:
            self.shutdown()
            self.records.close()
            raise


    def _serve(self, requests: list[Request]) -> RunResult:
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
                    self._heartbeat([*(w.worker_id for w in self.workers if w.worker_id not in ctl.dead),
                                     *([STORE_ID] if self.store_addr else [])], ctl.held_by)
                    for w in self.workers:
                        if w.worker_id not in ctl.dead and not self.launcher.alive(w.worker_id):
                            ctl.on_worker_died(w.worker_id, now)
                    for w in self._hung():
                        print(f"frontend: worker {w} sent nothing for {self.cfg.runtime.hang_timeout_s:g} s "
                              f"(runtime.hang_timeout_s): hung; killing it and failing its requests", file=sys.stderr)
                        self.launcher.kill(w)
                        ctl.on_worker_died(w, now, f"worker {w} hung (silent for "
                                                   f"{self.cfg.runtime.hang_timeout_s:g} s)")
                if self.progress:
                    self.progress(total - len(pending) - len(ctl.unresolved), total)
                if now > deadline:
                    for rid in list(ctl.unresolved):
                        ctl.abort(rid, now, "failed", f"timed out after timeout_s={self.cfg.timeout_s}")
                    break
        except KeyboardInterrupt:
            interrupted = True
            now = self.clock.now()
            for rid in list(ctl.unresolved):
                ctl.abort(rid, now, error="interrupted (Ctrl-C)")
        duration = self.clock.now() - run_start
        self.shutdown()
        ctl.end_run("the run ended before the request did")    # records a mode still completed go now
        self.records.close()
        return RunResult(self.records, self.stats, duration, interrupted, self.store_stats)

    def _dispatch(self, ev: Event) -> None:
        if type(ev) is Pong or type(ev) is Busy:
            return                     # proof of life only: _recv noted when it came
        if type(ev) is Stats:
            self.stats[ev.worker] = ev.to_dict()
            return
        if type(ev) is StoreStats:
            self.store_stats = ev.to_dict()
            return
        if type(ev) is WorkerError and ev.worker == STORE_ID:
            print(f"frontend: the KV store crashed: {child_error(ev)}", file=sys.stderr)
            return       # the workers fall back to recompute
        if type(ev) is WorkerError:
            raise RuntimeError(f"worker {ev.worker} crashed: {child_error(ev)}")
        self.controller.on_event(ev, self.clock.now())
        if self.on_event is not None:
            self.on_event(self, ev)

    def _collect_stats(self, done: Callable[[], bool], deadline: float) -> None:
        """Read the stopping processes' events until done() or the deadline."""
        while not done() and time.monotonic() < deadline:
            for ev in self._recv(50):
                if type(ev) is StoreStats:
                    self.store_stats = ev.to_dict()
                elif type(ev) is Stats:
                    self.stats[ev.worker] = ev.to_dict()
                elif type(ev) is IterationDone and self.controller is not None:
                    # the last step's record trails its requests' Finished events
                    # (and precedes the stats on the same socket): keep it
                    self.controller.on_event(ev, self.clock.now())

    def kill(self, worker_id: str) -> None:
        """Kill a worker process for real (fault tests), and act on its death at
        once: what it sent before dying and this process has not read yet is stale."""
        self.launcher.kill(worker_id)
        if self.controller is not None and worker_id not in self.controller.dead:
            self.controller.on_worker_died(worker_id, self.clock.now())

    def shutdown(self) -> None:
        """Stop every worker, collect their final stats, leave no process or port behind.
        Safe to call twice, and before start() got far. Bounded (STOP_TIMEOUT_S):
        a Ctrl-C or SIGTERM meanwhile is ignored rather than cutting it short."""
        if self.ctx.closed:
            return
        with deferred():
            self._shutdown()

    def _shutdown(self) -> None:
        from testbed.kv_transfer.curve import stop_authenticator
        if not hasattr(self, "events"):         # start() failed before its sockets existed
            self.launcher.join(0.0)
            if hasattr(self, "cmd"):
                self.cmd.close(0)
            stop_authenticator(self._auth)
            self.ctx.term()
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        alive = [w.worker_id for w in self.workers if self.launcher.alive(w.worker_id)]
        for w in alive:
            self._send(w, Stop())
        # the store last: a worker publishes its last blocks before it reports its stats (a worker
        # that never reports leaves the store the last STORE_STOP_S of the deadline)
        store = self.store_addr is not None
        self._collect_stats(lambda: all(w in self.stats for w in alive), deadline - (STORE_STOP_S if store else 0))
        if store and self.launcher.alive(STORE_ID):
            self._send(STORE_ID, Stop())
            self._collect_stats(lambda: self.store_stats is not None, deadline)
        self.launcher.join(max(0.0, deadline - time.monotonic()))
        self.cmd.close(0)
        self.events.close(0)
        stop_authenticator(self._auth)
        self.ctx.term()
        # the rendezvous store listens until it is destroyed, and the controller's
        # bound self._send makes this object live until a garbage-collector pass
        self._store = None
