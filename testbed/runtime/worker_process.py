"""The body of a worker process in the real runtime: build the engine and the
role's WorkerService, then loop: take commands, step the engine, stream events
back. Started by a launcher (testbed/launchers/) from a WorkerSpec.

Two halves, so that a launcher can hand the worker's endpoints back through
its own channel before the loop starts (a Ray actor returns them from a
method call): `WorkerProcess(spec)` builds everything and announces Ready,
`serve()` runs until Stop. `worker_main` is both, for a plain process."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import zmq

from testbed.launchers.base import ReportedError

POLL_IDLE_MS = 5


class FrontendGone(Exception):
    """No word from the frontend for runtime.frontend_timeout_s, or an event it
    could not take for as long (a DEALER with no peer blocks): the worker exits."""


class WorkerProcess:
    def __init__(self, spec) -> None:
        # Ctrl-C in a terminal signals the whole process group. The frontend owns
        # shutdown (abort, stop, collect stats); a worker interrupted mid-step would
        # die with a traceback and never report its final block counts.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)     # the same for a SIGTERM to the process group
        import torch

        from testbed.config import from_dict
        from testbed.engine import WallClock
        from testbed.modes.registry import get_role
        from testbed.runtime.build import build_engine, build_worker
        from testbed.runtime.messages import Ready

        self.spec = spec
        self.ctx = zmq.Context()
        # events go on a DEALER of their own whose identity names the sender (runtime/event_gate.py)
        self.push = self.ctx.socket(zmq.DEALER)
        self.push.setsockopt(zmq.LINGER, 2000)
        self.push.setsockopt(zmq.IDENTITY, spec.worker_id.encode())
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IDENTITY, spec.worker_id.encode())
        self.kv_port = self.store = None
        self._send_lock = threading.Lock()     # the step watch's thread sends on `push` too
        try:
            from testbed.kv_transfer.curve import client_keys
            for sock in (self.push, self.dealer):
                client_keys(sock, spec.curve)
            # connected first, so that a start-up failure below reaches the frontend as a WorkerError
            self.push.connect(spec.event_addr)
            self.dealer.connect(spec.cmd_addr)
            cfg = from_dict(spec.cfg)
            self.frontend_timeout_s = cfg.runtime.frontend_timeout_s
            self.heartbeat_s = cfg.runtime.heartbeat_s
            self.lease_s = cfg.transfer.lease_s
            self.push.setsockopt(zmq.SNDTIMEO, int(self.frontend_timeout_s * 1000))
            torch.set_num_threads(cfg.torch_threads)
            engine = build_engine(cfg, spec.role, WallClock(spec.t0))
            if spec.needs_kv_port:
                from testbed.runtime.real_kv_port import RealKVPort
                role = get_role(spec.role)
                self.kv_port = RealKVPort(cfg.transfer, spec, engine, sends=role.sends_kv, receives=role.receives_kv)
            if get_role(spec.role).uses_store and spec.store_addr:
                from testbed.kv_transfer.store_client import StoreClient
                from testbed.runtime.real_store_port import RealStorePort
                self.store = RealStorePort(StoreClient(spec.store_addr, cfg.kvstore.timeout_s, cfg.kvstore.retry_s,
                                                       spec.worker_id), engine.executor.kv_cache)
            self.service = build_worker(spec.worker_id, spec.role, engine, self.emit, self.kv_port,
                                        cfg.transfer.layerwise, self.store)
            self.emit(Ready(spec.worker_id, self.address))
        except Exception as e:
            reported = self._fail(e)
            self.close()
            if reported:
                raise ReportedError(f"{type(e).__name__}: {e}") from e
            raise

    @property
    def address(self) -> str:
        """Where this worker's KV receiver listens ("" for a worker that receives none)."""
        return self.kv_port.address if self.kv_port else ""

    def emit(self, ev) -> None:
        from testbed.runtime.wire import encode
        try:
            with self._send_lock:
                self.push.send(encode(ev))
        except zmq.Again:
            raise FrontendGone(f"an event waited {self.frontend_timeout_s:g} s for the frontend") from None

    def _fail(self, e: Exception) -> bool:
        """Report, then the caller exits non-zero: the frontend fails this worker's requests.
        Never waits for good: before the config gave the send its time-out, a report that
        cannot be queued at once (the sockets never connected) is dropped, and the exit
        code speaks instead. Returns whether the report went out."""
        from testbed.runtime.messages import WorkerError
        from testbed.runtime.wire import encode
        try:
            with self._send_lock:
                self.push.send(encode(WorkerError(self.spec.worker_id, f"{type(e).__name__}: {e}",
                                                  traceback.format_exc())),
                               flags=0 if self.push.getsockopt(zmq.SNDTIMEO) >= 0 else zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def serve(self) -> None:
        from testbed.runtime.messages import Busy, Command
        from testbed.runtime.step_watch import StepWatch
        from testbed.runtime.wire import WireError, decode
        service, dealer, kv_port = self.service, self.dealer, self.kv_port
        worker_id = self.spec.worker_id
        # inside a step the worker reads no Ping: while the step computes, this says it lives
        watch = StepWatch(lambda step_s: self._send_quietly(Busy(worker_id, step_s)), self.heartbeat_s)
        last_heard = time.monotonic()       # the frontend pings every runtime.heartbeat_s
        next_lease_check = 0.0
        # a worker awaiting KV sleeps until a command or its KV comes (it had woken
        # every 1 ms for as long as the prompt took to prefill and send)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        kv_socket = kv_port.wake_socket() if kv_port is not None else None
        if kv_socket is not None:
            poller.register(kv_socket, zmq.POLLIN)
        try:
            while not service.stopping:
                timeout = 0 if service.engine.has_work() else \
                    (1 if kv_socket is None and service.awaits_kv() else POLL_IDLE_MS)
                if dealer in dict(poller.poll(timeout)):
                    while True:
                        try:
                            raw = dealer.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        last_heard = time.monotonic()
                        try:
                            msg = decode(raw)
                        except WireError as e:      # only the frontend reaches this socket: its bug, not a reason to die
                            print(f"worker {self.spec.worker_id}: dropped a command: {e}", file=sys.stderr)
                            continue
                        if not isinstance(msg, Command):
                            print(f"worker {self.spec.worker_id}: dropped a '{msg.kind}' event sent as a command",
                                  file=sys.stderr)
                            continue
                        service.handle(msg)          # Ping included: answered with Pong
                now = time.monotonic()
                if now - last_heard > self.frontend_timeout_s:
                    raise FrontendGone(f"no word from the frontend for {self.frontend_timeout_s:g} s")
                if now >= next_lease_check:
                    next_lease_check = now + min(0.1, self.lease_s / 10)
                    service.expire_leases(service.engine.clock.now(), self.lease_s)
                if not service.stopping:
                    if kv_port is not None:
                        kv_port.pump(service)
                    with watch.step():
                        out = service.step()
                    if out is not None:
                        # let ZMQ's I/O thread send this step's events now: woken on
                        # this core, it otherwise waited for the next step to end its
                        # CFS slice (experiments/benchmarks/bench_event_latency.py)
                        os.sched_yield()
            if self.store is not None:
                self.store.flush()           # its last publishes land before the frontend stops the store
            self.emit(service.stats())
        except FrontendGone as e:
            print(f"worker {self.spec.worker_id}: {e} (runtime.frontend_timeout_s): it is gone, exiting",
                  file=sys.stderr)
            self.push.setsockopt(zmq.LINGER, 0)      # nobody is left to read what is queued
        except Exception as e:
            if self._fail(e):
                raise ReportedError(f"{type(e).__name__}: {e}") from e
            raise
        finally:
            watch.close()
            self.close()

    def _send_quietly(self, ev) -> None:
        """emit() from the step watch's thread: a frontend that cannot take it is
        the main loop's to find (FrontendGone), not a reason to end the thread."""
        try:
            self.emit(ev)
        except (FrontendGone, zmq.ZMQError):
            pass

    def close(self) -> None:
        if self.ctx.closed:
            return
        if self.kv_port is not None:
            self.kv_port.close()
        if self.store is not None:
            self.store.close()
        self.dealer.close(0)
        self.push.close()
        self.ctx.term()


def worker_main(spec) -> None:
    WorkerProcess(spec).serve()
