"""Arrivals: the simulator's workload, pulled in arrival order as the clock
reaches each request (a 1M-request workload is never in memory at once), a
few of them ahead of the clock where the controller can say which worker
each will go to.

In colocated mode only an arrival reaches a replica, so the simulator runs a
replica ahead (runtime/sim.py, _run_ahead) up to the next arrival that can
reach it. Behind a router whose picks depend on neither the request nor the
pool (round_robin: Router.planned) the controller plans where the next
arrivals go (PlansArrivals, testbed/runtime/sim_fast_forward.py), and a
replica runs on past the arrivals planned for the others: they change
nothing it reads. The arrivals themselves, their routing and the other
replicas' events still happen in time order."""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from testbed.modes.base import ModeController
from testbed.runtime.sim_fast_forward import PlansArrivals
from testbed.request import Request

LOOKAHEAD_PER_WORKER = 4  # arrivals pulled ahead of the clock to plan, per worker


class Arrivals:
    def __init__(self, requests: Iterable[Request], controller: ModeController, num_workers: int):
        """`requests`: a list (sorted here), or an iterator already in arrival order."""
        self._source = iter(sorted(requests, key=lambda r: r.arrival_s)) if isinstance(requests, list) else \
            _in_arrival_order(requests)
        self._planned_targets = controller.planned_targets if isinstance(controller, PlansArrivals) else None
        self._cap = LOOKAHEAD_PER_WORKER * num_workers
        self._after: deque[Request] = deque()        # pulled after `next`
        self._plan: tuple[dict[str, float], float] | None = None     # planned_s's, until the next pop
        self.next: Request | None = next(self._source, None)
        self.next_s = float("inf") if self.next is None else self.next.arrival_s

    def pop(self) -> Request:
        """The next arrival, which the caller hands to the controller now."""
        req = self.next
        self.next = self._after.popleft() if self._after else next(self._source, None)
        self.next_s = float("inf") if self.next is None else self.next.arrival_s
        self._plan = None
        return req

    def planned_s(self, worker_id: str) -> float:
        """The instant of the first arrival the controller will send to the
        worker, from its plan of the next few; the next arrival's where it
        cannot say, and the last planned one's where none of those goes to
        the worker."""
        if self._planned_targets is None:
            return self.next_s
        if self._plan is None:
            upcoming = self._lookahead()
            first: dict[str, float] = {}
            planned = 0
            for target in self._planned_targets(upcoming):
                if target and target not in first:
                    first[target] = upcoming[planned].arrival_s
                planned += 1
            if planned < len(upcoming):      # the controller cannot say where this one goes
                rest = upcoming[planned].arrival_s
            elif len(upcoming) < self._cap:  # none is left after these
                rest = float("inf")
            else:                            # those after the last looked at may go anywhere
                rest = upcoming[-1].arrival_s
            self._plan = first, rest
        first, rest = self._plan
        return first.get(worker_id, rest)

    def _lookahead(self) -> list[Request]:
        """The next `_cap` arrivals (fewer where the workload ends), pulled ahead of the clock as needed."""
        if self.next is None:
            return []
        after, n = self._after, self._cap - 1
        while len(after) < n:
            req = next(self._source, None)
            if req is None:
                break
            after.append(req)
        return [self.next, *itertools.islice(after, n)]


def _in_arrival_order(requests: Iterable[Request]) -> Iterator[Request]:
    last = -float("inf")
    for r in requests:
        if r.arrival_s < last:
            raise ValueError(f"request {r.request_id} arrives at {r.arrival_s} s, before the one yielded before it "
                             f"({last} s): a lazy workload must come in arrival order (or pass a list)")
        last = r.arrival_s
        yield r
