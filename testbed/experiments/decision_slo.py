"""The SLOs of the `decision` study: a TTFT target scaled with the context
length, and smoothness by one of two definitions, each a class chosen by name.

- `p99_tbt`: the p99 of every inter-token gap <= the TBT target;
- `fluidity`: Etalon's fluidity index (per-token deadlines, slack carried
  over, testbed/metrics.py) >= `fluidity_min` at the same TBT target.

Both also require p99 TTFT <= the TTFT target, and every request of the probe
finished. They judge the steady window of a probe (testbed/steady_state.py);
`judge` returns what failed first ("" when the probe meets the SLOs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from testbed.metrics import RequestRecord, fluidity_deadlines

LIMITS = ("unfinished", "unjudged", "ttft", "tbt", "fluidity")


@dataclass(frozen=True)
class SLOTargets:
    ttft_ms: float
    tbt_ms: float
    fluidity_min: float = 0.99


class Smoothness:
    name = ""
    # whether a gap over the TBT target is forgiven while the request is ahead of its
    # per-token deadlines: only then may a scheduler spend banked slack on a longer iteration
    credits_slack = False

    def judge(self, judged: Sequence[RequestRecord], t: SLOTargets) -> str:
        """The failed limit of LIMITS[2:] on the judged requests, or ""."""
        ttft = [r.ttft_s for r in judged if r.ttft_s is not None]
        if ttft and np.percentile(ttft, 99) * 1e3 > t.ttft_ms:
            return "ttft"
        return self.smooth(judged, t)

    def smooth(self, judged: Sequence[RequestRecord], t: SLOTargets) -> str:
        raise NotImplementedError


class P99TBT(Smoothness):
    name = "p99_tbt"

    def smooth(self, judged, t):
        gaps = [np.diff(r.token_times_s) for r in judged if len(r.token_times_s) > 1]
        if gaps and np.percentile(np.concatenate(gaps), 99) * 1e3 > t.tbt_ms:
            return "tbt"
        return ""


class Fluidity(Smoothness):
    name = "fluidity"
    credits_slack = True

    def smooth(self, judged, t):
        counts = [fluidity_deadlines(r, t.ttft_ms / 1e3, t.tbt_ms / 1e3) for r in judged]
        total = sum(n for _, n in counts)
        if total and 1.0 - sum(m for m, _ in counts) / total < t.fluidity_min:
            return "fluidity"
        return ""


SMOOTHNESS = {cls.name: cls for cls in (P99TBT, Fluidity)}


def get_smoothness(name: str) -> Smoothness:
    if name not in SMOOTHNESS:
        raise ValueError(f"experiment.smoothness: '{name}' is not known; choose from {', '.join(SMOOTHNESS)}")
    return SMOOTHNESS[name]()
