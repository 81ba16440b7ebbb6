"""What adaptive's TTFT rollout expects of the traffic it cannot see yet: the
arrival rate (prompts per second) and the duration of a typical iteration,
both estimated online over the last `window` arrivals and steps. No
workload constant: the rate is the count of the window's arrivals over the
time they span up to now (so it decays when arrivals stop), the typical
iteration the mean of the window's measured steps."""
from __future__ import annotations

from collections import deque


class Traffic:
    def __init__(self, window: int):
        self._arrivals: deque[float] = deque(maxlen=window)
        self._steps: deque[float] = deque(maxlen=window)
        self._steps_sum_s = 0.0

    def observe_arrival(self, now_s: float) -> None:
        self._arrivals.append(now_s)

    def observe_step(self, duration_s: float) -> None:
        if len(self._steps) == self._steps.maxlen:
            self._steps_sum_s -= self._steps[0]
        self._steps.append(duration_s)
        self._steps_sum_s += duration_s

    def rate_per_s(self, now_s: float) -> float:
        """Arrivals per second: the window's arrivals after its first, over the time since it (0 before two)."""
        a = self._arrivals
        span = now_s - a[0] if a else 0.0
        return (len(a) - 1) / span if len(a) > 1 and span > 0 else 0.0

    def typical_step_s(self) -> float:
        """The mean measured iteration of the window (0 before the first)."""
        return self._steps_sum_s / len(self._steps) if self._steps else 0.0
