"""A private network namespace for this process: only a loopback device, no
route anywhere. `launcher=ray` with no `ray.address` moves the run into one
before any socket exists, because Ray (2.60) binds its GCS and raylet on every
interface and rewrites a loopback node address to the machine's external
one: inside a namespace whose only interface is loopback, "every interface" is
loopback. Linux namespaces belong to threads: the calling thread moves, and
every thread and process it starts afterwards (ZMQ's I/O threads, Ray's
processes, the workers) is born inside. Needs CAP_SYS_ADMIN (root)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading

CLONE_NEWNET = 0x40000000


class NetnsError(RuntimeError):
    pass


def enter_private_netns() -> None:
    if threading.current_thread() is not threading.main_thread():
        raise NetnsError("a private network namespace must be entered from the main thread")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} (needs root; or set ray.private_netns=false "
                         f"and accept Ray listening on every interface, or give ray.address)")
    r = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"ip link set lo up (in the private namespace) failed: {r.stderr.strip()}")
