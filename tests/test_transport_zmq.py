"""The zmq transport over real sockets: round trips to a receiver in a spawned
process (tcp and ipc), acks, a payload corrupted in flight, hand-built hostile
messages from a raw zmq socket, and close() leaving no port, file or thread."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

sys.path.insert(0, str(Path(__file__).parent))     # spawned children find the peer module the same way
import test_transport_peers as peers  # noqa: E402

from testbed.kv_transfer import TransferConfig, TransferError, make_receiver, make_sender, pack_kv  # noqa: E402
from testbed.kv_transfer.payload import HEADER_VERSION  # noqa: E402

SPAWN = mp.get_context("spawn")


def make_cache(seed: int) -> torch.Tensor:
    return torch.randn(4, 2, 64, 16, 2, 8, generator=torch.Generator().manual_seed(seed))  # 16 KiB/block-layer


def expect(q, kind: str):
    got_kind, value = q.get(timeout=60)
    assert got_kind == kind, (got_kind, value)
    return value


def start_receiver(cfg: TransferConfig, num_payloads: int, **kw):
    out_q, ctl_q = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=peers.run_receiver, args=(cfg, num_payloads, out_q, ctl_q), kwargs=kw)
    proc.start()
    return proc, out_q, ctl_q, expect(out_q, "address")


def wait_acks(sender, n: int) -> list:
    acks, deadline = [], time.monotonic() + 60
    while len(acks) < n and time.monotonic() < deadline:
        acks += sender.poll_acks(100)
    return acks


@pytest.mark.parametrize("protocol", ["tcp", "ipc"])
def test_round_trip_to_another_process(protocol):
    # 5000-byte frames: payloads are cut into many frames, the last one short
    cfg = TransferConfig(protocol=protocol, frame_bytes=5000)
    cache = make_cache(1)
    payloads = [
        pack_kv(cache, (0, 2), [3, 4, 5, 9], [10, 11, 2, 20], 60, "req-a", last=False, meta={"first_token": 7}),
        pack_kv(cache, (2, 4), [3, 4, 5, 9], [10, 11, 2, 20], 60, "req-a", last=True),
        pack_kv(cache, (0, 4), list(range(40, 50)), list(range(10)), 150, "req-b"),
    ]
    proc, out_q, ctl_q, address = start_receiver(cfg, len(payloads))
    assert address.startswith(f"{protocol}://")
    with make_sender(cfg, name="prefill-0") as sender:
        sender.connect("decode-0", address)
        for p in payloads:
            sender.send("decode-0", p)
        sender.flush()
        got = [expect(out_q, "payload") for _ in payloads]
        acks = wait_acks(sender, len(payloads))
    ctl_q.put("close")
    assert expect(out_q, "closed") == len(payloads)
    proc.join(30)
    assert proc.exitcode == 0
    for sent, r in zip(payloads, got):      # one connection: arrival order is send order
        assert r["error"] is None and r["origin"] == "prefill-0"
        assert (r["request_id"], r["last"], r["meta"], r["block_ids"], r["num_tokens"]) == \
            (sent.request_id, sent.last, sent.meta, sent.block_ids, sent.num_tokens)
        assert r["layers"] == (sent.layer_start, sent.layer_end)
        assert torch.equal(r["data"], sent.data)
    assert [(a.peer, a.request_id, a.ok) for a in acks] == [("decode-0", "req-a", True)] * 2 + [("decode-0", "req-b", True)]


def test_corrupted_payload_fails_that_request_only():
    cfg = TransferConfig(fault_corrupt_nth=2)
    cache = make_cache(2)
    payloads = [pack_kv(cache, (0, 4), [i], [i], 16, f"req-{i}") for i in range(3)]
    proc, out_q, ctl_q, address = start_receiver(cfg, 3)
    with make_sender(cfg, name="p") as sender:
        sender.connect("d", address)
        for p in payloads:
            sender.send("d", p)
        got = [expect(out_q, "payload") for _ in payloads]
        acks = wait_acks(sender, 3)
    ctl_q.put("close")
    expect(out_q, "closed")
    proc.join(30)
    assert [r["error"] is None for r in got] == [True, False, True]
    assert "request req-1: checksum mismatch" in got[1]["error"] and got[1]["data"] is None
    assert torch.equal(got[2]["data"], payloads[2].data)
    assert [(a.request_id, a.ok) for a in acks] == [("req-0", True), ("req-1", False), ("req-2", True)]
    assert "corrupted in transit" in acks[1].reason
    assert torch.equal(payloads[1].data, cache[:, :, [1]])     # the injector corrupted a copy


def _raw_header(request_id: str, nbytes: int, **extra) -> bytes:
    n = nbytes // 4
    h = {"v": HEADER_VERSION, "request_id": request_id, "layer_start": 0, "layer_end": 1, "block_ids": [0],
         "num_tokens": 1, "dtype": "float32", "shape": [1, 2, 1, n // 2, 1, 1], "checksum": 0,
         "nbytes": nbytes, "last": True, "meta": {}}
    h.update(extra)
    return msgpack.packb(h)


def raw_dealer(address: str, routing_id: bytes) -> tuple[zmq.Context, zmq.Socket]:
    """A bare zmq peer of the receiver, to send it hand-built messages."""
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, routing_id)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    return ctx, raw


def poll_all(receiver, n: int) -> list:
    """What the receiver's polls return until n payloads came (or 10 s passed)."""
    got, deadline = [], time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        got += receiver.poll(100)
    return got


