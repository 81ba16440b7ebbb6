"""CURVE beyond loopback (kv_transfer/curve.py), over real sockets: a bind to
a non-loopback address without keys is refused with one line, before any
socket is bound (KV receiver, frontend); with the run's keys the KV transport
works; a peer without the keys (no CURVE at all, or the server's public key
but a client key of its own) is never heard; the key file is 0600; a real run
with runtime.curve=true serves every request."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
import zmq

from testbed.config import from_dict
from testbed.kv_transfer import TransferConfig, make_receiver, make_sender, pack_kv
from testbed.kv_transfer.curve import CurveKeys, CurveRequired, is_loopback
from testbed.runtime.real import RealRuntime

NOT_LOOPBACK = "198.51.100.7"        # TEST-NET-2: never assigned here; refused before any bind


def payload(rid: str):
    cache = torch.randn(2, 2, 8, 4, 1, 8, generator=torch.Generator().manual_seed(0))
    return pack_kv(cache, (0, 2), [1, 2], [3, 4], 8, rid)


def receive(receiver, n: int, timeout_s: float) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += receiver.poll(100)
    return got


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.4.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback(NOT_LOOPBACK) and not is_loopback("0.0.0.0") and not is_loopback("eth0")


def test_kv_receiver_beyond_loopback_without_keys_is_refused():
    with pytest.raises(CurveRequired) as e:
        make_receiver(TransferConfig(host=NOT_LOOPBACK))
    msg = str(e.value)
    assert "\n" not in msg and NOT_LOOPBACK in msg and "runtime.curve=true" in msg


def test_frontend_beyond_loopback_without_keys_is_refused():
    for section in ({"runtime": {"host": NOT_LOOPBACK}}, {"mode": "disagg", "transfer": {"host": NOT_LOOPBACK}}):
        cfg = from_dict({**section, "progress": False, "wandb": {"mode": "disabled"}})
        with pytest.raises(CurveRequired, match="without CURVE keys"):
            RealRuntime(cfg).run([])


def test_only_a_peer_with_the_keys_is_heard():
    keys = CurveKeys.generate()
    cfg = TransferConfig(timeout_s=5)
    receiver = make_receiver(cfg, curve=keys)
    sender = make_sender(cfg, name="good", curve=keys)
    ctx = zmq.Context()
    strangers = []
    try:
        sender.connect("r", receiver.address)
        sender.send("r", payload("with-keys"))
        got = receive(receiver, 1, 10)
        assert [(p.request_id, p.error) for p in got] == [("with-keys", None)]

        plain = ctx.socket(zmq.DEALER)                     # no CURVE at all
        own_pub, own_sec = zmq.curve_keypair()
        forged = ctx.socket(zmq.DEALER)                    # the server's public key, its own client key
        forged.curve_serverkey, forged.curve_publickey, forged.curve_secretkey = \
            keys.server_public.encode(), own_pub, own_sec
        for name, sock in (("plain", plain), ("forged", forged)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, name.encode())
            sock.connect(receiver.address)
            strangers.append(sock)
        for sock in strangers:        # junk that the receiver would reject (and count) if it saw it
            for _ in range(3):
                sock.send_multipart([b"H", b"not a header"], zmq.NOBLOCK)
        assert receive(receiver, 1, 2.0) == []
        assert receiver.num_rejected == 0, "a stranger's message reached the receiver"
        # the good peer is still served afterwards
        sender.send("r", payload("again"))
        assert [p.request_id for p in receive(receiver, 1, 10)] == ["again"]
    finally:
        for sock in strangers:
            sock.close(0)
        ctx.term()
        sender.close()
        receiver.close()


def test_key_file_is_private(tmp_path):
    keys = CurveKeys.generate()
    path = str(tmp_path / "keys.json")
    keys.write(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert CurveKeys.read(path) == keys
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="0600"):
        CurveKeys.read(path)
    assert set(json.loads(open(path).read())) == {"server_public", "server_secret", "client_public", "client_secret"}


def test_a_run_with_curve_keys_serves_every_request(tmp_path):
    """disagg 1P1D, every socket (frontend and KV) under the run's CURVE keys."""
    from testbed.run import execute
    cfg = from_dict({"mode": "disagg", "runtime": {"curve": True}, "token_budget": 64, "progress": False,
                     "wandb": {"mode": "disabled"}, "timeout_s": 60,
                     "workload": {"num_requests": 3, "prompt_min": 16, "prompt_max": 96, "output_min": 4, "output_max": 6}})
    summary = execute(cfg, tmp_path)
    assert summary["num_finished"] == 3 and summary["kv_blocks_leaked"] == {}
