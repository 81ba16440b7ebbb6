"""The body of the KV store's process in the real runtime (mode=kvstore):
serve the store (kv_transfer/store_service.py) on its own socket, and take the
frontend's commands (Stop) and report Ready / StoreStats like a worker.
Started by a launcher from a WorkerSpec whose entry names this function."""
from __future__ import annotations

import logging
import signal
import threading
import time

import zmq

from testbed.kv_transfer.store_service import StoreServer
from testbed.launchers.base import ReportedError

log = logging.getLogger(__name__)

def store_main(spec) -> None:
    """The store process: serve until the frontend says Stop (or kills it)."""
    if threading.current_thread() is threading.main_thread():     # not so in every Ray actor
        signal.signal(signal.SIGINT, signal.SIG_IGN)      # the frontend owns shutdown, as for workers
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from testbed.config import from_dict
    from testbed.runtime.messages import Ping, Pong, Ready, Stop, StoreStats, WorkerError
    from testbed.runtime.wire import WireError
    from testbed.runtime.wire import decode as decode_msg
    from testbed.runtime.wire import encode as encode_msg

    ctx = zmq.Context()
    from testbed.kv_transfer.curve import client_keys
    push = ctx.socket(zmq.DEALER)           # events: the identity names the sender (runtime/event_gate.py)
    push.setsockopt(zmq.LINGER, 2000)
    push.setsockopt(zmq.IDENTITY, spec.worker_id.encode())
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, spec.worker_id.encode())
    for sock in (push, dealer):
        client_keys(sock, spec.curve)
    push.connect(spec.event_addr)
    dealer.connect(spec.cmd_addr)
    server = None
    try:
        cfg = from_dict(spec.cfg)
        push.setsockopt(zmq.SNDTIMEO, int(cfg.runtime.frontend_timeout_s * 1000))   # a dead frontend: zmq.Again
        server = StoreServer(cfg.kvstore, cfg.runtime.host, ctx)
        push.send(encode_msg(Ready(spec.worker_id, server.address)))
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(server.sock, zmq.POLLIN)
        stopping, last_heard = False, time.monotonic()
        while not stopping:
            ready = dict(poller.poll(1 if server._sending else 50))
            if dealer in ready:
                while dealer.poll(0):
                    last_heard = time.monotonic()
                    try:
                        msg = decode_msg(dealer.recv())
                    except WireError as e:
                        log.warning("kv store: dropped a command: %s", e)
                        continue
                    if type(msg) is Stop:
                        stopping = True
                    elif type(msg) is Ping:
                        try:
                            push.send(encode_msg(Pong(spec.worker_id)))
                        except zmq.Again:
                            last_heard = float("-inf")      # the frontend is gone: exit below
                    else:
                        log.warning("kv store: takes no '%s' command", msg.kind)
            if time.monotonic() - last_heard > cfg.runtime.frontend_timeout_s:
                log.warning("kv store: no word from the frontend for %g s (runtime.frontend_timeout_s): exiting",
                            cfg.runtime.frontend_timeout_s)
                push.setsockopt(zmq.LINGER, 0)
                return
            server.serve()
        index = server.index
        push.send(encode_msg(StoreStats(spec.worker_id, index.counters, len(index), index.used_bytes,
                                        index.capacity_bytes)))
    except Exception as e:
        import traceback
        try:
            push.send(encode_msg(WorkerError(spec.worker_id, f"{type(e).__name__}: {e}", traceback.format_exc())),
                      flags=0 if push.getsockopt(zmq.SNDTIMEO) >= 0 else zmq.NOBLOCK)
        except zmq.ZMQError:
            raise e from None          # unheard: the exit code and this traceback speak instead
        raise ReportedError(f"{type(e).__name__}: {e}") from e
    finally:
        if server is not None:
            server.close()
        dealer.close(0)
        push.close()
        ctx.term()
