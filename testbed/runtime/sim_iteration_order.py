"""IterationOrder: the simulator's iteration records in the order of the
instants the frontend received them, whichever order they were produced in.

A worker the simulator runs ahead (runtime/sim.py, "fast-forward") hands the
controller its iterations' events before the clock gets there, so their
records reach the sink early. This sink in front of the RecordLog holds each
iteration record under (the clock when it came, its worker's place, a count)
and passes it on once the clock has moved past that instant: iterations.jsonl
and the summary's per-iteration figures come out the same with the fast path
on or off. Iterations the frontend received at the same instant go in worker
order. Request records pass straight through (the RecordLog orders them by
arrival)."""
from __future__ import annotations

import heapq
import itertools

from testbed.clock import VirtualClock
from testbed.metrics import IterationRecord, RequestRecord
from testbed.record_log import RecordLog


class IterationOrder:
    def __init__(self, sink: RecordLog, clock: VirtualClock, worker_ids: list[str]):
        self.sink, self.clock = sink, clock
        self.place = {w: i for i, w in enumerate(worker_ids)}
        self.held: list[tuple[float, int, int, IterationRecord]] = []
        self._count = itertools.count()

    def request(self, record: RequestRecord, arrival_index: int) -> None:
        self.sink.request(record, arrival_index)

    def iteration(self, record: IterationRecord) -> None:
        heapq.heappush(self.held, (self.clock.t, self.place[record.worker], next(self._count), record))

    def iterations(self, records: list[IterationRecord], received_s: list[float]) -> None:
        """iteration() of each record, had the clock been at its instant in `received_s`."""
        held, push, count, place = self.held, heapq.heappush, self._count, self.place
        for record, t in zip(records, received_s):
            push(held, (t, place[record.worker], next(count), record))

    def release_before(self, t: float) -> None:
        """Pass on what the frontend received before `t` (nothing can still come before it)."""
        held, pop = self.held, heapq.heappop
        if held and held[0][0] < t:
            out = []
            while held and held[0][0] < t:
                out.append(pop(held)[3])
            self.sink.extend_iterations(out)

    def release_all(self) -> None:
        self.release_before(float("inf"))
