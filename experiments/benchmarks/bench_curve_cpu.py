"""CPU per GB of zmq over CURVE across the two-node veth, raw pyzmq against
the zmq transport, per process and per thread (libzmq's I/O thread does the
encryption and decryption; Python's main thread does the transport's landing
copy and xxh3).

One process on node A sends, one on node B receives (testbed/launchers/
netns_nodes.py, no Ray, no engine), optionally through a tbf at --rate:
  raw        pyzmq PUSH -> PULL, --frame-kib messages, copy=False, from a
             --raw-source-mib buffer (1: one cache-hot frame, as
             bench_two_nodes.py's "raw pyzmq, CURVE"); the receiver only counts;
  transport  ZmqSender -> ZmqReceiver (the run's CURVE keys), view_kv
             payloads of 32 MiB landing straight in cache blocks
             (BlockLanding), one at a time: send, land + verify, ack.
Each peer reads /proc/self/task/*/schedstat (time on CPU, ns) and stat (page
faults) around the timed part; the figures
are CPU ms per GB moved, by thread, and the rate. Both nodes share this
machine's cores, so the sum over both peers, times the rate, is the cores
the path needs: at 5 Gb/s (0.625 GB/s) 1600 ms/GB is one whole core.

    sudo python experiments/benchmarks/bench_curve_cpu.py [--rate 5] [--frame-kib 1024] [--mib 256] [--reps 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from testbed.kv_transfer.curve import CurveKeys
from testbed.launchers.netns_nodes import NetnsNodes

PY = sys.executable

PEER = r"""
import json, os, sys, time
import torch, zmq
role, mode, host, keys_path, frame_kib, total_mib, port, source_mib, sockbuf = sys.argv[1:10]
frame, total, port = int(frame_kib) << 10, int(total_mib) << 20, int(port)
torch.set_num_threads(1)

def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            on_cpu_ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])   # ns, unlike stat's ticks
        except OSError:
            continue
        name = "main" if int(tid) == os.getpid() else comm
        out[name] = out.get(name, 0.0) + on_cpu_ns / 1e9
        out["faults"] = out.get("faults", 0) + int(f[7])        # minor page faults, all threads
    return out

def report(t0, c0, nbytes):
    elapsed = time.perf_counter() - t0
    c1 = threads()
    print(json.dumps({"role": role, "seconds": elapsed, "bytes": nbytes,
                      "cpu_s": {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1}}), flush=True)

