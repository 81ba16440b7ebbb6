"""Self-correction of a step-time predictor from measured steps: its mean and
its spread.

The predictor (the cost model) may be wrong for this machine: a stale or
misprofiled table, or time the model leaves out (the scheduler's own work, the
engine's bookkeeping). Each finished step's measured (or simulated) duration
over the raw prediction updates an EWMA of that ratio, one per batch kind,
because the terms a profile gets wrong differ by kind: a decode-only step is
memory-bound, a prefill-only step compute-bound, a mixed one both. A
prediction is the raw one times its kind's ratio, so a profile off by a
constant factor converges within a few steps of each kind. A kind not seen
yet borrows the ratio pooled over every step, and starts its own from it.

The mean is not enough to keep a deadline on a noisy machine: half the steps
run longer than a mean prediction. So each kind also keeps the `quantile` of
its recent residuals (measured / the corrected prediction made for that step),
and `bound()` is the corrected prediction times it: the time the step stays
under with that probability, as far as the recent steps tell. A kind with
fewer than MIN_OWN_SAMPLES residuals borrows the pooled window (on a CPU the
pooled one is mostly decode steps, whose relative spread is the widest: the
borrowing errs on the safe side)."""
from __future__ import annotations

import bisect
import math
from collections import deque

DECODE, PREFILL, MIXED = "decode", "prefill", "mixed"   # the batch kinds
MIN_OWN_SAMPLES = 20


def batch_kind(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    if not num_prefill_tokens:
        return DECODE
    return MIXED if num_decode_tokens else PREFILL


class WindowQuantile:
    """The q-quantile (nearest rank: the ceil(q·n)-th smallest) of the last
    `size` values; 1.0 while empty. Kept sorted as values come and go, so a
    look is an index (this runs once per simulated step)."""

    def __init__(self, q: float, size: int):
        self.q = q
        self.recent: deque[float] = deque(maxlen=size)
        self.sorted: list[float] = []

    def __len__(self) -> int:
        return len(self.recent)

    def add(self, x: float) -> None:
        if len(self.recent) == self.recent.maxlen:
            del self.sorted[bisect.bisect_left(self.sorted, self.recent[0])]
        self.recent.append(x)
        bisect.insort(self.sorted, x)

    def value(self) -> float:
        xs = self.sorted
        return xs[max(0, math.ceil(self.q * len(xs)) - 1)] if xs else 1.0


def window_size(q: float) -> int:
    """Residuals kept per kind: enough that about two lie above the q-quantile
    (200 for p99), so it is a rank statistic rather than the one worst step;
    few enough (at least 100) to follow a change of load within seconds."""
    return max(100, math.ceil(2.0 / (1.0 - q)))


class StepCorrection:
    """`quantile`: the share of steps bound() should cover; None keeps no
    spread (bound() is the corrected mean)."""

    def __init__(self, alpha: float, quantile: float | None = None):
        self.alpha = alpha
        self.pooled = 1.0                             # measured / raw predicted, smoothed over every step
        self.ratio: dict[str, float] = {}             # the same per batch kind seen
        self.quantile = quantile
        size = window_size(quantile) if quantile is not None else 0
        self._new_window = lambda: WindowQuantile(quantile, size)
        self.pooled_spread = self._new_window()
        self.spread_by_kind: dict[str, WindowQuantile] = {}

    def corrected(self, raw_s: float, kind: str) -> float:
        return raw_s * self.ratio.get(kind, self.pooled)

    def spread(self, kind: str) -> float:
        """The quantile of measured / corrected over the kind's recent steps."""
        if self.quantile is None:
            return 1.0
        own = self.spread_by_kind.get(kind)
        return (own if own is not None and len(own) >= MIN_OWN_SAMPLES else self.pooled_spread).value()

    def bound(self, raw_s: float, kind: str) -> float:
        return self.corrected(raw_s, kind) * self.spread(kind)

    def observe(self, kind: str, raw_s: float, measured_s: float) -> None:
        if raw_s > 0 and measured_s > 0:
            r = measured_s / raw_s
            own = self.ratio.get(kind, self.pooled)
            if self.quantile is not None:
                residual = r / own                    # measured / the corrected prediction this step had
                self.spread_by_kind.setdefault(kind, self._new_window()).add(residual)
                self.pooled_spread.add(residual)
            self.ratio[kind] = own + self.alpha * (r - own)
            self.pooled += self.alpha * (r - self.pooled)