def test_hostile_messages_are_reported_not_fatal():
    cfg = TransferConfig(max_header_bytes=4096, max_message_bytes=1 << 20, frame_bytes=64 * 1024, timeout_s=0.5)
    receiver = make_receiver(cfg)
    ctx, raw = raw_dealer(receiver.address, b"mallory")
    good = torch.ones(1, 2, 1, 1, 1, 1)
    good_checksum = pack_kv(good, (0, 1), [0], [0], 1, "r").checksum
    try:
        raw.send_multipart([b"H", b"x" * 5000])                         # oversize header
        raw.send_multipart([b"H", b"\xc1\xc1\xc1"])                     # not msgpack
        raw.send_multipart([b"X", b"what"])                             # unknown kind
        raw.send(b"")                                                   # data with no payload open
        raw.send(b"\0" * 8)                                             # the same
        raw.send_multipart([b"H", _raw_header("r-huge", 1 << 30)])      # declares 1 GiB
        raw.send_multipart([b"H", _raw_header("r-long", 8)])
        raw.send(b"\0" * 9)                                             # one byte too many
        raw.send_multipart([b"H", _raw_header("r-short", 8)])
        raw.send(b"\0" * 4)                                             # then the next header: truncated
        raw.send_multipart([b"H", _raw_header("r-bad", 8)])
        raw.send(b"\0" * 8)                                             # checksum 0 in the header: wrong
        raw.send_multipart([b"H", _raw_header("r-good", 8, checksum=good_checksum)])
        raw.send(good.numpy().tobytes()[:3])                            # chunks of any size add up
        raw.send(good.numpy().tobytes()[3:])
        got = poll_all(receiver, 5)
        assert receiver.num_rejected == 5
        errors = {p.request_id: p.error for p in got}
        assert errors["r-huge"].startswith("request r-huge: payload of 1073741824 bytes exceeds max_message_bytes")
        assert errors["r-long"] == "request r-long: more data than the 8 bytes declared"
        assert errors["r-short"] == ("request r-short: truncated: 4 of 8 bytes arrived before the sender's "
                                     "next payload")
        assert errors["r-bad"].startswith("request r-bad: checksum mismatch")
        assert errors["r-good"] is None and got[-1].data.tolist() == good.tolist()
        assert receiver._buffers.nbytes_free <= 4 << 20    # 1 MiB buffers; the 1 GiB claim got none
        assert all(p.origin == "mallory" for p in got)

        raw.send_multipart([b"H", _raw_header("r-stall", 8)])
        raw.send(b"\0" * 4)                                             # and then nothing
        (stalled,) = poll_all(receiver, 1)
        assert stalled.error == "request r-stall: truncated: 4 of 8 bytes arrived, then nothing for 0.5s"
        # a chunk over max_message_bytes: zmq drops the connection before allocating it
        raw.send(b"\0" * (2 << 20))
        assert poll_all(receiver, 1) == [] and receiver.num_rejected == 5
        assert receiver.ack("mallory-gone", "r", ok=False, reason="x") is False
    finally:
        raw.close()
        ctx.term()
        receiver.close()


