"""The steady-state rule of a capacity probe (testbed/capacity.py, the
`decision` study): a probe says something about a rate only when its arrivals
span many times the longest request's service time, and only the requests
that arrived once the system had filled up and before arrivals stopped are
judged.

With S the longest service time of the probe's finished requests (first
scheduled to finished; queueing excluded, so an overloaded probe is not
mistaken for a long one; taken as the p99, `service_quantile`, so that one
outlier, whose size grows with the number of requests, does not move the
target further away every time a probe is lengthened), the judged window is the arrivals in
[first + S, last - S]: a request arriving before first + S shares the
machine with fewer requests than in steady state (warm-up), one arriving
after last - S finishes while arrivals have stopped (drain). The probe is
steady when the arrival span is at least `span_factor` x S and the window
holds at least `min_judged` requests; otherwise it is flagged, and its
verdict does not count.

`num_requests(rate, service_s)` sizes a probe so that it will be steady:
enough Poisson arrivals at `rate` to span span_factor x service_s."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from testbed.metrics import RequestRecord


@dataclass(frozen=True)
class SteadyRule:
    span_factor: float = 10.0        # arrivals span at least this many longest service times
    min_judged: int = 20             # requests in the judged window at least
    max_requests: int = 4000         # a probe never gets more requests than this
    service_quantile: float = 0.99   # of the finished requests' service times: "the longest"

    def __post_init__(self) -> None:
        if not self.span_factor > 2:
            raise ValueError(f"span_factor: must be > 2 (warm-up and drain each take one service time), "
                             f"got {self.span_factor}")
        if self.min_judged < 1:
            raise ValueError(f"min_judged: must be >= 1, got {self.min_judged}")
        if not 0 < self.service_quantile <= 1:
            raise ValueError(f"service_quantile: a fraction in (0, 1], got {self.service_quantile}")
        if self.max_requests < self.min_judged:
            raise ValueError(f"max_requests: {self.max_requests} is below min_judged={self.min_judged}")

    def num_requests(self, rate: float, service_s: float, max_requests: int | None = None,
                     min_judged: int = 0) -> int:
        """Requests a probe at `rate` (req/s) needs for its arrivals to span
        span_factor x service_s with min_judged of them (the rule's, or more
        where given) in the window (10% margin for the Poisson process's
        spread), capped at max_requests (the rule's unless given)."""
        service_s = max(service_s, 1e-6)
        span_s = self.span_factor * service_s
        window_s = span_s - 2 * service_s
        judged = max(self.min_judged, min_judged)
        n = max(math.ceil(1.1 * rate * span_s), math.ceil(judged * span_s / window_s * 1.1) + 2)
        return min(n, self.max_requests if max_requests is None else max_requests)

    def window(self, records: Sequence[RequestRecord]) -> Window:
        return judged_window(records, self)


@dataclass
class Window:
    judged: list[RequestRecord]      # arrived in [first + S, last - S]
    steady: bool
    reason: str                      # why not steady, or "ok"
    span_s: float                    # last arrival - first arrival
    service_s: float                 # S: the longest (service_quantile) service time of finished requests


def service_time_s(record: RequestRecord) -> float | None:
    """First scheduled to finished (None while unfinished)."""
    if record.finish_s is None or record.first_scheduled_s is None:
        return None
    return record.finish_s - record.first_scheduled_s


def judged_window(records: Sequence[RequestRecord], rule: SteadyRule) -> Window:
    if not records:
        return Window([], False, "no requests", 0.0, 0.0)
    arrivals = [r.arrival_s for r in records]
    first, last = min(arrivals), max(arrivals)
    span = last - first
    services = [s for s in map(service_time_s, records) if s is not None]
    service = float(np.quantile(services, rule.service_quantile)) if services else 0.0
    judged = [r for r in records if first + service <= r.arrival_s <= last - service]
    if not services:
        return Window(judged, False, "no request finished", span, service)
    if span < rule.span_factor * service:
        return Window(judged, False, f"arrivals span {span:.3g} s < {rule.span_factor:g} x the longest service "
                                     f"time {service:.3g} s", span, service)
    if len(judged) < rule.min_judged:
        return Window(judged, False, f"{len(judged)} requests in the judged window < min_judged="
                                     f"{rule.min_judged}", span, service)
    return Window(judged, True, "ok", span, service)
