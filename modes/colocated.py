"""`mode=colocated`: R replicas behind a router; each replica prefills and
decodes its own requests (chunked or not, as its scheduler decides)."""
from __future__ import annotations

from collections import Counter

from testbed.modes.base import ModeController, Send, WorkerInfo
from testbed.request import Request


class ColocatedController(ModeController):
    def __init__(self, workers: list[WorkerInfo], send: Send, router: str = "round_robin"):
        super().__init__(workers, send)
        self.router = router
        self.replicas = sorted(self.workers)
        self.outstanding: Counter[str] = Counter()
        self._next = 0

    def _pick(self) -> str:
        alive = [w for w in self.replicas if w not in self.dead]
        if not alive:
            raise RuntimeError("every replica has died")
        if self.router == "least_outstanding":
            return min(alive, key=lambda w: (self.outstanding[w], w))
        self._next += 1
        return alive[(self._next - 1) % len(alive)]

    def route(self, req: Request, now: float) -> None:
        if self._fail_if_never_fits(req, self.replicas, "replica", now):
            return
        w = self._pick()
        self.outstanding[w] += 1
        self.location[req.request_id] = {w}
        self.send(w, {"type": "add", "request": self.request_msg(req)})

    def _resolve(self, rid, status, error, now):
        for w in self.location.get(rid, ()):
            self.outstanding[w] -= 1
        super()._resolve(rid, status, error, now)
