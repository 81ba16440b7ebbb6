"""StepWatch (testbed/runtime/step_watch.py) with a real thread: a step that
computes is announced every interval, a step that waits without computing and
the time between steps are not, and close() ends the thread."""
from __future__ import annotations

import threading
import time

import pytest

from testbed.runtime.step_watch import StepWatch

INTERVAL = 0.05


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def test_a_computing_step_is_announced_each_interval_with_its_age():
    sent = []
    watch = StepWatch(sent.append, INTERVAL)
    try:
        with watch.step():
            spin(0.5)
        after_step = len(sent)
        time.sleep(0.3)                  # between steps: nothing
    finally:
        watch.close()
    assert after_step >= 4, sent
    assert len(sent) == after_step, "the watch spoke between steps"
    assert sent == sorted(sent) and 0 < sent[0] < sent[-1] <= 0.5 + INTERVAL, sent


def test_a_step_that_waits_without_computing_is_not_announced():
    sent = []
    watch = StepWatch(sent.append, INTERVAL)
    try:
        with watch.step():
            threading.Event().wait(0.5)   # blocked, as in a receive that never returns
    finally:
        watch.close()
    assert sent == []


def test_close_ends_the_thread_and_a_bad_interval_names_the_field():
    watch = StepWatch(lambda s: None, INTERVAL)
    watch.close()
    assert not watch._thread.is_alive()
    with pytest.raises(ValueError, match=r"runtime.heartbeat_s: must be > 0"):
        StepWatch(lambda s: None, 0)
