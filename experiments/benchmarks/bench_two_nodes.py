"""The KV across a kernel-shaped link between two "hosts", against the shaped
rate and against the simulator's link model at that rate.

Two network namespaces joined by a veth pair (testbed/launchers/two_nodes.py),
a Ray head on node A and a worker node on B; `testbed run mode=disagg
launcher=ray` inside A, prefill on A, decode on B, the A -> B veth shaped with
`tc qdisc ... root tbf rate R` at each --rates value (--reps runs each). Each
request's KV is --prompt-len tokens of the tiny model made MHA
(model.num_kv_heads=8: 8 KiB per token, 32 MiB for 4096 tokens), sent whole
after its prefill (not layer-wise), so:

  transfer   = the run summary's kv_transfer: bytes over the summed transfer_s,
               transfer_s from the prefill worker's hand-off (before pack_kv) to
               the decode worker's KVReceived (after unpack_kv into its cache):
               the whole move, host copies and checksum included;
  wire       = node A's veth tx_bytes sampled every ms inside A: bytes over the
               time the counter was rising, per transfer (the link alone);
  exposed    = kv_transfer.exposed_ms p50: KVReceived minus Prefilled, the
               same interval (nothing overlaps a whole-prompt send);
  sim        = the same workload with runtime=sim and link.bandwidth_gbps=R,
               link.latency_us = half the veth's measured TCP round trip,
               link.per_message_us = the tcp-25 preset's 15 us (documented):
               its exposed_ms p50 (the link alone);
  sim+host   = the same, per_message_us plus the host's serial work per
               transfer (view_kv, and the last frame's landing + xxh3 after
               the last byte; timed in-process before the runs; the sender
               hashes the chunks as they go since the checksum trailer): one
               message per request here;
  sim@ceil   = the link at min(R, C), C the transfer rate of a first run with
               no qdisc (the host's own ceiling: CURVE encryption, copies, a
               shared CPU): what the path can carry, whatever the tbf allows.
  cores busy = the machine's busy CPU time (/proc/stat, every process) over
               the burst's wall time, median of the run's transfers: 2.00 =
               both cores of this machine busy while the KV was on the wire.

Before the runs it prints the raw ceilings over the unshaped veth (pyzmq plain
and CURVE, gloo) and the CPU per GB of raw CURVE and of the zmq transport by
thread (bench_curve_cpu.py), with the cores each needs at each --rates value.

    sudo python experiments/benchmarks/bench_two_nodes.py [--rates 1 5] [--reps 2] [--transport zmq|torch_dist]

--transport torch_dist sends the data over gloo (plain TCP between the nodes'
addresses: gloo's pairs and the TCPStore rendezvous are unauthenticated; the
headers and acks still go over zmq under CURVE); zmq sends it over CURVE.

Needs root (namespaces, tc). Targets: transfer within 10% of R; sim
exposed within 15% of the measured exposed."""
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

from testbed.launchers.two_nodes import TwoNodes

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

# each line: time, the veth's tx_bytes, and the machine's busy and total CPU jiffies (/proc/stat is
# not namespaced: every core, every process, Ray's included)
SAMPLER = """
import signal, sys, time
path, out, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
f = open(path, 'rb', buffering=0)
stat = open('/proc/stat', 'rb', buffering=0)
samples, end = [], time.monotonic() + seconds
try:
    while time.monotonic() < end:
        f.seek(0); stat.seek(0)
        cpu = [int(x) for x in stat.readline().split()[1:8]]
        samples.append((time.monotonic(), int(f.read()), sum(cpu) - cpu[3] - cpu[4], sum(cpu)))
        time.sleep(0.001)
finally:
    open(out, 'w').write('\\n'.join(' '.join(map(str, s)) for s in samples))
"""

PINGPONG = """
import socket, sys, time
host, role = sys.argv[1], sys.argv[2]
if role == 'server':
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, 5999)); s.listen(1)
    print('up', flush=True); c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (b := c.recv(1)):
        c.sendall(b)
else:
    c = socket.create_connection((host, 5999)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(200):
        t = time.perf_counter(); c.sendall(b'x'); c.recv(1); rtts.append(time.perf_counter() - t)
    rtts.sort(); print(rtts[len(rtts) // 2])
"""


