"""Peer processes for the transport tests (no tests here). They live in a
module of their own so that spawned children can import them: the tests put
this directory on sys.path, which spawn hands to its children."""
from __future__ import annotations

import time

import torch

from testbed.kv_transfer import TorchDistGroup, TransferConfig, make_receiver


def run_receiver(cfg: TransferConfig, num_payloads: int, out_q, ctl_q,
                 dist: tuple[str, int, int] | None = None) -> None:
    """Receive num_payloads payloads, report each (data cloned) on out_q and
    ack it (ok, or failed with the receiver's reason); close when ctl_q says so."""
    torch.set_num_threads(1)
    group = TorchDistGroup(dist[0], dist[1], dist[2], timeout_s=cfg.timeout_s) if dist else None
    receiver = make_receiver(cfg, group=group)
    out_q.put(("address", receiver.address))
    deadline = time.monotonic() + 60
    received = 0
    while received < num_payloads and time.monotonic() < deadline:
        for p in receiver.poll(100):
            received += 1
            out_q.put(("payload", {
                "request_id": p.request_id, "error": p.error, "last": p.last, "meta": p.meta,
                "layers": (p.layer_start, p.layer_end), "block_ids": p.block_ids, "origin": p.origin,
                "num_tokens": p.num_tokens, "data": p.data.clone() if p.ok else None,
                "arrived_s": time.monotonic()}))
            receiver.ack(p.origin, p.request_id, ok=p.ok, reason=p.error or "")
    ctl_q.get(timeout=60)          # acks are queued, not yet sent: close only when the sender has them
    receiver.close()
    if group is not None:
        group.close()
    out_q.put(("closed", received))
