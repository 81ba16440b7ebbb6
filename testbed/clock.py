"""Clocks: which time an engine, a scheduler and the frontend read.

`WallClock` is seconds since `t0` on the machine's monotonic clock. Every
process of one machine shares CLOCK_MONOTONIC, so a worker started with the
frontend's `t0` stamps its iterations on the frontend's time line. What the
metrics count (arrival, every token, a request's end) is stamped by the
frontend as the events arrive, on its own clock, so TTFT and TBT stay
comparable whatever host a worker runs on. Worker-stamped times (iteration
starts, `Prefilled.t`, `KVReceived.t`) are compared only with times of the
same worker, or, across workers, where both share a host; a launcher that
places workers on other machines must hand them a `t0` shifted by the
offset it measures between the two clocks (a round trip at start-up, as NTP
does) for those to line up.

`VirtualClock` is the simulator's: set by the event loop, advanced by modeled
durations."""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    virtual: bool

    def now(self) -> float: ...


class WallClock:
    virtual = False

    def __init__(self, t0: float | None = None):
        self.t0 = time.monotonic() if t0 is None else t0

    def now(self) -> float:
        return time.monotonic() - self.t0


class VirtualClock:
    virtual = True

    def __init__(self, t: float = 0.0):
        self.t = t

    def now(self) -> float:
        return self.t
