"""What the simulator's modeled nodes (the KV link, runtime/sim_kv_port.py; the
KV store, runtime/sim_store.py) need of the simulated runtime (runtime/sim.py):
its clock, its heap, and the two ways an event reaches a worker. A Protocol,
so neither imports sim.py (which imports them)."""
from __future__ import annotations

from typing import Any, Callable, Protocol

from testbed.runtime.kv_port import KVArrival


class EventLoop(Protocol):
    clock: Any

    def at(self, t: float, action: Callable[[Any], None], arg: Any = None) -> None: ...

    def deliver_kv(self, arg: tuple[str, KVArrival]) -> None:
        """KV landing at a worker: arg = (the worker, what arrived)."""

    def wake(self, worker_id: str) -> None:
        """Something outside the worker's commands gave it work (a store fetch arrived)."""
