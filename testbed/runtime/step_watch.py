"""StepWatch: a real worker's proof of life while it is inside one long step.

The frontend kills a worker that sends nothing for runtime.hang_timeout_s
(runtime/real.py). Between steps a worker answers every Ping; inside a step
it reads no command, so a step longer than the timeout (a 40K-token whole
prefill on this CPU takes ~100 s) used to get a healthy worker killed.

While the worker's main thread is inside a step, this thread wakes every
runtime.heartbeat_s and sends `Busy` when the process used CPU since it last
looked: a step that computes keeps its worker alive however long it is. A
worker that is stopped (SIGSTOP: this thread stops too) or blocked without
computing (a receive that never returns) sends nothing and is still found
hung within the timeout. On a GPU a busy-waiting synchronize counts as CPU,
so a kernel that never ends is not seen; that is the device's own watchdog's
to find.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# CPU seconds per heartbeat below which a step counts as not computing: the
# watch's own wake-ups and ZMQ's I/O thread stay well below it
MIN_CPU_SHARE = 0.05


class StepWatch:
    """`with watch.step():` around each step; `send(step_s)` is called from
    the watch's thread (the caller makes it safe against the main thread's sends)."""

    def __init__(self, send: Callable[[float], None], interval_s: float,
                 cpu_s: Callable[[], float] = time.process_time):
        if interval_s <= 0:
            raise ValueError(f"runtime.heartbeat_s: must be > 0, got {interval_s}")
        self._send, self._interval_s, self._cpu_s = send, interval_s, cpu_s
        self._lock = threading.Lock()
        self._started_at: float | None = None      # time.monotonic() of the step in progress
        self._cpu_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def step(self) -> Iterator[None]:
        cpu = self._cpu_s()
        with self._lock:
            self._started_at, self._cpu_at = time.monotonic(), cpu
        try:
            yield
        finally:
            with self._lock:
                self._started_at = None

    def _watch(self) -> None:
        min_cpu = MIN_CPU_SHARE * self._interval_s
        while not self._stop.wait(self._interval_s):
            cpu = self._cpu_s()
            with self._lock:
                started_at = self._started_at
                computing = started_at is not None and cpu - self._cpu_at >= min_cpu
                self._cpu_at = cpu
            if computing:
                self._send(time.monotonic() - started_at)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