from testbed.kv_transfer.curve import CurveKeys
keys = CurveKeys.read(keys_path)
if mode == "raw":
    ctx = zmq.Context()
    if role == "recv":
        s = ctx.socket(zmq.PULL)
        s.curve_publickey, s.curve_secretkey, s.curve_server = keys.server_public.encode(), keys.server_secret.encode(), True
        s.bind(f"tcp://{host}:{port}"); print("up", flush=True)
        s.recv(); n = 0
        c0, t0 = threads(), time.perf_counter()
        while n < total:
            n += len(s.recv(copy=False))
        report(t0, c0, n)
    else:
        s = ctx.socket(zmq.PUSH)
        s.curve_serverkey = keys.server_public.encode()
        s.curve_publickey, s.curve_secretkey = keys.client_public.encode(), keys.client_secret.encode()
        s.connect(f"tcp://{host}:{port}"); s.send(b"go")
        src = memoryview(torch.randn(int(source_mib) << 18).numpy()).cast("B")     # cycled through, frame by frame
        chunks = [src[off:off + frame] for off in range(0, len(src) - frame + 1, frame)]
        c0, t0 = threads(), time.perf_counter()
        for i in range(total // frame - 1):
            s.send(chunks[i % len(chunks)], copy=False)
        s.send(chunks[0], copy=False, track=True).wait(120)     # freed once encrypted and written
        report(t0, c0, total)
        time.sleep(1)
    s.close(0); ctx.term()
else:
    from testbed.kv_transfer import TransferConfig, make_receiver, make_sender, view_kv
    from testbed.kv_transfer.landing import BlockLanding
    cfg = TransferConfig(host=host, frame_bytes=frame, timeout_s=60, socket_buffer_bytes=int(sockbuf))
    blocks = 256                                            # 32 MiB: [4, 2, 256, 16, 8, 32] fp32
    cache = torch.randn(4, 2, blocks + 8, 16, 8, 32)
    reps = total // (32 << 20)
    if role == "recv":
        rx = make_receiver(cfg, curve=keys)
        rx.land_with(lambda p: BlockLanding(cache, p))
        print(rx.address, flush=True)
        done, c0, t0 = 0, None, None
        while done < reps:
            for p in rx.poll(100):
                assert p.error is None, p.error
                rx.ack(p.origin, p.request_id, ok=True)
                done += 1
                if done == 1:          # the first one is the warm-up: connection, page faults
                    c0, t0 = threads(), time.perf_counter()
        report(t0, c0, (reps - 1) * (32 << 20))
        time.sleep(2); rx.close()
    else:
        tx = make_sender(cfg, name="probe-sender", curve=keys)
        tx.connect("rx", sys.stdin.readline().strip())
        ids = list(range(blocks))
        time.sleep(1.0)
        for i in range(reps):
            if i == 1:
                c0, t0 = threads(), time.perf_counter()
            tx.send("rx", view_kv(cache, (0, 4), ids, ids, 16 * blocks, f"r{i}"))
            acks = []
            while not acks:
                acks = tx.poll_acks(1000)      # wakes when the ack comes: the transport, not a poll loop
            assert acks[0].ok, acks[0].reason
            tx.flush()
        report(t0, c0, (reps - 1) * (32 << 20))
        tx.close()
"""


def run_pair(net: NetnsNodes, mode: str, keys_path: str, mib: int, frame_kib: int = 1024,
             raw_source_mib: int = 32, socket_buffer_bytes: int = 0) -> dict:
    """One sender on net.nodes[0], one receiver on net.nodes[1]: `mode` raw or transport. Returns
    the rate, CPU ms per GB of each side and of each thread ("tx:main", "rx:ZMQbg/IO/0", ...), and
    minor page faults per 4 KiB page moved."""
    node_a, node_b = net.nodes
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    total = mib + (32 if mode == "transport" else 0)          # + the transport's warm-up payload
    args = [mode, node_b.address, keys_path, str(frame_kib), str(total), "5995", str(raw_source_mib),
            str(socket_buffer_bytes)]
    rx = subprocess.Popen(node_b.exec(PY, "-c", PEER, "recv", *args), stdout=subprocess.PIPE, text=True, env=env)
    first = rx.stdout.readline()
    tx = subprocess.Popen(node_a.exec(PY, "-c", PEER, "send", *args), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env)
    tx.stdin.write(first)
    tx.stdin.flush()
    sides = {"tx": json.loads(tx.communicate(timeout=300)[0].strip().splitlines()[-1]),
             "rx": json.loads(rx.communicate(timeout=300)[0].strip().splitlines()[-1])}
    out = {"gbps": 8 * sides["rx"]["bytes"] / sides["rx"]["seconds"] / 1e9, "threads": {}}
    for side, r in sides.items():
        gb = r["bytes"] / 1e9
        out[f"{side}_faults_per_page"] = r["cpu_s"].pop("faults") * 4096 / r["bytes"]
        out[f"{side}_ms_per_gb"] = 1e3 * sum(r["cpu_s"].values()) / gb
        out["threads"] |= {f"{side}:{k}": 1e3 * v / gb for k, v in r["cpu_s"].items() if 1e3 * v / gb >= 5}
    out["ms_per_gb"] = out["tx_ms_per_gb"] + out["rx_ms_per_gb"]
    return out


def line(mode: str, rep: int, r: dict) -> str:
    return (f"{mode:<10} {rep:>3} {r['gbps']:6.2f} {r['tx_ms_per_gb']:9.0f} {r['rx_ms_per_gb']:9.0f} "
            f"{r['ms_per_gb']:9.0f} {r['ms_per_gb'] / 1e3 * r['gbps'] / 8:18.2f}   "
            + " ".join(f"{k}={v:.0f}" for k, v in sorted(r["threads"].items()))
            + f"   page faults per page moved: tx {r['tx_faults_per_page']:.2f} rx {r['rx_faults_per_page']:.2f}")


HEAD = (f"{'path':<10} {'rep':>3} {'Gb/s':>6} {'tx ms/GB':>9} {'rx ms/GB':>9} {'sum ms/GB':>9} "
        f"{'cores at this rate':>18}   by thread (ms/GB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=0.0, help="tbf rate on A -> B, Gbit/s (0: unshaped)")
    p.add_argument("--frame-kib", type=int, default=1024)
    p.add_argument("--mib", type=int, default=256, help="bytes timed per pair (the transport: in 32 MiB payloads)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--raw-source-mib", type=int, default=32,
                   help="raw sends its frames from a buffer this large, cycled: 32 = the transport's payload, "
                        "out of L2 like a real cache; 1 = one cache-hot frame (bench_two_nodes.py's raw pyzmq)")
    p.add_argument("--modes", nargs="+", default=["raw", "transport"])
    p.add_argument("--socket-buffer", type=int, default=0, help="the transport's transfer.socket_buffer_bytes")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="curvecpu-")
    keys_path = os.path.join(work, "keys.json")
    CurveKeys.generate().write(keys_path)
    print(f"# {time.strftime('%H:%M:%S', time.gmtime())} UTC, load average {os.getloadavg()[0]:.2f}; "
          f"tbf {a.rate or 'none'} Gb/s; {a.frame_kib} KiB frames; {a.mib} MiB per pair; "
          f"transfer.socket_buffer_bytes={a.socket_buffer}", flush=True)
    print(HEAD)
    with NetnsNodes(2) as net:
        if a.rate:
            net.shape(net.nodes[0], a.rate)
        for rep in range(a.reps):
            for mode in a.modes:
                print(line(mode, rep, run_pair(net, mode, keys_path, a.mib, a.frame_kib, a.raw_source_mib,
                                                 a.socket_buffer)),
                      flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f} (2 cores shared by 4 engineers: noisy)")


if __name__ == "__main__":
    main()
