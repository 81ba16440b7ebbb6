"""The shaped link really limits the rate and adds latency, measured end to
end (send to ack from a receiver in another process), and never blocks send()."""
from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))     # spawned children find the peer module the same way
import test_transport_peers as peers  # noqa: E402

from testbed.kv_transfer import TransferConfig, make_sender, pack_kv  # noqa: E402

SPAWN = mp.get_context("spawn")


def _payloads(n: int, seed: int):
    cache = torch.randn(1, 2, 16, 16, 8, 32, generator=torch.Generator().manual_seed(seed))  # 32 KiB per block
    return [pack_kv(cache, (0, 1), list(range(16)), list(range(16)), 256, f"req-{i}") for i in range(n)]


def _run(cfg: TransferConfig, payloads) -> tuple[float, float, list, list]:
    """(seconds send() took in total, seconds from the first send to the last ack, acks, arrivals)"""
    out_q, ctl_q = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=peers.run_receiver, args=(cfg, len(payloads), out_q, ctl_q))
    proc.start()
    kind, address = out_q.get(timeout=60)
    sender = make_sender(cfg, name="p")
    sender.connect("d", address)
    assert sender.poll_acks(200) == []      # let the connection come up before the clock starts
    t0 = time.monotonic()
    for p in payloads:
        sender.send("d", p)
    t_sent = time.monotonic()
    acks = []
    while len(acks) < len(payloads) and time.monotonic() < t0 + 60:
        acks += sender.poll_acks(50)
    t_acked = time.monotonic()
    arrivals = [out_q.get(timeout=60)[1] for _ in payloads]
    ctl_q.put("close")
    out_q.get(timeout=60)
    proc.join(30)
    sender.close()
    return t_sent - t0, t_acked - t0, acks, arrivals


def test_rate_limit_is_real():
    cfg = TransferConfig(transport="shaped", rate_gbps=0.4)          # 50 MB/s, far below loopback
    payloads = _payloads(16, 0)                                       # 16 x 1 MiB
    total = sum(p.nbytes for p in payloads)
    send_s, elapsed_s, acks, arrivals = _run(cfg, payloads)
    assert [a.ok for a in acks] == [True] * 16 and all(r["error"] is None for r in arrivals)
    rate = total / elapsed_s
    assert abs(rate - cfg.rate_bytes_per_s) / cfg.rate_bytes_per_s < 0.15, (rate, elapsed_s)
    assert send_s < 0.1 * elapsed_s              # send() only queues: the link thread does the waiting
    assert torch.equal(arrivals[-1]["data"], payloads[-1].data)


def test_latency_is_added_once_per_payload():
    cfg = TransferConfig(transport="shaped", rate_gbps=100.0, latency_ms=150.0)
    payloads = _payloads(3, 1)
    t_before = time.monotonic()
    _, elapsed_s, acks, arrivals = _run(cfg, payloads)
    assert len(acks) == 3
    # pipelined: three back-to-back payloads arrive ~one latency after they were sent, not three
    assert 0.15 <= elapsed_s < 0.45, elapsed_s
    assert all(r["arrived_s"] - t_before >= 0.15 for r in arrivals)


def test_close_stops_the_link_thread_and_drops_the_queue():
    cfg = TransferConfig(transport="shaped", rate_gbps=0.001)        # 125 kB/s: the queue stays full
    sender = make_sender(cfg, name="shaped-close")
    sender.connect("d", "tcp://127.0.0.1:9")                          # nothing listens: nothing is sent
    for p in _payloads(2, 2):
        sender.send("d", p)
    assert any(t.name == "shaped-link-shaped-close" for t in threading.enumerate())
    t0 = time.monotonic()
    sender.close()
    assert time.monotonic() - t0 < 1.0
    assert not any(t.name == "shaped-link-shaped-close" for t in threading.enumerate())


def test_blocks_rewritten_while_the_link_holds_them_fail_the_check():
    """A view_kv payload (the cache's own blocks, no checksum yet) waits on the link for its
    latency; blocks freed and rewritten meanwhile (an expired lease) must fail the receiver's
    check: the shaped link hashes them when they are handed to it, not when it sends them."""
    from testbed.kv_transfer import view_kv
    cfg = TransferConfig(transport="shaped", rate_gbps=100.0, latency_ms=300.0)
    cache = torch.randn(1, 2, 16, 16, 8, 32, generator=torch.Generator().manual_seed(2))
    payload = view_kv(cache, (0, 1), list(range(16)), list(range(16)), 256, "req-rewritten")
    assert payload.checksum is None

    class Rewriting(list):
        def __iter__(self):                  # _run's send loop: the blocks change right after send()
            yield from super().__iter__()
            cache.add_(1.0)
    _, _, acks, arrivals = _run(cfg, Rewriting([payload]))
    assert [a.ok for a in acks] == [False] and "checksum mismatch" in arrivals[0]["error"]
