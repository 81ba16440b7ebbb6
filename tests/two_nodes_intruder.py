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
    ctx = zmq.Context()
    out = {}
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
                sent = 0
                for _ in range(5):
                    try:
                        sock.send_multipart([b"H", b"not a header"], zmq.NOBLOCK)
                        sent += 1
                    except zmq.Again:
                        pass
                got = 0
                if sock.poll(1500, zmq.POLLIN):
                    while True:
                        try:
                            sock.recv(zmq.NOBLOCK)
                            got += 1
                        except zmq.Again:
                            break
                out[f"{address} {kind}"] = {"received": got, "queued": sent}
                sock.close(0)
            out[f"{address} tcp"] = {"connect": tcp_reachable(address)}
    finally:
        ctx.term()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
