"""`mode=colocated`: R replicas behind a router (`router=`); each replica
prefills and decodes its own requests (chunked or not, as its scheduler
decides). `ReplicaRouting` is that routing, shared with mode=hybrid's
colocated pool (modes/hybrid.py)."""
from __future__ import annotations

from collections.abc import Iterator

from testbed.modes.base import ModeController, Send, WorkerInfo
from testbed.modes.routers import Router
from testbed.request import Request
from testbed.runtime.messages import Add


class ReplicaRouting(ModeController):
    """Requests to a pool of replicas that each serve a request alone,
    counted as outstanding on it until resolved."""
    replicas: list[str]
    replica_set: set[str]

    def _to_replica(self, req: Request, router: Router, now: float) -> None:
        if self._fail_if_never_fits(req, self.replicas, "replica", now):
            return
        alive = self.alive(self.replicas)
        if not alive:
            raise RuntimeError("every replica has died")
        w = router.pick(req, alive, self.pool)
        self.pool.add_outstanding(w, 1)
        self.location[req.request_id] = {w}
        self.send(w, Add(self.request_msg(req)))

    def _resolve(self, rid, status, error, now):
        for w in self.location.get(rid, ()):
            if w in self.replica_set:
                self.pool.add_outstanding(w, -1)
        super()._resolve(rid, status, error, now)


class ColocatedController(ReplicaRouting):
    commands_on_events = False      # it sends only Add, on arrival
    def __init__(self, workers: list[WorkerInfo], send: Send, router: Router, copy_prompts: bool = True):
        super().__init__(workers, send, copy_prompts)
        self.router = router
        self.replicas = sorted(self.workers)
        self.replica_set = set(self.replicas)

    def route(self, req: Request, now: float) -> None:
        self._to_replica(req, self.router, now)

    def planned_targets(self, upcoming: list[Request]) -> Iterator[str]:
        # runtime=sim's PlansArrivals (testbed/runtime/sim_fast_forward.py):
        # on_arrival's and _to_replica's steps, without their effects
        alive, picks = self.alive(self.replicas), 0
        for req in upcoming:
            if self._past_context(req) is not None or self._never_fits(req, self.replicas, "replica") is not None:
                yield ""
                continue
            target = self.router.planned(alive, picks)
            if target is None:
                return
            yield target
            picks += 1
