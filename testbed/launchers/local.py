"""`launcher=local`: every worker is a process on this host (multiprocessing,
spawn: each starts a fresh interpreter, so no torch state is inherited)."""
from __future__ import annotations

import multiprocessing as mp
import time

from testbed.interrupts import deferred
from testbed.launchers.base import Launcher, ReportedError, WorkerSpec


def run_entry(spec: WorkerSpec) -> None:
    """The child's body: import the spec's entry and run it."""
    import importlib
    module, function = spec.entry.split(":")
    getattr(importlib.import_module(module), function)(spec)


def process_main(spec: WorkerSpec) -> None:
    """A local process's body: its entry, and exit code 1 for a failure the
    frontend already heard (multiprocessing would print its traceback again
    beside the frontend's one-line error). Any other exception keeps its traceback."""
    try:
        run_entry(spec)
    except ReportedError:
        raise SystemExit(1) from None


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, cfg=None) -> None:
        self._mp = mp.get_context("spawn")
        self._procs: dict[str, mp.Process] = {}

    def start(self, spec: WorkerSpec) -> None:
        p = self._mp.Process(target=process_main, args=(spec,), name=spec.worker_id, daemon=True)
        with deferred():        # born ignoring SIGINT/SIGTERM: the frontend stops its workers itself
            p.start()
        self._procs[spec.worker_id] = p

    def alive(self, worker_id: str) -> bool:
        p = self._procs.get(worker_id)
        return p is not None and p.is_alive()

    def exit_code(self, worker_id: str) -> int | None:
        return self._procs[worker_id].exitcode

    def pid(self, worker_id: str) -> int | None:
        return self._procs[worker_id].pid

    def kill(self, worker_id: str) -> None:
        p = self._procs[worker_id]
        p.kill()
        p.join(5)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self._procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
