"""StepJitter: the spread of a real machine's iteration times around the cost
model's prediction, so that `runtime=sim` predicts tails (p99 TBT), not only
medians.

On this CPU the same batch takes 3.1 ms one step and 4.6 ms another (the
other process on the second core, the worker's socket I/O, the OS): a run's
p99 token gap is set by that spread, not by the batch. `testbed profile`
serves a short decode-heavy workload on the real runtime and stores the
quantiles of each decode step's time minus the median of the steps with as
many decodes, in ms (`hardware.step_jitter_ms`, evenly spaced probabilities
0, 1/(n-1), ..., 1). The simulator adds a deviation drawn from them to each
modeled iteration, with a seeded generator per worker, so a run is
reproducible. The noise is time the machine takes away or gives back, not a
share of the step: served 1800-token prefills (~330 ms) vary by ~3%, where
a 3 ms decode step varies by 30%; scaling the decodes' spread onto a
prefill drew it 10% short one run and 30% long the next. The cost model
itself is fitted to median step times, so the median iteration is
unchanged. GPU presets carry no table: no jitter.
"""
from __future__ import annotations

import random
from typing import Sequence


def jitter_quantiles(samples: Sequence[float], num_quantiles: int = 101, top: float = 0.999) -> list[float]:
    """`num_quantiles` evenly spaced quantiles (min to max) of measured
    step-time deviations, linearly interpolated between samples, the samples
    above their `top` quantile first clipped to it. Why clip: the last of
    101 quantiles is the max, and a draw in the top 1% lands anywhere
    between the 99th percentile and it; one 30 ms hiccup among ~3,000
    served steps (2.4 ms at the 99th percentile) so made half of the top 1%
    of simulated steps 15-30 ms slower, and the sim's p99 TBT came out 85-99%
    above the real one's."""
    if len(samples) < 2:
        raise ValueError(f"step_jitter_ms: need at least 2 measured steps, got {len(samples)}")
    xs = sorted(samples)
    cap = _at(xs, top * (len(xs) - 1))
    xs = [min(x, cap) for x in xs]
    return [_at(xs, i * (len(xs) - 1) / (num_quantiles - 1)) for i in range(num_quantiles)]


def _at(xs: list[float], pos: float) -> float:
    """Sorted `xs` at fractional index `pos`, linear between neighbours."""
    j = min(int(pos), len(xs) - 2)
    return xs[j] + (xs[j + 1] - xs[j]) * (pos - j)


class StepJitter:
    """Draws iteration-time deviations in seconds from quantiles given in ms
    (inverse-CDF sampling, linear between quantiles)."""

    def __init__(self, quantiles_ms: Sequence[float], seed: int):
        if len(quantiles_ms) < 2:
            raise ValueError(f"hardware.step_jitter_ms: need at least 2 quantiles, got {len(quantiles_ms)}")
        self.quantiles = [float(q) / 1e3 for q in quantiles_ms]
        self._span = len(self.quantiles) - 1
        self._random = random.Random(seed).random

    def __call__(self) -> float:
        pos = self._random() * self._span
        i = int(pos)
        q = self.quantiles
        return q[i] + (q[i + 1] - q[i]) * (pos - i)
