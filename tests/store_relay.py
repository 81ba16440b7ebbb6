"""StoreRelay: a thread between the workers and the real KV store, for
faults that must land between two of the store's messages. A ROUTER in
front, one DEALER to the store per client behind (each client's messages
stay in order); subclasses see every request (`on_request`) before it is
forwarded and every reply (`on_reply`) before it goes back. RelayedRuntime:
a real run whose workers are told the relay's address instead of the store's."""
from __future__ import annotations

import threading
from typing import Callable

import zmq

from testbed.kv_transfer import store_wire as wire
from testbed.runtime.real import RealRuntime


class StoreRelay(threading.Thread):
    def __init__(self, store_addr: str, host: str):
        super().__init__(daemon=True)
        self.store_addr = store_addr
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://{host}:{self.front.bind_to_random_port(f'tcp://{host}')}"
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def on_request(self, client: bytes, header: dict) -> None:
        pass

    def on_reply(self, client: bytes, reply: dict) -> None:
        pass

    def run(self) -> None:
        try:
            self._relay()
        except BaseException as e:     # noqa: BLE001 (the test reads it)
            self.error = e
        finally:
            self.ctx.destroy(0)

    def _relay(self) -> None:
        backs: dict[bytes, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self.front:
                    ident, header, *data = self.front.recv_multipart()
                    if ident not in backs:
                        backs[ident] = self.ctx.socket(zmq.DEALER)
                        backs[ident].setsockopt(zmq.LINGER, 0)
                        backs[ident].connect(self.store_addr)
                        poller.register(backs[ident], zmq.POLLIN)
                    self.on_request(ident, wire.decode(header))
                    backs[ident].send_multipart([header, *data])
                else:
                    ident = next(i for i, b in backs.items() if b is sock)
                    reply, *frames = sock.recv_multipart()
                    self.on_reply(ident, wire.decode(reply))
                    self.front.send_multipart([ident, reply, *frames])


class RelayedRuntime(RealRuntime):
    """`make_relay(store_address, host)` builds the relay once the store is up;
    run() stops it at the end (the test reads `relay.error`)."""

    def __init__(self, cfg, make_relay: Callable[[str, str], StoreRelay], **kwargs):
        super().__init__(cfg, **kwargs)
        self.make_relay = make_relay
        self.relay: StoreRelay | None = None

    def _wait_store_ready(self) -> str:
        self.relay = self.make_relay(super()._wait_store_ready(), self.cfg.runtime.host)
        self.relay.start()
        return self.relay.address

    def run(self, requests):
        try:
            return super().run(requests)
        finally:
            if self.relay is not None:
                self.relay.stop.set()
                self.relay.join(5)
