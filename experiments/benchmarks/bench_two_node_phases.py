"""Where the time of one KV transfer across the shaped veth goes, phase by
phase: the real sender and receiver classes of the disagg workers (pack_kv
into a reused staging buffer, ZmqSender or TorchDistSender under the run's
CURVE keys, the receiver landing straight into cache blocks), one process on
node A and one on node B (testbed/launchers/netns_nodes.py, no Ray, no
engine), the same payload as bench_two_nodes.py (4096 tokens of the tiny
model made MHA: 32 MiB).

Timestamps (time.monotonic, one clock for every namespace of the machine):
  sender:   t0 (the hand-off), packed (view_kv or pack_kv returned: nothing, or gather + xxh3;
            --packed: pack_kv even for zmq, the path before view_kv; --checksum-first: view_kv
            then its xxh3, the path before the checksum trailer), sent (send() returned: zmq
            hashes view_kv's chunks as it queues them),
            acked (the receiver's ack came back);
  receiver: header (header decoded), first/last (first and last data bytes read; gloo: the recv
            posted and completed), landed (poll returned the verified payload);
  wire:     node A's veth tx_bytes sampled every ms: the burst's first and last rise.
The row's `transfer` is landed - t0, the interval the run summary's transfer_s
spans minus the workers' loops and events.

    sudo python experiments/benchmarks/bench_two_node_phases.py [--rates 0 1 5] [--reps 5] [--transport zmq]

Needs root. Figures: experiments/README.md, "Two nodes"."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed.kv_transfer.curve import CurveKeys
from testbed.launchers.netns_nodes import NetnsNodes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_two_nodes import SAMPLER, bursts, read_samples  # noqa: E402

PY = sys.executable

PEER = """
import json, sys, time, torch
from testbed.kv_transfer import TransferConfig, make_receiver, make_sender, pack_kv, view_kv
from testbed.kv_transfer.curve import CurveKeys
from testbed.kv_transfer.landing import BlockLanding
role, host, transport, keys_path, reps, dist_addr, path = sys.argv[1:8]
packed = path == 'packed'
reps = int(reps)
torch.set_num_threads(1)
keys = CurveKeys.read(keys_path)
cfg = TransferConfig(transport=transport, host=host, timeout_s=60)
blocks = 256
cache = torch.randn(4, 2, blocks + 8, 16, 8, 32)              # [L, 2, blocks, block_size, kv heads, head dim]
group = None
if transport == "torch_dist":
    from testbed.kv_transfer import TorchDistGroup
    group = TorchDistGroup(dist_addr, 0 if role == "send" else 1, 2, "gloo", 60, bind_host=host)
if role == "recv":
    rx = make_receiver(cfg, group=group, curve=keys)
    marks = {}
    rx.land_with(lambda p: marks.setdefault(p.request_id, {}).update(header=time.monotonic())
                 or BlockLanding(cache, p))
    if transport == "zmq":
        body = rx._recv_body
        def timed_body(origin, _body=body):
            o = rx._open_by_origin.get(origin)
            out = _body(origin)
            if o is not None:
                m = marks[o.payload.request_id]
                m.setdefault("first", time.monotonic()); m["last"] = time.monotonic()
            return out
        rx._recv_body = timed_body
    print(rx.address, flush=True)
    done = 0
    while done < reps:
        for p in rx.poll(100):
            marks[p.request_id]["landed"] = time.monotonic()
            assert p.error is None, p.error
            rx.ack(p.origin, p.request_id, ok=True)
            done += 1
    print(json.dumps(marks), flush=True)
    time.sleep(2)
else:
    tx = make_sender(cfg, name="probe-sender", group=group, curve=keys)
    tx.connect("rx", sys.stdin.readline().strip())
    staging = torch.empty(4 * 2 * blocks * 16 * 8 * 32 * 4, dtype=torch.uint8)
    ids = list(range(blocks))
    marks = {}
    time.sleep(1.0)
    for i in range(reps):
        rid = f"r{i}"
        m = marks[rid] = {"t0": time.monotonic()}
        # what RealKVPort does: the blocks themselves where the sender takes parts, else packed
        payload = view_kv(cache, (0, 4), ids, ids, 16 * blocks, rid) if tx.takes_parts and not packed else None
        payload = payload or pack_kv(cache, (0, 4), ids, ids, 16 * blocks, rid, out=staging)
        if path == 'checksum-first':       # the whole payload hashed before the header (before the trailer)
            payload.checksum = payload.data_checksum()
        m["packed"] = time.monotonic()
        tx.send("rx", payload)
        m["sent"] = time.monotonic()
        acks = []
        while not acks:
            acks = tx.poll_acks(1)
        m["acked"] = time.monotonic()
        assert acks[0].ok, acks[0].reason
        time.sleep(0.5)
    print(json.dumps(marks), flush=True)
    tx.close()
