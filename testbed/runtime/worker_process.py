"""The body of a worker process in the real runtime: build the engine and the
role's WorkerService, then loop: take commands, step the engine, stream events
back. Started by a launcher (testbed/launchers/) from a WorkerSpec."""
from __future__ import annotations

import os
import signal
import sys
import traceback

import zmq

POLL_IDLE_MS = 5


def worker_main(spec) -> None:
    # Ctrl-C in a terminal signals the whole process group. The frontend owns
    # shutdown (abort, stop, collect stats); a worker interrupted mid-step would
    # die with a traceback and never report its final block counts.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from testbed.config import from_dict
    from testbed.engine import WallClock
    from testbed.modes.registry import get_role
    from testbed.runtime.build import build_engine, build_worker
    from testbed.runtime.messages import Ping, Ready, WorkerError
    from testbed.runtime.wire import WireError, decode, encode

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(spec.event_addr)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, spec.worker_id.encode())
    dealer.connect(spec.cmd_addr)

    def emit(ev) -> None:
        push.send(encode(ev))

    kv_port = store = None
    try:
        cfg = from_dict(spec.cfg)
        torch.set_num_threads(cfg.torch_threads)
        engine = build_engine(cfg, spec.role, WallClock(spec.t0))
        if spec.needs_kv_port:
            from testbed.runtime.real_kv_port import RealKVPort
            role = get_role(spec.role)
            kv_port = RealKVPort(cfg.transfer, spec, engine, sends=role.sends_kv, receives=role.receives_kv)
        store = None
        if get_role(spec.role).uses_store and spec.store_addr:
            from testbed.kv_transfer.store_client import StoreClient
            from testbed.runtime.real_store_port import RealStorePort
            store = RealStorePort(StoreClient(spec.store_addr, cfg.kvstore.timeout_s, cfg.kvstore.retry_s,
                                              spec.worker_id), engine.executor.kv_cache)
        service = build_worker(spec.worker_id, spec.role, engine, emit, kv_port, cfg.transfer.layerwise, store)
        emit(Ready(spec.worker_id, kv_port.address if kv_port else ""))
        while not service.stopping:
            timeout = 0 if service.engine.has_work() else (1 if service.awaits_kv() else POLL_IDLE_MS)
            if dealer.poll(timeout):
                while True:
                    try:
                        raw = dealer.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = decode(raw)
                    except WireError as e:      # only the frontend reaches this socket: its bug, not a reason to die
                        print(f"worker {spec.worker_id}: dropped a command: {e}", file=sys.stderr)
                        continue
                    if type(msg) is not Ping:
                        service.handle(msg)
            if not service.stopping:
                if kv_port is not None:
                    kv_port.pump(service)
                if service.step() is not None:
                    # let ZMQ's I/O thread send this step's events now: woken on
                    # this core, it otherwise waited for the next step to end its
                    # CFS slice (experiments/benchmarks/bench_event_latency.py)
                    os.sched_yield()
        emit(service.stats())
    except Exception as e:  # report, then exit non-zero: the frontend fails this worker's requests
        emit(WorkerError(spec.worker_id, f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise
    finally:
        if kv_port is not None:
            kv_port.close()
        if store is not None:
            store.close()
        dealer.close(0)
        push.close()
        ctx.term()
