"""Several "hosts" on one machine: network namespaces joined by veth pairs,
for the two-node tests and benchmark (tests/test_two_nodes.py,
experiments/benchmarks/bench_two_nodes.py).

A star without a bridge: node 0 (the hub) is joined to each other node k by a
veth pair on its own private /24 (10.231.k.0/24: the hub is .1, node k is .2);
the hub forwards between spokes. With `split_cpus` each node also gets CPUs of
its own (`taskset` on whatever `Node.exec` starts), as separate hosts have:
otherwise the scheduler may run one node's sender and the other's receiver
on one core (a waker pulls its wakee to its own CPU), and a pair of I/O
threads that would run side by side takes turns on it. `shape` puts the kernel's token bucket
(`tc qdisc ... root tbf`) on one direction of a link: the sending side's
veth. Names carry this process's pid (and a random part), so two runs never collide, and
`close` (also run at exit, and on SIGTERM, which then exits with 143) kills
whatever still runs inside the namespaces (`ip netns pids`) before deleting
them: a veth pair dies with its namespace.
Needs root and iproute2."""
from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

SUBNET = "10.231"            # 10.231.k.0/24 per link; NetnsNodes refuses it if the host already uses it


class NetnsError(RuntimeError):
    pass


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can): for a test's skip."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns` does not work here: {r.stderr.strip()}"
    return None


def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


@dataclass(frozen=True)
class Node:
    netns: str               # the namespace's name
    address: str             # its address on the link to the hub (the hub's: on the link to node 1)
    dev: str                 # that link's veth inside this namespace
    cpus: str = ""           # the CPUs its processes run on, as taskset -c takes them ("": any)

    def exec(self, *cmd: str) -> list[str]:
        """`cmd` as run inside this node's namespace (and on its CPUs)."""
        pin = ["taskset", "-c", self.cpus] if self.cpus else []
        return ["ip", "netns", "exec", self.netns, *pin, *cmd]


@dataclass(frozen=True)
class Link:
    """One veth pair: hub side and spoke side."""
    hub: Node
    spoke: Node