"""


def probe(net: NetnsNodes, rate: float, a, keys_path: str, work: Path) -> list[dict]:
    a_node, b_node = net.nodes
    qdisc = net.shape(a_node, rate) if rate else "none"
    samples_path = work / f"tx-{rate}.txt"
    sampler = subprocess.Popen(a_node.exec(PY, "-c", SAMPLER, f"/sys/class/net/{a_node.dev}/statistics/tx_bytes",
                                           str(samples_path), str(5 + 3 * a.reps)))
    dist_addr, store = "-", None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        if a.transport == "torch_dist":
            dist_addr = f"tcp://{a_node.address}:5996"
            store = subprocess.Popen(a_node.exec(PY, "-c", "import datetime, time, torch.distributed as d; "
                                                 f"s = d.TCPStore('{a_node.address}', 5996, None, True, "
                                                 "timeout=datetime.timedelta(seconds=120)); time.sleep(120)"))
            time.sleep(1.0)
        rx = subprocess.Popen(b_node.exec(PY, "-c", PEER, "recv", b_node.address, a.transport, keys_path,
                                          str(a.reps), dist_addr, "-"), stdout=subprocess.PIPE, text=True, env=env)
        tx = subprocess.Popen(a_node.exec(PY, "-c", PEER, "send", a_node.address, a.transport, keys_path,
                                          str(a.reps), dist_addr, a.path),
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
        tx.stdin.write(rx.stdout.readline())
        tx.stdin.flush()
        sent = json.loads(tx.communicate(timeout=120)[0])
        received = json.loads(rx.stdout.readline())
        rx.wait(timeout=30)
    finally:
        if store is not None:
            store.kill()
            store.wait()
        sampler.terminate()
        sampler.wait()
        net.unshape(a_node)
    wire = [(b0, b1, n) for b0, b1, n, _ in bursts(read_samples(samples_path), 30 << 20)]
    rows = []
    for rid in sorted(sent, key=lambda r: int(r[1:])):
        s, r = sent[rid], received[rid]
        w = next(((b0, b1, n) for b0, b1, n in wire if s["t0"] - 0.01 <= b0 <= r["landed"]), None)
        row = {"qdisc": qdisc, "rid": rid, "pack_ms": s["packed"] - s["t0"], "send_ms": s["sent"] - s["packed"],
               "header_ms": r["header"] - s["t0"], "transfer_ms": r["landed"] - s["t0"],
               "ack_ms": s["acked"] - s["t0"]}
        if "first" in r:
            row.update(first_ms=r["first"] - s["t0"], last_ms=r["last"] - s["t0"], tail_ms=r["landed"] - r["last"])
        if w is not None:
            row.update(wire_start_ms=w[0] - s["t0"], wire_end_ms=w[1] - s["t0"],
                       wire_gbps=8 * w[2] / (w[1] - w[0]) / 1e9, tail_after_wire_ms=r["landed"] - w[1])
        rows.append({k: (round(v * 1e3, 2) if k.endswith("_ms") else v) for k, v in row.items()})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[0, 1.0, 5.0], help="tbf rates, Gbit/s (0: none)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--transport", choices=["zmq", "torch_dist"], default="zmq")
    p.add_argument("--packed", action="store_true", help="pack_kv even where the sender takes parts (the old path)")
    p.add_argument("--checksum-first", action="store_true",
                   help="view_kv's payload hashed whole before its header (the path before the checksum trailer)")
    p.add_argument("--split-cpus", action="store_true", help="each node on CPUs of its own (as bench_two_nodes.py)")
    a = p.parse_args()
    a.path = "packed" if a.packed else "checksum-first" if a.checksum_first else "parts"
    work = Path(tempfile.mkdtemp(prefix="phases-"))
    keys_path = str(work / "keys.json")
    CurveKeys.generate().write(keys_path)
    nbytes = 4 * 2 * 256 * 16 * 8 * 32 * 4
    cols = ["pack_ms", "send_ms", "header_ms", "wire_start_ms", "first_ms", "last_ms", "wire_end_ms",
            "transfer_ms", "tail_after_wire_ms", "ack_ms", "wire_gbps"]
    with NetnsNodes(2, split_cpus=a.split_cpus) as net:
        for rate in a.rates:
            rows = probe(net, rate, a, keys_path, work)
            print(f"\n{a.transport} {a.path}, tbf {rate or 'none'} Gb/s ({rows[0]['qdisc']}), ms after the hand-off (t0):")
            print(" ".join(f"{c:>18}" for c in ["rid", *cols, "transfer Gb/s"]))
            for r in rows:
                print(" ".join(f"{r.get(c, float('nan')):>18.2f}" if c != "rid" else f"{r[c]:>18}"
                               for c in ["rid", *cols]) + f" {8 * nbytes / r['transfer_ms'] / 1e6:>18.2f}")
            med = {c: statistics.median(r[c] for r in rows if c in r) for c in cols if any(c in r for r in rows)}
            print("median " + " ".join(f"{c}={v:.2f}" for c, v in med.items())
                  + f" transfer_gbps={8 * nbytes / med['transfer_ms'] / 1e6:.3f}", flush=True)


if __name__ == "__main__":
    main()
