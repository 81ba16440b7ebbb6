"""A hostile local peer on every socket of a running `mode=disagg` run: the
frontend's command and event sockets and the decode worker's KV receiver get
truncated, garbled and oversized frames, and the event socket well-formed but
spoofed events (from a stranger, and from a peer that takes a worker's
identity); the KV receiver also gets well-formed, checksummed KV for a real
reservation from a sender that is not one of the run's, which it refuses. The
run goes on and every request finishes with the reference tokens
(tests/test_disagg_faults.py's helpers: blocks free, no process or port left
over); each dropped frame leaves one log line that names its sender as text; a
frame declaring a terabyte is refused from its size prefix (the connection is
closed at once, nothing waits for or allocates its body).

The sender-identity rules a stranger cannot reach (a worker's events naming
another worker, or about a request it was never sent) need a peer that holds a
worker's identity, which ZMQ gives to the first to connect: they are tested
on EventGate directly, with the messages a run would see."""
from __future__ import annotations

import socket
import struct
import time

import msgpack
import torch
import zmq

from testbed.kv_transfer import TransferConfig, make_sender, pack_kv
from testbed.kv_transfer.payload import HEADER_VERSION

from testbed.runtime.build import apply_sampling
from testbed.runtime.event_gate import EventGate
from testbed.runtime.messages import (Finished, HandOffMeta, Prefill, PrefixFetched, RequestMsg, Reserve, Reserved,
                                      Tokens)
from testbed.runtime.real import RealRuntime
from testbed.runtime.wire import encode
from testbed.workloads.build import build_workload
from tests.test_disagg_faults import Watch, check, config, run
from tests.test_kvstore import colocated  # noqa: F401  (a fixture: the colocated run's tokens)
from tests.test_kvstore import config as kvstore_config

TERABYTE = 1 << 40


