"""Receiving straight into the destination blocks (kv_transfer/landing.py),
and what a receiver refuses: a stranger's payload, one with no reservation,
one whose reservation went while its bytes arrived. In-process writes with
odd chunk sizes, then real zmq sockets, exact values."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from testbed.kv_transfer import TransferConfig, make_receiver, make_sender, pack_kv, unpack_kv, view_kv
from testbed.kv_transfer.channel import HEADER
from testbed.kv_transfer.landing import BlockLanding

L, NB, BS, H, D = 3, 40, 4, 2, 8


def make_cache(dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, NB, BS, H, D, generator=g).to(dtype)


@pytest.mark.parametrize("dst", [[0, 1, 12, 13, 14, 39], list(range(39, 33, -1))])   # 3 runs; 6 single blocks
@pytest.mark.parametrize("chunk", [1000, 256, 4096 + 7, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_landing_writes_what_unpack_kv_writes(dst, chunk, dtype):
    src = [7, 8, 9, 2, 30, 31]
    cache = make_cache(dtype)
    p = pack_kv(cache, (1, 3), src, dst, num_tokens=len(src) * BS, request_id="r1")
    expected = torch.zeros_like(cache)
    unpack_kv(expected, p)
    got = torch.zeros_like(cache)
    landing = BlockLanding(got, p)
    raw = memoryview(p.data.reshape(-1).view(torch.uint8).numpy())
    for off in range(0, len(raw), chunk):
        landing.write(off, raw[off:off + chunk])
    assert torch.equal(got, expected)


def test_block_landing_checks_the_header_against_the_cache():
    cache = make_cache()
    p = pack_kv(cache, (0, 3), [1, 2], [3, 4], 8, "r")
    with pytest.raises(ValueError, match="out of range"):
        BlockLanding(torch.zeros(L, 2, 4, BS, H, D), p)
    with pytest.raises(ValueError, match="dtype"):
        BlockLanding(cache.half(), p)


def poll_until(receiver, n: int, timeout_s: float = 20) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += receiver.poll(50)
    return got


def wait_acks(sender, n: int, timeout_s: float = 20) -> list:
    acks, deadline = [], time.monotonic() + timeout_s
    while len(acks) < n and time.monotonic() < deadline:
        acks += sender.poll_acks(50)
    return acks


def test_zmq_receiver_lands_in_the_reserved_blocks_and_refuses_the_rest(caplog):
    cfg = TransferConfig(frame_bytes=5000)           # chunks that straddle the blocks' segments
    src_cache, dst = make_cache(seed=1), torch.zeros(L, 2, NB, BS, H, D)
    reserved = {"a": [10, 11, 2, 20]}

    def landing(p):
        return BlockLanding(dst, p) if reserved.get(p.request_id) == p.block_ids else None

    pa = pack_kv(src_cache, (0, 3), [3, 4, 5, 9], reserved["a"], 16, "a")
    stranger_p = pack_kv(src_cache, (0, 3), [1], [33], 4, "a")
    with make_receiver(cfg) as receiver, make_sender(cfg, name="prefill-0") as sender, \
            make_sender(cfg, name="stranger") as stranger:
        receiver.land_with(landing)
        receiver.expect_senders(["prefill-0"])
        for s in (sender, stranger):
            s.connect("decode-0", receiver.address)
        stranger.send("decode-0", stranger_p)                 # well-formed, for a real request: refused
        sender.send("decode-0", pack_kv(src_cache, (0, 1), [1], [5], 4, "nobody"))   # no reservation: refused
        sender.send("decode-0", pa)
        (got,) = poll_until(receiver, 1)
        assert got.request_id == "a" and got.ok and got.in_place and got.origin == "prefill-0"
        for s, d in zip([3, 4, 5, 9], reserved["a"]):
            assert torch.equal(dst[:, :, d], src_cache[:, :, s])
        # the stranger's payload comes on a connection of its own: it may be read after "a"
        deadline = time.monotonic() + 20
        while receiver.num_refused < 2 and time.monotonic() < deadline:
            assert receiver.poll(50) == []
        assert not dst[:, :, 33].any() and not dst[:, :, 5].any()
        assert receiver.num_refused == 2 and receiver.num_rejected == 0
        (ack,) = wait_acks(sender, 1)            # the run's sender hears why; the stranger is not answered
        assert (ack.request_id, ack.ok) == ("nobody", False) and "no reservation" in ack.reason
        assert stranger.poll_acks(200) == []

    refusals = sorted(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
    assert len(refusals) == 2
    assert "a from a sender that is not one of the run's (sender stranger)" in refusals[0]
    assert "nobody, which has no reservation here (sender prefill-0)" in refusals[1]


def test_a_landing_withdrawn_while_its_bytes_arrive_takes_no_more():
    """The reservation goes (aborted) between two polls, mid-payload: the rest is discarded."""
    cfg = TransferConfig()
    src_cache, dst = make_cache(seed=3), torch.zeros(L, 2, NB, BS, H, D)
    withdrawn = []
    p = pack_kv(src_cache, (0, 3), list(range(10)), list(range(20, 30)), 40, "b")
    raw = p.data.reshape(-1).view(torch.uint8).numpy()
    half = len(raw) // 2
    with make_receiver(cfg) as receiver, zmq.Context() as ctx:
        receiver.land_with(lambda q: BlockLanding(dst, q, valid=lambda: not withdrawn))
        dealer = ctx.socket(zmq.DEALER)          # the wire by hand, to stop halfway
        dealer.setsockopt(zmq.ROUTING_ID, b"prefill-0")
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(receiver.address)
        dealer.send_multipart([HEADER, p.encode_header()])
        dealer.send(raw[:half].tobytes())
        deadline = time.monotonic() + 10
        while not dst.any() and time.monotonic() < deadline:
            assert receiver.poll(50) == []
        written = dst.clone()
        assert written.any()
        withdrawn.append(True)
        dealer.send(raw[half:].tobytes())
        assert poll_until(receiver, 1, timeout_s=1) == []
        assert torch.equal(dst, written)            # nothing past the withdrawal
        dealer.close()

def test_zmq_receiver_in_place_payload_that_fails_its_checksum_is_not_admitted():
    cfg = TransferConfig(frame_bytes=4096, fault_corrupt_nth=1)
    src_cache, dst = make_cache(seed=2), torch.zeros(L, 2, NB, BS, H, D)
    with make_receiver(TransferConfig()) as receiver, make_sender(cfg, name="p") as sender:
        receiver.land_with(lambda p: BlockLanding(dst, p))
        sender.connect("d", receiver.address)
        sender.send("d", pack_kv(src_cache, (0, 3), [1, 2, 3], [4, 5, 6], 12, "x"))
        sender.send("d", pack_kv(src_cache, (0, 3), [1, 2, 3], [7, 8, 9], 12, "y"))
        bad, good = poll_until(receiver, 2)
    assert not bad.ok and "checksum mismatch" in bad.error and not bad.in_place
    assert good.ok and good.in_place and torch.equal(dst[:, :, 7:10], src_cache[:, :, 1:4])


@pytest.mark.parametrize("corrupt", [0, 1])
def test_zmq_sends_the_cache_segments_themselves_into_the_reserved_blocks(corrupt):
    """view_kv's parts (the sender's own blocks, no gather) over real sockets, chunks that
    straddle the receiver's segments: exact values; a corrupted copy fails, the cache is untouched."""
    cfg = TransferConfig(frame_bytes=5000, fault_corrupt_nth=corrupt)
    src_cache, dst = make_cache(seed=4), torch.zeros(L, 2, NB, BS, H, D)
    before = src_cache.clone()
    src, reserved = [3, 4, 5, 9, 20, 21], [10, 11, 2, 20, 38, 39]
    with make_receiver(TransferConfig()) as receiver, make_sender(cfg, name="p") as sender:
        assert sender.takes_parts
        receiver.land_with(lambda p: BlockLanding(dst, p))
        sender.connect("d", receiver.address)
        sender.send("d", view_kv(src_cache, (0, 3), src, reserved, len(src) * BS, "a"))
        (got,) = poll_until(receiver, 1)
    assert torch.equal(src_cache, before)
    if corrupt:
        assert not got.ok and "checksum mismatch" in got.error
        return
    assert got.ok and got.in_place
    for s, d in zip(src, reserved):
        assert torch.equal(dst[:, :, d], src_cache[:, :, s])
    others = [b for b in range(NB) if b not in reserved]
    assert not dst[:, :, others].any()

