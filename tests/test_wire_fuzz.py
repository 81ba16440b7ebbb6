"""Fuzzing the KV payload wire: the header decoder (kv_transfer/payload.py)
and the receiver loop (kv_transfer/receiver.py) behind a real zmq socket.

Properties, over random, mutated, truncated and oversized input:
- decode_header returns a well-formed KVPayload or raises PayloadError, with
  a one-line printable message; nothing else escapes;
- decoding allocates in proportion to the header's own bytes, never to what
  the header declares (array lengths, shape, nbytes);
- a receiver fed garbage by a hostile local peer never raises from poll(),
  lends no buffer beyond max_message_bytes, and still delivers the next good
  payload intact;
- the peer's name and request ids reach the log as printable text.
Examples are bounded so the file runs in seconds; experiments/fuzz/
fuzz_payload.py runs the same decoder under atheris for minutes.
"""
from __future__ import annotations

import logging
import time
import tracemalloc
import uuid

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.kv_transfer import KVPayload, PayloadError, TransferConfig, make_receiver, pack_kv
from testbed.kv_transfer.payload import DTYPES, HEADER_VERSION, decode_header
from testbed.wire_text import shown

MAX_HEADER = 4096
MAX_MESSAGE = 1 << 20


def valid_header(**overrides) -> dict:
    h = {"v": HEADER_VERSION, "request_id": "r1", "layer_start": 0, "layer_end": 1, "block_ids": [3], "num_tokens": 4,
         "dtype": "float32", "shape": [1, 2, 1, 4, 2, 8], "checksum": 0, "nbytes": 2 * 4 * 2 * 8 * 4,
         "last": True, "meta": {}}
    h.update(overrides)
    return h


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=20)


@st.composite
def mutated_headers(draw) -> bytes:
    """A valid header with fields replaced, dropped or added, then maybe cut
    short, garbled at a few bytes, or padded past max_header_bytes."""
    h = valid_header()
    for key in draw(st.lists(st.sampled_from(sorted(h) + ["extra"]), max_size=4)):
        action = draw(st.sampled_from(["replace", "drop", "int"]))
        if action == "drop":
            h.pop(key, None)
        elif action == "int":        # sizes and ids at the edges of their range
            h[key] = draw(st.sampled_from([0, -1, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, -2**63]))
        else:
            h[key] = draw(msgpack_values)
    raw = bytearray(msgpack.packb(h))
    how = draw(st.sampled_from(["as is", "cut", "garble", "pad"]))
    if how == "cut":
        del raw[draw(st.integers(0, len(raw))):]
    elif how == "garble":
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    elif how == "pad":
        raw += b"\0" * (MAX_HEADER + 1 - len(raw))
    return bytes(raw)


# msgpack container headers that declare 4G elements and hold none
DECLARED_HUGE = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                 b"\xc6\xff\xff\xff\xff", b"\x81\xaarequest_id\xdb\x7f\xff\xff\xff"]
any_header = st.one_of(mutated_headers(), st.binary(max_size=600), st.sampled_from(DECLARED_HUGE))


def check_decoded(raw: bytes) -> KVPayload | None:
    try:
        p = decode_header(raw, MAX_HEADER, MAX_MESSAGE)
    except PayloadError as e:
        message = str(e)
        assert message.isprintable() and len(message) < 600, message
        if e.request_id is not None:
            assert message.startswith(f"request {shown(e.request_id)}: "), message
        return None
    assert len(raw) <= MAX_HEADER and 0 < p.nbytes <= MAX_MESSAGE and p.dtype in DTYPES
    assert len(p.shape) == 6 and p.shape[0] == p.layer_end - p.layer_start and p.shape[2] == len(p.block_ids)
    return p


@settings(max_examples=400, deadline=None)
@given(any_header)
def test_decode_header_gives_a_payload_or_a_payload_error(raw):
    check_decoded(raw)


def test_decode_header_accepts_what_a_sender_encodes():
    cache = torch.randn(2, 2, 4, 4, 2, 8)
    p = pack_kv(cache, (0, 2), [1, 3], [0, 2], 7, "req-\u00e9")
    q = check_decoded(p.encode_header())
    assert (q.request_id, q.shape, q.nbytes, q.checksum) == (p.request_id, p.shape, p.nbytes, p.checksum)


