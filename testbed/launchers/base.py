"""Launcher: starts worker processes from plain specs, reports whether they
live, and kills them. The real runtime's event loop talks to a launcher, never
to a process object, so where a worker runs (a local process, a Ray actor on
another node) is the launcher's business alone."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class ReportedError(Exception):
    """An entry's failure that already reached the frontend as a WorkerError,
    its traceback included: the frontend says what went wrong, so the process
    ends with exit code 1 without printing it a second time."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to start; plain values only."""
    worker_id: str
    role: str                  # a name in modes.registry.ROLES
    needs_kv_port: bool
    rank: int
    world_size: int
    cmd_addr: str              # the frontend's ROUTER (commands)
    event_addr: str            # the frontend's event ROUTER
    t0: float                  # the frontend's clock origin (testbed/clock.py)
    dist_addr: str | None      # torch.distributed rendezvous, when the transport uses it
    cfg: dict                  # the resolved RunConfig as plain values
    store_addr: str | None = None    # mode=kvstore: where the KV store serves
    # "module:function" the process runs with this spec: a worker, or a service (the KV store)
    entry: str = "testbed.runtime.worker_process:worker_main"
    curve: dict | None = None  # the run's CURVE keys (kv_transfer/curve.py); None on loopback


class Launcher(ABC):
    name: str

    @abstractmethod
    def start(self, spec: WorkerSpec) -> None:
        """Start one worker; returns at once (readiness comes as its Ready event)."""

    @abstractmethod
    def alive(self, worker_id: str) -> bool:
        ...

    @abstractmethod
    def exit_code(self, worker_id: str) -> int | None:
        """The exit status of a worker that is gone; None while it lives."""

    @abstractmethod
    def kill(self, worker_id: str) -> None:
        """Kill a worker for real now (faults, stragglers at shutdown)."""

    def pid(self, worker_id: str) -> int | None:
        """The worker's process id where it runs on this host (tests read its sockets)."""
        return None

    def prepare(self, specs: list[WorkerSpec]) -> None:
        """Called once with every worker's spec before the first start (placement)."""

    def kv_address(self, worker_id: str, announced: str) -> str:
        """The worker's KV receiver address: as its Ready event announced it, unless
        the launcher has its own channel for endpoints (Ray returns them)."""
        return announced

    @abstractmethod
    def join(self, timeout_s: float) -> None:
        """Wait up to timeout_s in all for the workers to exit; kill those left."""