class NetnsNodes:
    """`n` namespaces (n >= 2) in a star around node 0. Use as a context manager.
    `mtu`: 9000 by default, a datacenter's jumbo frame (1500 moves ~6 Gb/s over a
    veth here, 9000 ~7, from one Python socket)."""

    def __init__(self, n: int = 2, prefix: str = "tb", mtu: int = 9000, split_cpus: bool = False) -> None:
        if n < 2:
            raise ValueError(f"NetnsNodes: n must be >= 2, got {n}")
        why = netns_unavailable()
        if why:
            raise NetnsError(why)
        used = _ip("-4", "addr") + _ip("-4", "route")
        if f" {SUBNET}." in used:
            raise NetnsError(f"the host already uses {SUBNET}.0.0/16; NetnsNodes needs it free")
        # the pid, and a random part for several instances in one process; devices <= 15 characters
        tag = f"{prefix}{os.getpid()}{secrets.token_hex(2)[:3]}"
        cpus = cpu_sets(n) if split_cpus else [""] * n
        self.names = [f"{tag}n{i}" for i in range(n)]
        self.links: list[Link] = []
        self._closed = False
        atexit.register(self.close)
        self._on_sigterm = _exit_on_sigterm()
        try:
            for name in self.names:
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            hub = self.names[0]
            for k, name in enumerate(self.names[1:], start=1):
                hub_dev, spoke_dev = f"{tag}h{k}", f"{tag}s{k}"
                _ip("link", "add", hub_dev, "netns", hub, "type", "veth", "peer", "name", spoke_dev, "netns", name)
                _ip("-n", hub, "addr", "add", f"{SUBNET}.{k}.1/24", "dev", hub_dev)
                _ip("-n", name, "addr", "add", f"{SUBNET}.{k}.2/24", "dev", spoke_dev)
                _ip("-n", hub, "link", "set", hub_dev, "mtu", str(mtu), "up")
                _ip("-n", name, "link", "set", spoke_dev, "mtu", str(mtu), "up")
                _ip("-n", name, "route", "add", f"{SUBNET}.0.0/16", "via", f"{SUBNET}.{k}.1")
                self.links.append(Link(Node(hub, f"{SUBNET}.{k}.1", hub_dev, cpus[0]),
                                       Node(name, f"{SUBNET}.{k}.2", spoke_dev, cpus[k])))
            if n > 2:
                subprocess.run(Node(hub, "", "").exec("sysctl", "-qw", "net.ipv4.ip_forward=1"), check=True)
        except BaseException:
            self.close()
            raise
        self.nodes = [self.links[0].hub, *(link.spoke for link in self.links)]

    def __enter__(self) -> "NetnsNodes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the link -------------------------------------------------------------------------
    def shape(self, sender: Node, rate_gbps: float, burst_bytes: int | None = None, latency_ms: float = 50.0) -> str:
        """Shape what `sender` sends on its veth to the tbf's rate. burst must cover one
        kernel tick at the rate (rate/HZ) and one GSO packet (64 KiB), or the rate is missed;
        the default is twice a 250 Hz tick's worth. Returns the qdisc as `tc` shows it."""
        rate_bytes = rate_gbps * 1e9 / 8
        burst = burst_bytes or max(2 * int(rate_bytes / 250), 128 * 1024)
        subprocess.run(sender.exec("tc", "qdisc", "replace", "dev", sender.dev, "root", "tbf",
                                   "rate", f"{rate_gbps * 1000:g}mbit", "burst", str(burst),
                                   "latency", f"{latency_ms:g}ms"), check=True, capture_output=True)
        return subprocess.run(sender.exec("tc", "qdisc", "show", "dev", sender.dev), check=True,
                              capture_output=True, text=True).stdout.strip()

    def unshape(self, sender: Node) -> None:
        subprocess.run(sender.exec("tc", "qdisc", "del", "dev", sender.dev, "root"), capture_output=True)

    def tx_bytes(self, node: Node) -> int:
        """Bytes `node` has sent on its veth (the kernel's counter)."""
        out = subprocess.run(node.exec("cat", f"/sys/class/net/{node.dev}/statistics/tx_bytes"), check=True,
                             capture_output=True, text=True).stdout
        return int(out)

    # -- clean-up -------------------------------------------------------------------------
    def pids(self, names: list[str] | None = None) -> list[int]:
        """Every process still inside one of these namespaces (or of `names`)."""
        return [pid for name in names or self.names for pid in namespace_pids(name)]

    def kill(self, node: Node) -> list[int]:
        """SIGKILL every process inside `node`'s namespace (the host dies); returns their pids."""
        return kill_namespace(node.netns)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + 10
        while (left := self.pids()) and time.monotonic() < deadline:
            sigkill(left)
            time.sleep(0.1)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        atexit.unregister(self.close)
        if self._on_sigterm is not None and signal.getsignal(signal.SIGTERM) is self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _exit_on_sigterm():
    """Make SIGTERM (a kill, a timeout's) raise SystemExit in the main thread, so that
    context exits and atexit run `close` as on any other exit (Python's default
    SIGTERM ends the process at once: namespaces, veths and Ray would be left).
    Returns the handler, or None where one is set already or this is not the main thread."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
    return handler


def cpu_sets(n: int) -> list[str]:
    """This process's CPUs cut into n contiguous sets, one per node (taskset lists); with
    fewer CPUs than nodes, node i gets CPU i modulo their count."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < n:
        return [str(mine[i % len(mine)]) for i in range(n)]
    bounds = [len(mine) * i // n for i in range(n + 1)]
    return [",".join(map(str, mine[bounds[i]:bounds[i + 1]])) for i in range(n)]


def namespace_pids(netns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def kill_namespace(netns: str) -> list[int]:
    """The host dies: SIGKILL every process inside `netns`; returns their pids."""
    pids = namespace_pids(netns)
    sigkill(pids)
    return pids


def sigkill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