def test_a_checksum_after_the_data_is_checked_and_its_faults_fail_that_payload_only():
    """A header with checksum nil (view_kv's payloads: the zmq sender hashes as it sends)
    takes its checksum from the [T, 8 bytes] trailer after the data; a wrong one, a short
    one, none before the next header, none at all, and a stray trailer each fail that
    payload (or are rejected) and the next payload still lands."""
    cfg = TransferConfig(max_header_bytes=4096, max_message_bytes=1 << 20, timeout_s=0.5)
    receiver = make_receiver(cfg)
    ctx, raw = raw_dealer(receiver.address, b"trudy")
    data = torch.arange(2, dtype=torch.float32).view(1, 2, 1, 1, 1, 1)
    digest = pack_kv(data, (0, 1), [0], [0], 1, "r").checksum.to_bytes(8, "little")

    def send(request_id: str, *after: list[bytes]) -> None:
        raw.send_multipart([b"H", _raw_header(request_id, 8, checksum=None)])
        raw.send(data.numpy().tobytes())
        for message in after:
            raw.send_multipart(message)

    try:
        send("t-good", [b"T", digest])
        send("t-wrong", [b"T", bytes(8)])
        send("t-short", [b"T", digest[:7]])
        send("t-none")                                   # the next header comes instead
        send("t-after", [b"T", digest])
        raw.send_multipart([b"T", digest])               # a trailer with no payload awaiting one
        got = poll_all(receiver, 5)
        errors = {p.request_id: p.error for p in got}
        assert [p.request_id for p in got] == ["t-good", "t-wrong", "t-short", "t-none", "t-after"]
        assert errors["t-good"] is None and got[0].data.tolist() == data.tolist()
        assert errors["t-wrong"].startswith("request t-wrong: checksum mismatch")
        assert errors["t-short"] == "request t-short: a checksum trailer of 7 bytes, not 8"
        assert errors["t-none"] == ("request t-none: no checksum trailer after its data (the sender's next "
                                    "message came instead)")
        assert errors["t-after"] is None and got[4].data.tolist() == data.tolist()
        time.sleep(0.2)
        assert poll_all(receiver, 1) == [] and receiver.num_rejected == 1
        send("t-stall")                                  # and then nothing
        (stalled,) = poll_all(receiver, 1)
        assert stalled.error == ("request t-stall: truncated: 8 of 8 bytes arrived, then nothing for 0.5s "
                                 "(no checksum trailer)")
    finally:
        raw.close()
        ctx.term()
        receiver.close()


