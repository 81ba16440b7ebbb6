"""StepJitter: the spread of a real machine's iteration times around the cost
model's prediction, so that `runtime=sim` predicts tails (p99 TBT), not only
medians.

On a shared CPU the same batch takes noticeably longer one step than the
next (the other process on the second core, the worker's socket I/O, the
OS), and a run's p99 token gap is set by that spread, not by the batch.
`testbed profile` serves a short decode-heavy workload on the real runtime
and stores the quantiles of each decode step's time minus the median of the
steps with as many decodes, in ms (`hardware.step_jitter_ms`, evenly spaced
probabilities 0, 1/(n-1), ..., 1). The simulator adds a deviation drawn from
them to each modeled iteration, with a seeded generator per worker, so a run
is reproducible. The noise is added time, not a share of the step: a long
prefill varies by a few percent where a decode step varies by tens, so
scaling the decodes' spread onto a prefill would be wrong. The cost model is
fitted to median step times, so the median iteration is unchanged. GPU
presets carry no table: no jitter.
"""
from __future__ import annotations

import random
from typing import Sequence


def jitter_quantiles(samples: Sequence[float], num_quantiles: int = 101, top: float = 0.999) -> list[float]:
    """`num_quantiles` evenly spaced quantiles (min to max) of measured
    step-time deviations, linearly interpolated between samples, the samples
    above their `top` quantile first clipped to it. Why clip: the last of
    101 quantiles is the max, and a draw in the top 1% lands anywhere
    between the 99th percentile and it, so one rare hiccup would otherwise
    set the simulated p99 (experiments/README.md, "Calibration notes")."""
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