def zmtp_oversized(endpoint: str, size: int = TERABYTE) -> bool:
    """Speak ZMTP 3.0 (NULL mechanism) as a DEALER over a plain TCP socket and
    announce one frame of `size` bytes, sending none of it. True when the
    receiver closed the connection within 2 s, as ZMQ does for a frame over the
    socket's ZMQ_MAXMSGSIZE before allocating it."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as s:
        s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
        s.recv(64)                                          # the peer's greeting
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        s.sendall(b"\x04" + bytes([len(ready)]) + ready)
        time.sleep(0.1)
        s.sendall(b"\x02" + struct.pack(">Q", size))        # a long frame: flags, 8-byte size, no body
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                if s.recv(4096) == b"":
                    return True
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
    return False


def dealer(ctx: zmq.Context, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def kv_header(request_id: str, shape: list[int]) -> bytes:
    n = 4
    for d in shape:
        n *= d
    return msgpack.packb({"v": HEADER_VERSION, "request_id": request_id, "layer_start": 0, "layer_end": shape[0],
                          "block_ids": list(range(shape[2])), "num_tokens": 16, "dtype": "float32",
                          "shape": shape, "checksum": 0, "nbytes": n, "last": True, "meta": {}})


def test_hostile_peer_on_every_socket_of_a_disagg_run(capfd):
    cfg = config()
    watch, attacked, closed = Watch(), [], {}
    ctx = zmq.Context()

    def attack(rt: RealRuntime, victim: str) -> None:
        cmd = rt.cmd.getsockopt(zmq.LAST_ENDPOINT).decode()
        events = rt.events.getsockopt(zmq.LAST_ENDPOINT).decode()
        kv = rt.kv_addresses["decode0"]
        anon = dealer(ctx, events)                    # ZMQ names it 0x00 + 4 random bytes
        anon.send(b"\x00\x01")                        # the bytes that once ended a run
        anon.send(encode(Finished.failed(victim, "spoofed"))[:7])            # truncated
        anon.send(bytes(range(256)) * 4)                                       # garbled
        anon.send_multipart([b"one", b"two"])                                 # two frames
        mallory = dealer(ctx, events, b"mallory")
        mallory.send(encode(Finished.failed(victim, "spoofed by mallory")))
        mallory.send(encode(Tokens("decode0", [(victim, 7, 0.0, 1)])))
        mallory.send(encode(Reserve(RequestMsg(victim, [1], 1, 0.0, 0.0, 1.0, 0, True, None))))
        # a worker's identity is taken: ZMQ refuses a second peer with it, unheard
        impostor = dealer(ctx, events, b"decode0")
        impostor.send(encode(Finished.failed(victim, "spoofed as decode0")))
        impostor.send(encode(Tokens("decode0", [(victim, 7, 0.0, 1)])))
        stranger = dealer(ctx, cmd)
        stranger.send(b"\x00\x01")
        stranger.send(encode(Finished.failed(victim, "on the command socket")))
        thief = dealer(ctx, kv)
        thief.send(b"\x00\x01")                                               # a chunk, no payload open
        thief.send_multipart([b"H", b"\x00\x01"])                             # truncated header
        thief.send_multipart([b"H", b"\x93" * (100 << 10)])                   # header over 64 KiB
        thief.send_multipart([b"H", kv_header("mallory-0", [4, 2, 1, 1 << 20, 1 << 10, 64])])   # 2 TiB declared
        thief.send_multipart([b"Q", b"?"])                                    # unknown kind
        # well-formed, checksummed KV for the victim's real reservation, with a made-up first token:
        # were it taken, the victim would decode from it (it arrives before the prefill has begun)
        n = -(-rt.controller.handoffs[victim].request.prompt_len // 16)
        fake = torch.randn(4, 2, n, 16, 2, 32)              # tiny: 4 layers, 2 kv heads of 32, fp32
        meta = HandOffMeta(7, 0.0, 0.0, 0.0, 0).to_dict()
        forger = make_sender(TransferConfig(), name="mallory")
        forger.connect("decode0", kv)
        forger.send("decode0", pack_kv(fake, (0, 4), list(range(n)), reserved_blocks[:n], n * 16, victim, meta=meta))
        forger.flush()
        forgers.append(forger)
        time.sleep(0.3)
        closed.update({name: zmtp_oversized(ep) for name, ep in
                       (("commands", cmd), ("events", events), ("kv receiver", kv))})

    def hook(rt: RealRuntime, ev) -> None:
        if ev.kind == "reserved" and not attacked:      # mid-run: its prefill has not begun
            attacked.append(ev.id)
            reserved_blocks[:] = ev.blocks
            attack(rt, ev.id)

    reserved_blocks: list[int] = []
    forgers = []
    try:
        result = run(cfg, watch, hook)
    finally:
        for forger in forgers:
            forger.close()
        ctx.destroy(linger=0)
    assert attacked
    check(result, cfg, {}, {"prefill0", "decode0"})      # the victim too: every request, right tokens
    assert closed == {"commands": True, "events": True, "kv receiver": True}
    err = capfd.readouterr().err
    frontend = [line for line in err.splitlines() if line.startswith("frontend: dropped")]
    for expected in ("not a msgpack message", "expected 1", "from mallory, not one of the run's workers",
                     "on the command socket"):
        assert any(expected in line for line in frontend), (expected, frontend)
    assert len([line for line in frontend if "from mallory" in line]) == 3
    assert len([line for line in frontend if "on the command socket" in line]) == 2
    assert not any("decode0" in line for line in frontend)     # the impostor was never heard
    assert all("\\x" not in line and len(line) < 400 for line in frontend)
    receiver = [line for line in err.splitlines() if line.startswith("receiver ")]
    for expected in ("a data chunk with no payload open", "header is not valid msgpack",
                     "exceeds max_header_bytes", "exceeds max_message_bytes", "unknown kind"):
        assert any(expected in line for line in receiver), (expected, receiver)
    # the forged KV: refused by its sender's identity, one line, counted; the victim got the right tokens
    refused = [line for line in receiver if "refused" in line]
    assert len(refused) == 1, refused
    assert f"a payload for {attacked[0]} from a sender that is not one of the run's (sender mallory)" in refused[0]
    assert result.worker_stats["decode0"]["kv_refused"] == 1


# ---- the gate's rules, for peers that hold a worker's identity -----------------------------

def _gate() -> EventGate:
    gate = EventGate(["prefill0", "decode0", "decode1"])
    msg = RequestMsg("r0", [1, 2], 4, 0.0, 0.0, 1.0, 0, True, None)
    gate.on_command("decode0", Reserve(msg))
    gate.on_command("prefill0", Prefill(msg, "decode0", [3]))
    return gate


def test_gate_takes_the_events_of_the_workers_a_request_was_sent_to():
    gate = _gate()
    assert gate.refusal(b"decode0", Reserved("r0", "decode0", [3], 10)) is None
    assert gate.refusal(b"prefill0", Tokens("prefill0", [("r0", 5, 0.0, 0)])) is None
    assert gate.refusal(b"decode0", Finished.failed("r0", "x")) is None
    assert gate.num_refused == 0


def test_gate_refuses_an_event_naming_another_worker_or_about_a_request_not_sent():
    gate = _gate()
    assert gate.refusal(b"decode1", Reserved("r0", "decode0", [3], 10)) == \
        "an event 'reserved' from decode1 that names worker decode0"
    assert gate.refusal(b"decode1", Finished.failed("r0", "x")) == \
        "an event 'finished' from decode1 about request r0, which it was never sent"
    assert gate.refusal(b"decode0", Finished.failed("r9", "x")) == \
        "an event 'finished' from decode0 about request r9, which it was never sent"
    assert gate.refusal(b"decode1", Tokens("decode1", [("r0", 5, 0.0, 1)])) == \
        "an event 'tokens' from decode1 about request r0, which it was never sent"
    assert gate.refusal(b"\x00k\x8bEg", Finished.failed("r0", "x")) == \
        "an event 'finished' from 0x006b8b4567, not one of the run's workers"
    assert gate.num_refused == 5


def test_hostile_peer_on_the_kv_store_socket(colocated, capfd):
    """mode=kvstore, 2P1D: the store's socket gets an empty message, garbage,
    a truncated header, an unknown op and a terabyte frame announced; the run
    serves every request with the colocated tokens and the store answers on."""
    cfg = kvstore_config(prefill_workers=2, decode_workers=1)
    ctx, attacked, closed = zmq.Context(), [], []

    def hook(rt: RealRuntime, ev) -> None:
        if type(ev) is PrefixFetched and not attacked:
            attacked.append(ev.id)
            peer = dealer(ctx, rt.store_addr)
            peer.send(b"")
            peer.send_multipart([b"\x00\x01", b"x"])
            peer.send_multipart([msgpack.packb({"id": 1, "op": "get"})[:3], b"x"])
            peer.send(msgpack.packb({"id": 2, "op": "format_disk"}))
            time.sleep(0.3)
            closed.append(zmtp_oversized(rt.store_addr))

    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, requests)
    try:
        result = RealRuntime(cfg, on_event=hook).run(requests)
    finally:
        ctx.destroy(linger=0)
    assert attacked and closed == [True]
    assert {r.request_id: (r.status, r.error) for r in result.records} == {rid: ("finished", None) for rid in colocated}
    assert {r.request_id: r.output_token_ids for r in result.records} == colocated
    assert all(s["all_free"] for s in result.worker_stats.values()) and len(result.worker_stats) == 3
    assert result.store_stats is not None            # it served to the end and said goodbye
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("kv store: bad request")]
    assert len(lines) == 4 and all("\\x" not in line for line in lines), lines
