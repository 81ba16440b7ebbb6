"""Raw pyzmq across the two-node veth, one factor at a time: what limits zmq
+ CURVE below 5 Gb/s?

One process on node A sends 1 MiB messages (PUSH, copy=False) to one on node
B (PULL, which only counts), testbed/launchers/netns_nodes.py, no Ray, no
engine. Each cell of the sweep sets:
  source   the buffer the frames are cut from, cycled: its size in MiB and
           its fill: `calloc` (bytes(n): every page is the kernel's one
           shared zero page, so the whole source is one 4 KiB of physical
           memory, always in L1: what bench_two_nodes.py's ceiling rows
           send), `zero` (zeros written into private pages), `random`;
  wire     `curve` (zmq CURVE), `plain` (zmq, no encryption), `tcp` (one
           Python socket's sendall of the same frames: no zmq at all);
  link     the A -> B veth unshaped, or shaped by tbf at --rate with a burst;
  buffers  SO_SNDBUF / SO_RCVBUF (zmq.SNDBUF / RCVBUF; 0 = the kernel's
           autotuning, the default).
Printed per cell: the receiver's rate (first data byte to last), each side's
CPU ms per GB by thread, the pair's cores (both sides' CPU over the wall time:
1.0 = one core's worth, however many threads) (/proc/self/task/*/schedstat: softirq work done in a
thread's context counts there), and the machine's busy cores over the
receiver's interval (/proc/stat, every process).

Every socket op has a timeout, every peer a wall-clock limit, and the
namespaces are deleted on exit, whatever happens.

    sudo python experiments/benchmarks/bench_zmq_source.py [--cells default|burst|bufs] [--rate 5] [--mib 256]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

from testbed.kv_transfer.curve import CurveKeys
from testbed.launchers.netns_nodes import NetnsNodes

PY = sys.executable

PEER = r"""
import json, os, socket, sys, time
import numpy as np
role, wire, host, port, total_mib, source_mib, fill, sndbuf, rcvbuf, frame_kib = sys.argv[1:11]
keys = json.loads(sys.argv[11])
frame, total, port = int(frame_kib) << 10, int(total_mib) << 20, int(port)
TIMEOUT_MS = 20000

def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
            sched = open(f"/proc/self/task/{tid}/sched").read()
        except OSError:
            continue
        name = "main" if int(tid) == os.getpid() else comm
        out[name] = out.get(name, 0.0) + ns / 1e9
        m = [ln for ln in sched.splitlines() if ln.startswith("se.nr_migrations")]
        if m:
            out["migrations"] = out.get("migrations", 0) + int(m[0].split()[-1])
    return out

def busy():
    cpu = [int(x) for x in open("/proc/stat").readline().split()[1:8]]
    return sum(cpu) - cpu[3] - cpu[4], sum(cpu)

def source():
    n = int(source_mib) << 20
    if fill == "calloc":
        return memoryview(bytes(n))
    if fill == "zero":
        a = np.empty(n, np.uint8); a[:] = 0
    else:
        a = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    return memoryview(a).cast("B")

def report(t0, c0, b0, n):
    t1, c1, b1 = time.perf_counter(), threads(), busy()
    hz = os.sysconf("SC_CLK_TCK")
    cpu = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1}
    print(json.dumps({"seconds": t1 - t0, "bytes": n, "migrations": cpu.pop("migrations", 0), "cpu_s": cpu,
                      "cores_busy": (b1[0] - b0[0]) / hz / (t1 - t0)}), flush=True)

if wire == "tcp":
    if role == "recv":
        ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if int(rcvbuf): ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(rcvbuf))
        ls.bind((host, port)); ls.listen(1); ls.settimeout(TIMEOUT_MS / 1e3)
        print("up", flush=True)
        c, _ = ls.accept(); c.settimeout(TIMEOUT_MS / 1e3)
        buf = bytearray(frame); n = c.recv_into(buf); t0, c0, b0 = time.perf_counter(), threads(), busy()
        while n < total:
            k = c.recv_into(buf)
            if not k: raise SystemExit("peer closed early")
            n += k
        report(t0, c0, b0, n)
    else:
        c = socket.create_connection((host, port), timeout=TIMEOUT_MS / 1e3)
        if int(sndbuf): c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(sndbuf))
        src = source(); chunks = [src[o:o + frame] for o in range(0, len(src) - frame + 1, frame)]
        t0, c0, b0 = time.perf_counter(), threads(), busy()
        for i in range(total // frame):
            c.sendall(chunks[i % len(chunks)])
        report(t0, c0, b0, total)
        c.shutdown(socket.SHUT_WR); c.settimeout(TIMEOUT_MS / 1e3); c.recv(1)
    raise SystemExit(0)

import zmq
ctx = zmq.Context()
s = ctx.socket(zmq.PULL if role == "recv" else zmq.PUSH)
s.setsockopt(zmq.LINGER, 0); s.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS); s.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
if int(sndbuf): s.setsockopt(zmq.SNDBUF, int(sndbuf))
if int(rcvbuf): s.setsockopt(zmq.RCVBUF, int(rcvbuf))
if role == "recv":
    if wire == "curve":
        s.curve_publickey, s.curve_secretkey, s.curve_server = keys[0].encode(), keys[1].encode(), True
    s.bind(f"tcp://{host}:{port}"); print("up", flush=True)
    s.recv()                                            # "go": the connection (and handshake) is up
    n = len(s.recv(copy=False)); t0, c0, b0 = time.perf_counter(), threads(), busy()
    while n < total:
        n += len(s.recv(copy=False))
    report(t0, c0, b0, n)
