"""A stranger on node B (started there by two_nodes_driver.py): for each
address given (the frontend's command and event sockets, a KV receiver), a
DEALER with no CURVE at all and one posing as a CURVE client with keys of its
own (it cannot know the run's), both claiming a worker's identity, send junk
that a server reading it would have to reject, and wait for anything to come
back. Prints one JSON line: per address and kind the messages received (must
be 0), and whether a plain TCP connect succeeds (the veth is open: the
refusal is CURVE's, not the network's)."""
from __future__ import annotations

import json
import socket
import sys
import time
from urllib.parse import urlparse

import zmq


def tcp_reachable(address: str) -> bool:
    url = urlparse(address)
    try:
        socket.create_connection((url.hostname, url.port), timeout=2).close()
        return True
    except OSError:
        return False


def main(addresses: list[str]) -> dict:
    out = {f"{a} tcp": {"connect": tcp_reachable(a)} for a in addresses}
    ctx = zmq.Context()
    socks = {}
    try:
        for address in addresses:
            for kind in ("plain", "forged"):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, b"decode0")        # posing as a worker of the run
                if kind == "forged":
                    fake_server, _ = zmq.curve_keypair()
                    sock.curve_serverkey = fake_server
                    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                sock.connect(address)
                socks[f"{address} {kind}"] = sock
        queued = {name: sum(_try_send(sock) for _ in range(5)) for name, sock in socks.items()}
        received = dict.fromkeys(socks, 0)
        poller = zmq.Poller()
        for sock in socks.values():
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + 2.0
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000)):
                sock.recv_multipart()
                received[next(n for n, s in socks.items() if s is sock)] += 1
        out.update({name: {"received": received[name], "queued": queued[name]} for name in socks})
    finally:
        for sock in socks.values():
            sock.close(0)
        ctx.term()
    return out


def _try_send(sock: zmq.Socket) -> int:
    try:
        sock.send_multipart([b"H", b"not a header"], zmq.NOBLOCK)
        return 1
    except zmq.Again:
        return 0


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