def test_the_sender_hashes_view_kv_payloads_in_flight_and_sends_the_digest_last():
    """What goes on the wire for a view_kv payload: the header with checksum nil at once,
    the data chunks, then [T, xxh3 of the data]; a packed payload keeps its checksum in the
    header and sends no trailer."""
    from testbed.kv_transfer import view_kv
    from testbed.kv_transfer.payload import decode_header
    cache = make_cache(3)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    viewed = view_kv(cache, (0, 4), [3, 4, 5, 9], [0, 1, 2, 3], 60, "v")
    packed = pack_kv(cache, (0, 4), [3, 4, 5, 9], [0, 1, 2, 3], 60, "p")
    try:
        with make_sender(TransferConfig(frame_bytes=5000), name="s") as sender:
            sender.connect("r", f"tcp://127.0.0.1:{port}")
            sender.send("r", viewed)
            sender.send("r", packed)
            chunks = sum(-(-len(part) // 5000) for part in viewed.byte_parts())     # a part ends a chunk
            messages = []
            while len(messages) < (1 + chunks + 1) + (1 + -(-packed.nbytes // 5000)):
                assert router.poll(10_000), f"only {len(messages)} messages came"
                messages.append(router.recv_multipart()[1:])
            sender.flush()
    finally:
        router.close()
        ctx.term()
    header = decode_header(messages[0][1], 4096, 1 << 30)
    assert messages[0][0] == b"H" and header.request_id == "v" and header.checksum is None
    assert all(len(m) == 1 for m in messages[1:1 + chunks])
    assert b"".join(m[0] for m in messages[1:1 + chunks]) == packed.data.numpy().tobytes()
    assert messages[1 + chunks] == [b"T", packed.checksum.to_bytes(8, "little")]
    second = decode_header(messages[2 + chunks][1], 4096, 1 << 30)
    assert second.request_id == "p" and second.checksum == packed.checksum
    assert all(len(m) == 1 for m in messages[3 + chunks:])


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _one_round_trip(cfg: TransferConfig) -> tuple[str, str]:
    receiver = make_receiver(cfg)
    sender = make_sender(cfg)
    sender.connect("d", receiver.address)
    sender.send("d", pack_kv(make_cache(3), (0, 4), [1, 2], [1, 2], 20, "r"))
    got = []
    while not got:
        got = receiver.poll(1000)
    assert got[0].ok
    receiver.ack(got[0].origin, "r")
    assert [a.request_id for a in wait_acks(sender, 1)] == ["r"]
    sender.flush()
    sender.close()
    receiver.close()
    with pytest.raises(TransferError, match="is closed"):
        sender.send("d", pack_kv(make_cache(3), (0, 1), [1], [1], 1, "r"))
    return receiver.address, sender.name


@pytest.mark.parametrize("protocol", ["tcp", "ipc"])
def test_close_releases_port_socket_file_and_threads(protocol):
    cfg = TransferConfig(protocol=protocol)
    _one_round_trip(cfg)       # warm up pyzmq's process-wide zero-copy garbage collector thread
    threads = _os_threads()
    address, _ = _one_round_trip(cfg)
    # a closed context's threads may finish exiting just after term() returns: give them a second
    deadline = time.monotonic() + 1.0
    while _os_threads() != threads and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _os_threads() == threads
    if protocol == "tcp":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(address)         # the same port is free again
        sock.close(linger=0)
        ctx.term()
    else:
        assert not Path(address.removeprefix("ipc://")).parent.exists()


def test_wake_socket_turns_readable_when_kv_comes_and_quiet_once_taken():
    # a decode worker awaiting KV sleeps on this socket (runtime/worker_process.py)
    # instead of waking every millisecond: it must wake for a payload, and be
    # quiet again once poll() took it, or the loop would spin
    cfg = TransferConfig(frame_bytes=5000)
    with make_receiver(cfg) as receiver, make_sender(cfg, name="p") as sender:
        poller = zmq.Poller()
        poller.register(receiver.wake_socket(), zmq.POLLIN)
        assert poller.poll(50) == []
        sender.connect("d", receiver.address)
        payload = pack_kv(make_cache(4), (0, 4), [1, 2, 3], [5, 6, 7], 40, "r")
        sender.send("d", payload)
        assert poller.poll(10_000) != []
        got = []
        while not got:
            got = receiver.poll(1000)
        assert got[0].error is None and torch.equal(got[0].data, payload.data)
        assert poller.poll(50) == []


def test_socket_buffers_are_set_and_the_bytes_arrive_exactly():
    """transfer.socket_buffer_bytes sets SO_RCVBUF on the receiver's socket and SO_SNDBUF on
    the sender's (zmq applies them to each TCP connection); the payload still arrives exact."""
    from testbed.kv_transfer.landing import BlockLanding
    cfg = TransferConfig(frame_bytes=64 * 1024, socket_buffer_bytes=256 * 1024)
    src, dst = make_cache(5), torch.zeros(4, 2, 64, 16, 2, 8)
    ids = list(range(20))
    with make_receiver(cfg) as receiver, make_sender(cfg, name="p") as sender:
        receiver.land_with(lambda p: BlockLanding(dst, p))
        sender.connect("d", receiver.address)
        assert receiver._server.sock.getsockopt(zmq.RCVBUF) == 256 * 1024
        assert sender._client.socket("d").getsockopt(zmq.SNDBUF) == 256 * 1024
        sender.send("d", pack_kv(src, (0, 4), ids, ids, 16 * len(ids), "r"))
        got, deadline = [], time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = receiver.poll(50)
    assert [p.error for p in got] == [None]
    assert torch.equal(dst[:, :, ids], src[:, :, ids]) and not dst[:, :, 20:].any()
