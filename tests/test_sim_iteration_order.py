"""IterationOrder (testbed/runtime/sim_iteration_order.py): the records a
run-ahead worker hands over early come out in the order of the instants the
frontend received them, ties in worker order."""
import pytest

from testbed.clock import VirtualClock
from testbed.metrics import IterationRecord
from testbed.record_log import RecordLog
from testbed.run_stats import RunStats
from testbed.runtime.sim_iteration_order import IterationOrder


def _record(worker: str, start_s: float) -> IterationRecord:
    return IterationRecord(start_s, 0.5, 0, 1, 0, worker)


def _order():
    log, clock = RecordLog(RunStats(None, None)), VirtualClock()
    return IterationOrder(log, clock, ["w0", "w1", "w2"]), log, clock


def _released(log: RecordLog) -> list[tuple[str, float]]:
    log.close()
    return [(r.worker, r.start_s) for r in log.iterations()]


def test_runs_handed_over_early_are_merged_by_instant_with_ties_in_worker_order():
    order, log, clock = _order()
    # w2 ran ahead to 5 s, w0 to 4 s; both handed over before the clock got there
    order.iterations([_record("w2", t) for t in (1, 2, 3, 5)], [1.0, 2.0, 3.0, 5.0])
    order.iterations([_record("w0", t) for t in (2, 4)], [2.0, 4.0])
    clock.t = 3.0
    order.iteration(_record("w1", 3))            # received now, at 3 s
    order.release_before(3.0)                    # only what came before 3 s
    clock.t = 6.0
    order.release_before(6.0)
    order.iteration(_record("w1", 6))            # at 6 s: held until a later release
    order.release_all()
    assert _released(log) == [("w2", 1), ("w0", 2), ("w2", 2),    # 2 s: w0 before w2
                              ("w1", 3), ("w2", 3),                # 3 s: w1 before w2
                              ("w0", 4), ("w2", 5), ("w1", 6)]


def test_nothing_passes_before_its_instant():
    order, log, clock = _order()
    order.iterations([_record("w0", 1), _record("w0", 2)], [1.0, 2.0])
    order.release_before(2.0)
    order.release_before(1.5)                     # a later call for an earlier instant passes nothing
    assert _released(log) == [("w0", 1)]


def test_a_worker_whose_records_go_back_in_time_is_refused():
    order, _, _ = _order()
    order.iterations([_record("w0", 2)], [2.0])
    with pytest.raises(AssertionError, match="w0"):
        order.iterations([_record("w0", 1)], [1.0])
