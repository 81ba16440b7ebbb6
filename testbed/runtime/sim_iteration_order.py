"""IterationOrder: the simulator's iteration records in the order of the
instants the frontend received them, whichever order they were produced in.

A worker the simulator runs ahead (runtime/sim.py, "fast-forward") hands the
controller its iterations' events before the clock gets there, so their
records reach the sink early. This sink in front of the RecordLog holds each
iteration record under the clock when it came and passes it on once the clock
has moved past that instant: iterations.jsonl and the summary's per-iteration
figures come out the same with the fast path on or off. Iterations the
frontend received at the same instant go in worker order, and one worker's in
the order they came. Request records pass straight through (the RecordLog
orders them by arrival).

One worker's records come in the order of their instants (its iterations run
one after another), so each worker's are held in a list of their own, already
sorted: a release takes a prefix of each (bisect) and merges them by one
stable sort of the instants, where a heap of every record would pay a push
and a pop for each of a run's millions of records."""
from __future__ import annotations

from bisect import bisect_left

from testbed.clock import VirtualClock
from testbed.metrics import IterationRecord, RequestRecord
from testbed.record_log import RecordLog


class _Held:
    """One worker's records not yet passed on, and the instants they came at (non-decreasing)."""

    __slots__ = ("times", "records")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.records: list[IterationRecord] = []


class IterationOrder:
    def __init__(self, sink: RecordLog, clock: VirtualClock, worker_ids: list[str]):
        self.sink, self.clock = sink, clock
        # in worker order, so that a release's ties go in worker order
        self.held = {w: _Held() for w in worker_ids}
        self.earliest = float("inf")        # the first instant anything held came at

    def request(self, record: RequestRecord, arrival_index: int) -> None:
        self.sink.request(record, arrival_index)

    def iteration(self, record: IterationRecord) -> None:
        self.iterations([record], [self.clock.t])

    def iterations(self, records: list[IterationRecord], received_s: list[float]) -> None:
        """iteration() of each record, had the clock been at its instant in
        `received_s` (non-decreasing; every record of one worker)."""
        if not records:
            return
        held = self.held[records[0].worker]
        if held.times and received_s[0] < held.times[-1]:
            raise AssertionError(f"IterationOrder: worker {records[0].worker}'s iteration at {received_s[0]} s "
                                 f"came after one at {held.times[-1]} s")
        held.times += received_s
        held.records += records
        if received_s[0] < self.earliest:
            self.earliest = received_s[0]

    def release_before(self, t: float) -> None:
        """Pass on what the frontend received before `t` (nothing can still come before it)."""
        if self.earliest >= t:
            return
        times: list[float] = []
        records: list[IterationRecord] = []
        runs, earliest = 0, float("inf")
        for held in self.held.values():
            held_times = held.times
            if held_times and held_times[0] < t:
                k = bisect_left(held_times, t)
                times += held_times[:k]
                records += held.records[:k]
                del held_times[:k], held.records[:k]
                runs += 1
            if held_times and held_times[0] < earliest:
                earliest = held_times[0]
        self.earliest = earliest
        if runs > 1:
            # a stable sort keeps ties in worker order, and one worker's records in their order
            order = sorted(range(len(times)), key=times.__getitem__)
            records, times = list(map(records.__getitem__, order)), list(map(times.__getitem__, order))
        self.sink.extend_iterations(records, times)

    def release_all(self) -> None:
        self.release_before(float("inf"))