@settings(max_examples=150, deadline=None)
@given(any_header)
def test_decoding_allocates_in_proportion_to_the_header_not_to_what_it_declares(raw):
    """The worst legal header (64 KiB of empty maps) costs ~72 B of Python
    objects per byte; 100x the header plus 64 KiB of slack bounds every case,
    while a declared 4G-element array or a 2^64-byte payload would be far more."""
    tracemalloc.start()
    try:
        check_decoded(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 100 * len(raw) + (64 << 10), (peak, len(raw))


# ---- the receiver behind a real socket ---------------------------------------------

@pytest.fixture(scope="module")
def receiver():
    cfg = TransferConfig(max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE, frame_bytes=64 * 1024,
                         timeout_s=5.0)
    rx = make_receiver(cfg)
    yield rx
    rx.close()


@pytest.fixture(scope="module")
def zmq_context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _dealer(ctx: zmq.Context, address: str, routing_id: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _good_payload(request_id: str) -> KVPayload:
    return pack_kv(torch.arange(2 * 2 * 4 * 2 * 8, dtype=torch.float32).view(1, 2, 2, 4, 2, 8), (0, 1), [1],
                   [0], 4, request_id)


def _send_good(sock: zmq.Socket, p: KVPayload) -> None:
    sock.send_multipart([b"H", p.encode_header()])
    sock.send(p.data.numpy().tobytes())


def _poll_until(receiver, request_id: str, timeout_s: float = 20.0) -> list[KVPayload]:
    got: list[KVPayload] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(p.request_id == request_id for p in got):
        got += receiver.poll(50)
    return got


frame = st.one_of(st.binary(max_size=64), st.just(b"H"), mutated_headers(), st.binary(min_size=1, max_size=9000))
message = st.lists(frame, min_size=1, max_size=3)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=6), routing_id=st.one_of(st.none(), st.binary(min_size=1, max_size=32)),
       n=st.integers(0, 10**9))
def test_a_receiver_fed_garbage_stays_bounded_and_serves_the_next_payload(receiver, zmq_context, messages,
                                                                          routing_id, n):
    """Whatever a peer sends first, the receiver's poll() does not raise, and the
    good payload the same peer sends next lands intact (its messages arrive in
    order, so by then every garbage message was handled)."""
    if routing_id is not None:
        # zmq reserves ids starting with a zero byte, and a ROUTER ignores a second
        # connection under a name it still holds: each example's name is its own
        routing_id = b"x" + routing_id + uuid.uuid4().bytes
    sock = _dealer(zmq_context, receiver.address, routing_id)
    try:
        for frames in messages:
            sock.send_multipart(frames)
        good = _good_payload(f"sentinel-{n}")
        _send_good(sock, good)
        got = _poll_until(receiver, good.request_id)
    finally:
        sock.close(linger=0)
    sentinel = [p for p in got if p.request_id == good.request_id]
    assert len(sentinel) == 1 and sentinel[0].ok, [(p.request_id, p.error) for p in got]
    assert torch.equal(sentinel[0].data, good.data)
    for p in got:
        assert p.ok or (p.error and p.error.isprintable() and p.data.numel() == 0), p.error
    assert receiver._buffers.nbytes_free <= 4 * MAX_MESSAGE    # pooled buffers: at most 4 of the cap


def test_garbage_on_the_kv_socket_logs_the_sender_as_printable_text(zmq_context, caplog):
    """A raw peer with zmq's own routing id (5 bytes, the first a zero byte) and
    one whose id is a forged log line both send garbage: the log names them in
    hex, on one line each, and the receiver goes on."""
    receiver = make_receiver(TransferConfig(max_header_bytes=MAX_HEADER, max_message_bytes=MAX_MESSAGE,
                                            frame_bytes=64 * 1024))
    forged = b"prefill-0: ok\nreceiver tcp://127.0.0.1:1: accepted \x1b[31mall\x1b[0m"
    anonymous = _dealer(zmq_context, receiver.address, None)
    liar = _dealer(zmq_context, receiver.address, forged)
    caplog.set_level(logging.WARNING, logger="testbed.kv_transfer.receiver")
    try:
        anonymous.send(b"\x00\x01")                                   # a chunk with no payload open
        liar.send_multipart([b"H", b"\xc1\xc1"])                      # a header that is not msgpack
        liar.send_multipart([b"H", msgpack.packb(valid_header(request_id="r\n2\x1b", v=9))])
        good = _good_payload("after-garbage")
        _send_good(liar, good)
        got = _poll_until(receiver, "after-garbage")
        time.sleep(0.2)
        got += receiver.poll(100)                                     # the anonymous peer's chunk
    finally:
        anonymous.close(linger=0)
        liar.close(linger=0)
        receiver.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "testbed.kv_transfer.receiver"]
    assert len(lines) == 3, lines
    assert all(line.isprintable() for line in lines), lines
    hex_forged = shown(forged)
    assert hex_forged.startswith("0x") and "\n" not in hex_forged
    anon = [line for line in lines if "a data chunk with no payload open" in line]
    assert len(anon) == 1 and " from 0x00" in anon[0], anon
    assert sum(f" from {hex_forged}:" in line for line in lines) == 2, lines
    bad_version = [p for p in got if p.request_id == "r\n2\x1b"]
    assert len(bad_version) == 1 and bad_version[0].error == f"request 0x720a321b: header version 9 != {HEADER_VERSION}"
    assert bad_version[0].origin == forged.decode("utf-8", "surrogateescape")    # raw: acks route by it
    assert [p.ok for p in got if p.request_id == "after-garbage"] == [True]