ZMQ_PAIR = """
import os, sys, time, zmq
host, role, curve = sys.argv[1], sys.argv[2], sys.argv[3] == "curve"
keys = sys.argv[4:]            # z85: server public, server secret, client public, client secret
ctx = zmq.Context()
if role == 'server':
    s = ctx.socket(zmq.PULL)
    if curve:
        s.curve_publickey, s.curve_secretkey, s.curve_server = keys[0].encode(), keys[1].encode(), True
    s.bind(f'tcp://{host}:5998'); s.recv(); t = None; n = 0
    while (m := s.recv(copy=False)).bytes != b'end':
        t = t or time.perf_counter(); n += len(m)
    print(8 * n / (time.perf_counter() - t) / 1e9, flush=True)
    s.close(0)
else:
    s = ctx.socket(zmq.PUSH)
    if curve:
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = (k.encode() for k in (keys[0], keys[2], keys[3]))
    s.connect(f'tcp://{host}:5998'); s.send(b'go'); buf = os.urandom(1 << 20)   # bytes(n) would be the zero page
    for _ in range(128):
        s.send(buf, copy=False)
    s.send(b'end'); s.close(linger=10000)
ctx.term()
"""


def zmq_ceiling_gbps(tn: TwoNodes, curve: bool) -> float:
    """Raw pyzmq PUSH -> PULL, A -> B over the unshaped veth, 128 MiB in 1 MiB messages,
    with CURVE or without: what the path carries before any of the transport's work."""
    import zmq
    sp, ss = zmq.curve_keypair()
    cp, cs = zmq.curve_keypair()
    keys = [k.decode() for k in (sp, ss, cp, cs)]
    kind = "curve" if curve else "plain"
    srv = subprocess.Popen(tn.b.exec(PY, "-c", ZMQ_PAIR, tn.b.address, "server", kind, *keys),
                           stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        subprocess.run(tn.a.exec(PY, "-c", ZMQ_PAIR, tn.b.address, "client", kind, *keys), check=True, timeout=120)
        return float(srv.communicate(timeout=120)[0])
    finally:
        srv.kill()
        srv.wait()


GLOO_PAIR = """
import datetime, sys, time, torch, torch.distributed as dist
host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore(host, port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
opts = dist.ProcessGroupGloo._Options()
opts._devices = [dist.ProcessGroupGloo.create_device(hostname=sys.argv[4])]
pg = dist.ProcessGroupGloo(store, rank, 2, opts)
buf = torch.empty(32 << 20, dtype=torch.uint8)
pg.barrier().wait()
t = time.perf_counter()
for _ in range(4):
    (pg.send([buf], 1, 0) if rank == 0 else pg.recv([buf], 0, 0)).wait()
if rank == 1:
    print(8 * 4 * buf.numel() / (time.perf_counter() - t) / 1e9, flush=True)
pg.barrier().wait()
"""


def gloo_ceiling_gbps(tn: TwoNodes) -> float:
    """Raw gloo send -> recv, A -> B over the unshaped veth, 4 x 32 MiB, rendezvous on A:
    what plain TCP through gloo carries before any of the transport's work."""
    port = "5997"
    snd = subprocess.Popen(tn.a.exec(PY, "-c", GLOO_PAIR, tn.a.address, port, "0", tn.a.address))
    try:
        out = subprocess.run(tn.b.exec(PY, "-c", GLOO_PAIR, tn.a.address, port, "1", tn.b.address),
                             capture_output=True, text=True, check=True, timeout=120).stdout
        return float(out)
    finally:
        snd.wait(timeout=60)


def transfer_override(a, field: str, default: int) -> int:
    """transfer.<field> as --override sets it for the real runs, else its default."""
    for o in a.override:
        if o.startswith(f"transfer.{field}="):
            return int(o.split("=", 1)[1])
    return default


def print_cpu_per_gb(tn: TwoNodes, a, reps: int = 2) -> None:
    """CPU per GB of raw CURVE and of the zmq transport over the unshaped veth, by thread
    (bench_curve_cpu.py), and the cores each needs at each rate: both nodes share this machine."""
    from bench_curve_cpu import HEAD, line, run_pair
    from testbed.kv_transfer.curve import CurveKeys
    keys_path = str(Path(tempfile.mkdtemp(prefix="bench2n-keys-")) / "keys.json")
    CurveKeys.generate().write(keys_path)
    frame = transfer_override(a, "frame_bytes", 1 << 20)
    sockbuf = transfer_override(a, "socket_buffer_bytes", 0)
    print(f"CPU per GB over the unshaped veth, CURVE, {frame >> 10} KiB frames, socket buffers {sockbuf or 'autotuned'} "
          f"(the transport's), 128 MiB per row (bench_curve_cpu.py); {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}\n{HEAD}", flush=True)
    need: dict[str, list[float]] = {}
    for rep in range(reps):
        for mode in ("raw", "transport"):
            r = run_pair(tn.net, mode, keys_path, 128, frame >> 10, socket_buffer_bytes=sockbuf)
            need.setdefault(mode, []).append(r["ms_per_gb"])
            print(line(mode, rep, r), flush=True)
    for rate in a.rates:
        print(f"at {rate:g} Gb/s ({rate / 8:.3f} GB/s) the CPU alone needs: " + ", ".join(
            f"{mode} {statistics.median(v) / 1e3 * rate / 8:.2f} cores" for mode, v in need.items())
            + f" of {os.cpu_count()} (every other process of the run and the machine shares them)", flush=True)


def workload_args(a) -> list[str]:
    w = {"name": "two_nodes_bench", "num_requests": a.num_requests, "arrival": "constant", "rate": a.arrival_rate,
         "prompt_dist": "fixed", "prompt_len": a.prompt_len, "output_dist": "fixed", "output_len": 4}
    blocks = a.num_requests * (-(-(a.prompt_len + 8) // 16)) + 64
    return [f"workload.{k}={v}" for k, v in w.items()] + [
        "model.num_kv_heads=8", f"num_kv_blocks={blocks}", "scheduler=vllm_v0",
        f"max_num_batched_tokens={a.prompt_len}", f"token_budget={a.prompt_len}",
        "progress=false", "wandb.mode=disabled", "timeout_s=300", "transfer.timeout_s=60",
        f"transfer.transport={a.transport}", *a.override]


DATA_RISE = 4096      # bytes per ~1 ms sample that count as data, not acks or Ray's heartbeats


def read_samples(path: Path) -> list[tuple[float, int, int, int]]:
    """SAMPLER's lines: (time, tx_bytes, busy jiffies, total jiffies)."""
    if not path.exists():
        return []
    return [(float(t), int(b), int(busy), int(total))
            for t, b, busy, total in (line.split() for line in path.read_text().splitlines())]


def bursts(samples: list[tuple[float, int, int, int]], min_bytes: int) -> list[tuple[float, float, int, float]]:
    """(first rise, last rise, bytes, cores busy) of each run of the counter (rises >= DATA_RISE a
    sample, gaps under 20 ms) carrying >= min_bytes; cores busy = the machine's busy CPU time over
    the burst's wall time (os.cpu_count() = all of them busy)."""
    out, cur = [], None
    for s0, s1 in zip(samples, samples[1:]):
        if s1[1] - s0[1] >= DATA_RISE:
            if cur is not None and s0[0] - cur[1][0] < 0.02:
                cur = (cur[0], s1, cur[2] + s1[1] - s0[1])
            else:
                if cur is not None:
                    out.append(cur)
                cur = (s0, s1, s1[1] - s0[1])
    if cur is not None:
        out.append(cur)
    return [(a[0], b[0], n, os.cpu_count() * (b[2] - a[2]) / max(1, b[3] - a[3]))
            for a, b, n in out if n >= min_bytes and b[0] > a[0]]


def wire_rates(samples: list[tuple[float, int, int, int]], min_bytes: int) -> list[float]:
    """Gb/s of each burst carrying >= min_bytes."""
    return [8 * n / (t1 - t0) / 1e9 for t0, t1, n, _ in bursts(samples, min_bytes)]


def rtt_s(tn: TwoNodes) -> float:
    srv = subprocess.Popen(tn.b.exec(PY, "-c", PINGPONG, tn.b.address, "server"), stdout=subprocess.PIPE, text=True)
    try:
        srv.stdout.readline()
        out = subprocess.run(tn.a.exec(PY, "-c", PINGPONG, tn.b.address, "client"), capture_output=True,
                             text=True, check=True, timeout=60).stdout
        return float(out)
    finally:
        srv.kill()
        srv.wait()


def real_run(tn: TwoNodes, a, rate_gbps: float | None, run_dir: Path) -> dict:
    qdisc = tn.net.shape(tn.a, rate_gbps) if rate_gbps else "none"
    samples_path = run_dir / "veth_tx.txt"
    sampler = subprocess.Popen(tn.a.exec(PY, "-c", SAMPLER, f"/sys/class/net/{tn.a.dev}/statistics/tx_bytes",
                                         str(samples_path), str(a.run_timeout_s)))
    try:
        proc = subprocess.run(tn.frontend(PY, "-m", "testbed.cli", "run", "mode=disagg", *workload_args(a),
                                          *tn.run_args(), f"hydra.run.dir={run_dir}"),
                              env={**tn.env, "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True, text=True,
                              timeout=a.run_timeout_s)
    finally:
        sampler.terminate()
        sampler.wait()
        tn.net.unshape(tn.a)
    if proc.returncode != 0:
        raise RuntimeError(f"testbed run failed: {proc.stderr[-3000:]}")
    kv = json.loads((run_dir / "summary.json").read_text())["kv_transfer"]
    samples = read_samples(samples_path)
    per_request = kv["bytes"] / kv["num_transfers"]
    found = bursts(samples, int(per_request * 0.9))
    return {"qdisc": qdisc, "bytes": kv["bytes"], "num": kv["num_transfers"],
            "transfer_gbps": kv["achieved_gb_per_s"] * 8, "exposed_ms": kv["exposed_ms"]["p50"],
            "transfer_ms": kv["transfer_ms"]["p50"], "wire_gbps": wire_rates(samples, int(per_request * 0.9)),
            "cores_busy": [round(c, 2) for *_, c in found]}


def sim_run(a, rate_gbps: float, latency_us: float, per_message_us: float, run_dir: Path) -> dict:
    proc = subprocess.run([PY, "-m", "testbed.cli", "run", "runtime=sim", "mode=disagg", *workload_args(a),
                           f"link.bandwidth_gbps={rate_gbps}", f"link.latency_us={latency_us:.1f}",
                           f"link.per_message_us={per_message_us:.1f}", f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"testbed run runtime=sim failed: {proc.stderr[-3000:]}")
    kv = json.loads((run_dir / "summary.json").read_text())["kv_transfer"]
    return {"exposed_ms": kv["exposed_ms"]["p50"], "bytes": kv["bytes"]}


def host_cost_s(a, reps: int = 5) -> float:
    """The host's serial work around the wire for one request's KV, in this process, median of
    `reps`: the sender's view_kv (views of the blocks: their xxh3 follows the data, chunk by
    chunk, since the checksum trailer) and the receiver's landing + xxh3 of the last 1 MiB
    frame (after its last byte); the frames in between land while the next is on the wire."""
    import torch
    import xxhash
    from testbed.kv_transfer import view_kv
    from testbed.kv_transfer.landing import BlockLanding
    torch.set_num_threads(1)
    blocks = -(-a.prompt_len // 16)
    cache = torch.randn(4, 2, 2 * blocks + 1, 16, 8, 32)     # tiny with num_kv_heads=8: [L, 2, blocks, 16, 8, 32]
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    frame = memoryview(torch.randn(1 << 18).numpy()).cast("B")
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        payload = view_kv(cache, (0, 4), src, dst, a.prompt_len, "r")
        BlockLanding(cache, payload).write(payload.nbytes - len(frame), frame)
        xxhash.xxh3_64(frame).intdigest()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 5.0], help="tbf rates, Gbit/s")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--num-requests", type=int, default=3)
    p.add_argument("--arrival-rate", type=float, default=0.12,
                   help="requests/s: one prefill or transfer at a time (a 4096-token prefill is 3-5 s here)")
    p.add_argument("--transport", choices=["zmq", "torch_dist"], default="zmq",
                   help="transfer.transport of the real runs (torch_dist: gloo, plain TCP)")
    p.add_argument("--ceiling-only", action="store_true",
                   help="only the raw pyzmq and gloo rates and the CPU per GB over the veth")
    p.add_argument("--run-timeout-s", type=float, default=400)
    p.add_argument("--split-cpus", action=argparse.BooleanOptionalAction, default=True,
                   help="each node's processes on CPUs of their own (taskset), as two hosts have; "
                        "--no-split-cpus: anywhere (the runs before 2026-12-02)")
    p.add_argument("--override", nargs="+", default=[],
                   help="more overrides of the real runs, e.g. transfer.frame_bytes=262144")
    a = p.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="bench2n-"))
    t0 = time.monotonic()
    with TwoNodes(split_cpus=a.split_cpus) as tn:
        print(f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        print(f"cluster up in {time.monotonic() - t0:.0f} s; transfer.transport={a.transport}; node CPUs "
              f"{tn.a.cpus or 'any'} / {tn.b.cpus or 'any'}; overrides {a.override}; runs under {out_dir}",
              flush=True)
        rtt = rtt_s(tn)
        latency_us = rtt / 2 * 1e6
        print(f"veth TCP round trip p50 {rtt * 1e6:.0f} us -> link.latency_us={latency_us:.0f}", flush=True)
        for curve in (False, True, False, True):
            print(f"raw pyzmq over the veth, {'CURVE' if curve else 'plain'}: {zmq_ceiling_gbps(tn, curve):.2f} Gb/s",
                  flush=True)
        for _ in range(2):
            print(f"raw gloo over the veth (plain TCP): {gloo_ceiling_gbps(tn):.2f} Gb/s", flush=True)
        print_cpu_per_gb(tn, a)
        if a.ceiling_only:
            return
        host_us = host_cost_s(a) * 1e6
        print(f"host serial work per request (view_kv + the last frame's landing and xxh3, in-process, "
              f"median): {host_us / 1e3:.1f} ms", flush=True)
        ceiling = real_run(tn, a, None, out_dir / "real-unshaped")
        print(f"unshaped: {ceiling}", flush=True)
        rows = [(None, 0, ceiling, None, None, None)]
        for rate, i in [(r, i) for r in a.rates for i in range(a.reps)]:
            real = real_run(tn, a, rate, out_dir / f"real-{rate}-{i}")
            sim = sim_run(a, rate, latency_us, 15.0, out_dir / f"sim-{rate}-{i}")
            sim_host = sim_run(a, rate, latency_us, 15.0 + host_us, out_dir / f"simhost-{rate}-{i}")
            sim_ceil = sim_run(a, min(rate, ceiling["transfer_gbps"]), latency_us, 15.0, out_dir / f"simceil-{rate}-{i}")
            rows.append((rate, i, real, sim, sim_host, sim_ceil))
            print(f"rate {rate} Gb/s rep {i}: {real}  sim {sim}  sim+host {sim_host}  sim@ceiling {sim_ceil}",
                  flush=True)
    print()
    print(f"{'tbf Gb/s':>8} {'rep':>3} {'MiB/req':>8} {'transfer Gb/s':>13} {'vs rate':>7} {'wire Gb/s':>9} "
          f"{'exposed ms':>10} {'sim ms':>7} {'sim err':>7} {'sim+host ms':>11} {'err':>5} {'sim@ceil ms':>11} {'err':>5}"
          f" {'cores busy':>10}")
    for rate, i, real, sim, sim_host, sim_ceil in rows:
        wire = statistics.median(real["wire_gbps"]) if real["wire_gbps"] else float("nan")
        busy = statistics.median(real["cores_busy"]) if real["cores_busy"] else float("nan")
        vs = f"{real['transfer_gbps'] / rate - 1:+.0%}" if rate else "-"

        def err(x):
            return f"{x['exposed_ms'] / real['exposed_ms'] - 1:+.0%}" if x else "-"

        def ms(x):
            return x["exposed_ms"] if x else float("nan")
        print(f"{rate or 'none':>8} {i:>3} {real['bytes'] / real['num'] / 2**20:>8.1f} {real['transfer_gbps']:>13.2f} "
              f"{vs:>7} {wire:>9.2f} {real['exposed_ms']:>10.1f} {ms(sim):>7.1f} {err(sim):>7} {ms(sim_host):>11.1f} "
              f"{err(sim_host):>5} {ms(sim_ceil):>11.1f} {err(sim_ceil):>5} {busy:>10.2f}")
    print(f"\n{time.monotonic() - t0:.0f} s in all (timings on a shared 2-core machine: noisy; the reps are the floor)")
    print(f"# load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
