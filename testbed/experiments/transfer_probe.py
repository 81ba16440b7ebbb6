"""Measures real KV transfers between two processes on this machine: a prompt's
KV payload sent over a configured transport (zmq, torch_dist/gloo, or a shaped
link), received, verified, written into the receiver's cache, acknowledged.
Used by the crossover study for its measured transfer tax."""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

from testbed.kv_transfer import TorchDistGroup, TransferConfig, make_receiver, make_sender, pack_kv, \
    start_rendezvous, unpack_kv


def _receiver(cfg: TransferConfig, cache_shape: tuple, dtype: torch.dtype, n_payloads: int,
              dist_addr: str | None, addr_q) -> None:
    torch.set_num_threads(1)
    group = TorchDistGroup(dist_addr, 1, 2, cfg.dist_backend, cfg.timeout_s) if dist_addr else None
    rx = make_receiver(cfg, group=group)
    cache = torch.zeros(cache_shape, dtype=dtype)
    addr_q.put(rx.address)
    received = 0
    try:
        while received < n_payloads:
            for p in rx.poll(1000):
                if p.error is None:
                    unpack_kv(cache, p)
                rx.ack(p.origin, p.request_id, ok=p.error is None, reason=p.error or "")
                received += 1
    finally:
        rx.close()
        if group is not None:
            group.close()


def measure_transfer_s(cfg: TransferConfig, cache: torch.Tensor, num_tokens_list: list[int],
                       repeats: int = 3) -> dict[int, float]:
    """Median seconds from send to acknowledgement of the KV of each prompt
    length (all layers; blocks [0, n) of `cache`), packing excluded."""
    block_size = cache.shape[3]
    ctx = mp.get_context("spawn")
    dist_addr, store = None, None
    real = cfg.shaped_inner if cfg.transport == "shaped" else cfg.transport
    if real == "torch_dist":
        store, dist_addr = start_rendezvous(cfg.host, cfg.timeout_s)
    addr_q = ctx.Queue()
    n_payloads = len(num_tokens_list) * (repeats + 1)
    proc = ctx.Process(target=_receiver, args=(cfg, tuple(cache.shape), cache.dtype, n_payloads, dist_addr, addr_q),
                       daemon=True)
    proc.start()
    group = TorchDistGroup(dist_addr, 0, 2, cfg.dist_backend, cfg.timeout_s) if dist_addr else None
    tx = make_sender(cfg, name="probe", group=group)
    out: dict[int, float] = {}
    try:
        tx.connect("rx", addr_q.get(timeout=60))
        for n in num_tokens_list:
            blocks = list(range(-(-n // block_size)))
            payload = pack_kv(cache, (0, cache.shape[0]), blocks, blocks, n, f"p{n}")
            times = []
            for rep in range(repeats + 1):          # the first is a warm-up
                t0 = time.perf_counter()
                tx.send("rx", payload)
                acks = []
                deadline = t0 + cfg.timeout_s
                while not acks and time.perf_counter() < deadline:
                    acks = tx.poll_acks(100)
                if not acks or not acks[0].ok:
                    raise RuntimeError(f"transfer probe: no good ack for {n} tokens over {cfg.transport}")
                if rep:
                    times.append(time.perf_counter() - t0)
            out[n] = statistics.median(times)
    finally:
        tx.close()
        if group is not None:
            group.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        del store
    return out
