"""The wire: every message kind survives its one encoding unchanged, and the
decoder rejects, with a WireError that says why, anything else: garbage,
truncations, unknown kinds, missing or extra fields, fields of the wrong
type (fuzzed with hypothesis, bounded)."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.kv_transfer.store_index import StoreCounters
from testbed.metrics import IterationRecord
from testbed.request import Request, SamplingParams
from testbed.runtime.messages import (MESSAGES, Abort, Add, Busy, Connect, ExpectSenders, Finished, FreeBlocks,
                                      HandOffMeta, IterationDone, KVReceived, Ping, Pong, Preempted, Prefill, Prefilled, Ready,
                                      Rejected, Release, Reserve, Reserved, Stats, Stop, Tokens, WorkerError,
                                      PrefixFetched, StoreStats, request_to_msg)
from testbed.runtime.wire import WireError, decode, encode, hand_off_meta

REQ = request_to_msg(Request("r1", [5, 6, 7], 4, 0.25, SamplingParams(0.7, 0.9, 3, False, 2), private_from=2))
EXAMPLES = [
    Add(REQ), Prefill(REQ, "decode0", [4, 9]), Reserve(REQ), Release("r1"), Abort("r1"),
    Connect("decode0", "tcp://h:1"), ExpectSenders(["prefill0", "prefill1"]), Stop(), Ping(), Ready("w", ""), Tokens("w", [("r1", 17, 1.5, 0)]),
    Finished("r1", "finished", None, 2.0, 0.5, 1), Finished.failed("r2", "boom"), Preempted("r1"),
    IterationDone(IterationRecord(1.0, 0.01, 64, 3, 4096, "w"), 12), FreeBlocks("w", 3),
    Reserved("r1", "d", [1, 2], 30), Rejected("r1", "d", 0), Prefilled("r1", "p", 1.0, 2048, 0.9),
    KVReceived("r1", "d", 1.1), Stats("w", "decode", 10, 10, True, 0, 0, 1 << 20, 3, 1), WorkerError("w", "E: x", "tb"), Pong("w"),
    PrefixFetched("r1", "p", 32, 64, 96, 0.002), Busy("w", 61.5), StoreStats("store", StoreCounters(lookups=3, hits=2), 5, 4096, None),
]


def test_every_kind_has_an_example_here():
    assert {type(m) for m in EXAMPLES} == set(MESSAGES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.kind)
def test_every_message_survives_its_encoding(msg):
    assert decode(encode(msg)) == msg


def test_a_request_crosses_the_wire_as_the_same_request():
    got = decode(encode(Add(REQ))).request.to_request()
    assert (got.request_id, list(got.prompt_token_ids), got.max_tokens, got.arrival_s, got.sampling,
            got.private_from) == ("r1", [5, 6, 7], 4, 0.25, SamplingParams(0.7, 0.9, 3, False, 2), 2)


@pytest.mark.parametrize("raw, why", [
    (b"\x00\x01", "not a msgpack message .*extra data"),
    (msgpack.packb(7), "expected \\[kind, fields...\\], got a int"),
    (b"\xc1", "not a msgpack message"),
    (msgpack.packb({"type": "add"}), "got a dict"),
    (msgpack.packb([]), "got a list"),
    (msgpack.packb(["nope", 1]), "unknown message kind 'nope'"),
    (msgpack.packb(["release"]), "release: expected 1 fields, got 0"),
    (msgpack.packb(["release", "r1", "extra"]), "expected 1 fields, got 2"),
    (msgpack.packb(["release", 7]), "release.id: expected str, got int"),
    (msgpack.packb(["free_blocks", "w", True]), "free_blocks.free_blocks: expected int, got bool"),
    (msgpack.packb(["free_blocks", "w", 1.5]), "expected int, got float"),
    (msgpack.packb(["tokens", "w", [["r", 1, 2.0]]]), "tokens.items\\[0\\]: expected 4 items"),
    (msgpack.packb(["add", ["r", [1, "x"], 4, 0.0, 0.0, 1.0, 0, True, None, None]]), "add.request.prompt: expected a list of integ"),
    (msgpack.packb(["add", "r1"]), "add.request: expected a RequestMsg as a list"),
    (msgpack.packb(["finished", "r", "finished", None, "soon", None, 0]), "finished.finish_s: .* is not a"),
    # found by experiments/fuzz/fuzz_wire.py: a NaN top_p decoded, and NaN != NaN broke the round trip
    (msgpack.packb(["add", ["r", [1], 4, 0.0, 0.0, float("nan"), 0, True, None, None]]), "add.request.top_p: NaN"),
])
def test_the_decoder_says_what_is_wrong(raw, why):
    with pytest.raises(WireError, match=why):
        decode(raw)


def test_an_oversized_message_is_refused_before_it_is_read():
    with pytest.raises(WireError, match="exceeds"):
        decode(b"\x91" + b"\x00" * (64 << 20))


def test_hand_off_metadata_is_checked_like_a_message():
    meta = HandOffMeta(17, 1.0, 0.01, None, 2)
    assert hand_off_meta(meta.to_dict()) == meta
    with pytest.raises(WireError, match="first_token: expected int"):
        hand_off_meta({**meta.to_dict(), "first_token": "17"})
    with pytest.raises(WireError, match="expected a map"):
        hand_off_meta([1, 2])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_a_wire_error(raw):
    try:
        decode(raw)
    except WireError:
        pass


_values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                       max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(MESSAGES)), st.lists(_values, max_size=8))
def test_any_fields_under_a_known_kind_decode_or_raise_a_wire_error(kind, fields):
    try:
        msg = decode(msgpack.packb([kind, *fields]))
    except WireError:
        return
    assert decode(encode(msg)) == msg       # what it accepted is a well-formed message


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(EXAMPLES), st.data())
def test_every_truncation_of_a_real_message_is_rejected(msg, data):
    raw = encode(msg)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(WireError):
        decode(raw[:cut])