else:
    if wire == "curve":
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = (k.encode() for k in (keys[0], keys[2], keys[3]))
    s.connect(f"tcp://{host}:{port}"); s.send(b"go")
    src = source(); chunks = [src[o:o + frame] for o in range(0, len(src) - frame + 1, frame)]
    t0, c0, b0 = time.perf_counter(), threads(), busy()
    for i in range(total // frame - 1):
        s.send(chunks[i % len(chunks)], copy=False)
    s.send(chunks[0], copy=False, track=True).wait(TIMEOUT_MS / 1e3)
    report(t0, c0, b0, total)
s.close(0); ctx.term()
"""


PINS = {"none": ([], []), "split": (["taskset", "-c", "0"], ["taskset", "-c", "1"]),
        "same": (["taskset", "-c", "0"], ["taskset", "-c", "0"])}


def run_cell(net: NetnsNodes, keys: list[str], wire: str, source_mib: int, fill: str, mib: int,
             sndbuf: int = 0, rcvbuf: int = 0, pin: str = "none", frame_kib: int = 1024, port: int = 5990) -> dict:
    """One sender on A, one receiver on B. pin: `split` runs the sender on CPU 0 and the receiver on
    CPU 1 (two hosts' CPUs), `same` both on CPU 0, `none` where the scheduler puts them."""
    a, b = net.nodes
    args = [wire, b.address, str(port), str(mib), str(source_mib), fill, str(sndbuf), str(rcvbuf), str(frame_kib),
            json.dumps(keys)]
    pin_tx, pin_rx = PINS[pin]
    rx = subprocess.Popen(b.exec(*pin_rx, PY, "-c", PEER, "recv", *args), stdout=subprocess.PIPE, text=True)
    tx = None
    try:
        if rx.stdout.readline().strip() != "up":
            raise RuntimeError("receiver did not come up")
        tx = subprocess.Popen(a.exec(*pin_tx, PY, "-c", PEER, "send", *args), stdout=subprocess.PIPE, text=True)
        t_out = tx.communicate(timeout=90)[0]
        r_out = rx.communicate(timeout=30)[0]
    finally:
        for p in (tx, rx):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    sides = {"tx": json.loads(t_out.strip().splitlines()[-1]), "rx": json.loads(r_out.strip().splitlines()[-1])}
    out = {"gbps": 8 * sides["rx"]["bytes"] / sides["rx"]["seconds"] / 1e9, "cores_busy": sides["rx"]["cores_busy"],
           "migrations": sides["tx"]["migrations"] + sides["rx"]["migrations"]}
    for side, r in sides.items():
        gb = r["bytes"] / 1e9
        out[f"{side}_ms_per_gb"] = 1e3 * sum(r["cpu_s"].values()) / gb
        out[f"{side}_threads"] = {k: round(1e3 * v / gb) for k, v in r["cpu_s"].items() if 1e3 * v / gb >= 10}
    return out


def cells(kind: str, rate: float) -> list[dict]:
    """The sweep: one dict of run_cell's knobs (plus the link) per cell."""
    link = [0.0, rate]
    if kind == "default":
        sources = [(1, "calloc"), (1, "random"), (2, "random"), (4, "random"), (8, "random"), (32, "random"),
                   (64, "random"), (32, "zero")]
        return [dict(rate=r, wire=w, source_mib=m, fill=f)
                for r in link for w in ("curve", "plain", "tcp") for m, f in sources]
    if kind == "burst":            # the tbf's burst at --rate: 1x, 2x (the helper's default), 4x, 8x one 250 Hz tick
        tick = int(rate * 1e9 / 8 / 250)
        return [dict(rate=rate, burst=k * tick, wire=w, source_mib=32, fill="random")
                for k in (1, 2, 4, 8) for w in ("curve", "tcp")]
    if kind == "pin":              # where the scheduler puts the two I/O threads
        return [dict(rate=r, wire=w, source_mib=32, fill="random", pin=pn)
                for r in link for w in ("curve", "plain") for pn in ("none", "split", "same")]
    if kind == "overlap":          # two hosts' CPUs (split): does a smaller message, or a larger buffer, overlap more?
        return [dict(rate=r, wire="curve", source_mib=32, fill="random", pin="split", frame_kib=fk, sndbuf=bf, rcvbuf=bf)
                for r in link for fk in (64, 256, 1024) for bf in (0, 4 << 20)]
    if kind == "frames":           # as a run places them (no pinning), at the rate
        return [dict(rate=rate, wire="curve", source_mib=32, fill="random", frame_kib=fk, sndbuf=bf, rcvbuf=bf)
                for fk in (128, 256, 512, 1024) for bf in (0, 4 << 20)]
    if kind == "bimodal":          # many short reps: how often the two I/O threads run at once
        return [dict(rate=rate, wire="curve", source_mib=32, fill="random", pin=pn, frame_kib=fk, sndbuf=4 << 20,
                     rcvbuf=4 << 20) for fk in (1024, 256) for pn in ("none", "split")]
    if kind == "bufs":
        return [dict(rate=r, wire="curve", source_mib=32, fill="random", sndbuf=sb, rcvbuf=rb)
                for r in link for sb, rb in ((0, 0), (1 << 20, 1 << 20), (4 << 20, 4 << 20), (0, 4 << 20))]
    raise SystemExit(f"--cells: unknown {kind!r} (default, burst, bufs, pin, overlap, frames, bimodal)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="default")
    p.add_argument("--rate", type=float, default=5.0, help="tbf rate of the shaped cells, Gbit/s")
    p.add_argument("--mib", type=int, default=256, help="MiB per cell")
    p.add_argument("--reps", type=int, default=1)
    a = p.parse_args()
    ck = CurveKeys.generate()
    keys = [ck.server_public, ck.server_secret, ck.client_public, ck.client_secret]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {a.mib} MiB per cell", flush=True)
    print(f"{'tbf':>5} {'burst':>8} {'wire':<6} {'src MiB':>7} {'fill':<7} {'sndbuf':>7} {'rcvbuf':>7} {'rep':>3} "
          f"{'pin':<5} {'KiB':>5} {'Gb/s':>6} {'busy':>5} {'migr':>5} {'tx ms/GB':>8} {'rx ms/GB':>8}  threads (ms/GB)", flush=True)
    with NetnsNodes(2) as net:
        shaped = None
        for c, rep in itertools.product(cells(a.cells, a.rate), range(a.reps)):
            want = (c["rate"], c.get("burst"))
            if want != shaped:
                if c["rate"]:
                    net.shape(net.nodes[0], c["rate"], c.get("burst"))
                else:
                    net.unshape(net.nodes[0])
                shaped = want
            r = run_cell(net, keys, c["wire"], c["source_mib"], c["fill"], a.mib, c.get("sndbuf", 0),
                         c.get("rcvbuf", 0), c.get("pin", "none"), c.get("frame_kib", 1024))
            th = " ".join(f"{s}:{k}={v}" for s in ("tx", "rx") for k, v in sorted(r[f"{s}_threads"].items()))
            burst = c.get("burst") or (max(2 * int(c["rate"] * 1e9 / 8 / 250), 128 << 10) if c["rate"] else 0)
            print(f"{c['rate'] or 'none':>5} {burst:>8} {c['wire']:<6} {c['source_mib']:>7} {c['fill']:<7} "
                  f"{c.get('sndbuf', 0):>7} {c.get('rcvbuf', 0):>7} {rep:>3} {c.get('pin', 'none'):<5} {c.get('frame_kib', 1024):>5} {r['gbps']:6.2f} {r['cores_busy']:5.2f} {r['migrations']:5d} "
                  f"{r['tx_ms_per_gb']:8.0f} {r['rx_ms_per_gb']:8.0f} "
                  f"{(r['tx_ms_per_gb'] + r['rx_ms_per_gb']) / 1e3 * r['gbps'] / 8:10.2f}  {th}", flush=True)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (2 cores shared by 4 "
          "engineers: noisy)")


if __name__ == "__main__":
    main()
