"""`mode=hybrid`: a colocated pool (`hybrid.colocated_replicas` replicas,
routed by `router=`) beside P/D pools (`prefill_workers`, `decode_workers`,
with mode=disagg's hand-off, modes/disagg.py), behind one hybrid router
(`hybrid.router`, modes/hybrid_router.py) that sends a prompt shorter than
`hybrid.threshold` to colocation and a longer one to disaggregation.

Short prompts cost colocation little chunk re-read and would pay the
transfer's fixed costs for nothing; long ones would stall a colocated
replica's decodes for many chunks. The threshold is where the decision study
measured the two to cross (`hybrid.threshold=auto`, modes/hybrid_threshold.py)."""
from __future__ import annotations

from testbed.modes.base import Send, WorkerInfo
from testbed.modes.colocated import ReplicaRouting
from testbed.modes.disagg import DisaggController
from testbed.modes.hybrid_router import HybridRouter
from testbed.modes.pool import PoolState
from testbed.modes.routers import Router
from testbed.request import Request


class HybridController(ReplicaRouting, DisaggController):
    def __init__(self, colocated: list[WorkerInfo], prefill: list[WorkerInfo], decode: list[WorkerInfo],
                 send: Send, hybrid_router: HybridRouter, router: Router, prefill_router: Router,
                 decode_router: Router, copy_prompts: bool = True):
        DisaggController.__init__(self, prefill, decode, send, prefill_router, decode_router, copy_prompts)
        if not colocated:
            raise ValueError("mode=hybrid needs hybrid.colocated_replicas >= 1")
        self.workers.update({w.worker_id: w for w in colocated})
        self.pool = PoolState({w.worker_id: w.num_blocks for w in self.workers.values()})
        self.replicas = sorted(w.worker_id for w in colocated)
        self.replica_set = set(self.replicas)
        self.hybrid_router, self.router = hybrid_router, router

    def apart_from(self, worker_id: str) -> frozenset[str] | None:
        return None          # its colocated replicas beside the P/D pools: not shown apart

    def route(self, req: Request, now: float) -> None:
        # with every colocated replica dead, the P/D pools serve short prompts too
        if self.hybrid_router.disaggregates(req, self.pool) or not self.alive(self.replicas):
            DisaggController.route(self, req, now)
        else:
            self._to_replica(req, self.router, now)
