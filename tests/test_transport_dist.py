"""The torch_dist transport with real gloo between this process (rank 0,
sender) and a spawned receiver (rank 1): data over the process group, headers
and acks over zmq, a corrupted payload caught, and a clean teardown."""
from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import zmq

sys.path.insert(0, str(Path(__file__).parent))     # spawned children find the peer module the same way
import test_transport_peers as peers  # noqa: E402

from testbed.kv_transfer import (TorchDistGroup, TransferConfig, make_sender, pack_kv,  # noqa: E402
                                 start_rendezvous, view_kv)

SPAWN = mp.get_context("spawn")


def test_gloo_round_trip_acks_and_corruption():
    # 6000-byte pieces: some payloads span several, cut at view_kv's parts and inside them
    cfg = TransferConfig(transport="torch_dist", fault_corrupt_nth=3, timeout_s=30, frame_bytes=6000)
    cache = torch.randn(4, 2, 32, 16, 2, 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    payloads = [
        pack_kv(cache, (0, 2), [1, 2, 3, 7], [4, 5, 6, 0], 60, "req-a", last=False, meta={"first_token": 3}),
        pack_kv(cache, (2, 4), [1, 2, 3, 7], [4, 5, 6, 0], 60, "req-a"),
        pack_kv(cache, (0, 4), [8, 9], [30, 31], 20, "req-b"),
        pack_kv(cache, (0, 4), list(range(10, 30)), list(range(20)), 320, "req-c"),
        view_kv(cache, (1, 4), [3, 4, 5, 20, 21, 9], [0, 1, 2, 3, 4, 5], 90, "req-d"),   # the cache itself
    ]
    expected = [p.data for p in payloads[:4]] + [pack_kv(cache, (1, 4), [3, 4, 5, 20, 21, 9], list(range(6)), 90,
                                                         "req-d").data]
    store, init_address = start_rendezvous("127.0.0.1")
    out_q, ctl_q = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=peers.run_receiver, args=(cfg, len(payloads), out_q, ctl_q),
                         kwargs={"dist": (init_address, 1, 2)})
    proc.start()
    group = TorchDistGroup(init_address, rank=0, world_size=2)
    kind, address = out_q.get(timeout=60)
    assert kind == "address" and address.endswith("#rank=1")
    sender = make_sender(cfg, name="prefill-0", group=group)
    sender.connect("decode-0", address)
    for p in payloads:
        sender.send("decode-0", p)
    sender.flush()
    got = [out_q.get(timeout=60)[1] for _ in payloads]
    acks, deadline = [], time.monotonic() + 30
    while len(acks) < len(payloads) and time.monotonic() < deadline:
        acks += sender.poll_acks(100)
    ctl_q.put("close")
    assert out_q.get(timeout=60) == ("closed", len(payloads))
    proc.join(30)
    sender.close()
    group.close()
    assert proc.exitcode == 0

    assert [(r["request_id"], r["error"] is None) for r in got] == \
        [("req-a", True), ("req-a", True), ("req-b", False), ("req-c", True), ("req-d", True)]
    assert "request req-b: checksum mismatch" in got[2]["error"]
    for sent, data, r in zip(payloads, expected, got):
        if r["error"] is None:
            assert torch.equal(r["data"], data) and r["data"].dtype == torch.bfloat16
            assert (r["block_ids"], r["last"], r["meta"]) == (sent.block_ids, sent.last, sent.meta)
    assert [(a.request_id, a.ok) for a in acks] == [("req-a", True), ("req-a", True), ("req-b", False),
                                                    ("req-c", True), ("req-d", True)]
    # the receiver's control port is free again
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address.split("#")[0])
    sock.close(linger=0)
    ctx.term()
