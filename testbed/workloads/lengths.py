"""Length distributions for prompts and outputs (max_tokens).

Each distribution turns (rng, n) into n integer lengths >= 1. build.py picks
one per side by `workload.prompt_dist` / `workload.output_dist` from LENGTHS,
reading that side's parameters (`prompt_len`, `prompt_min`, ...); `trace`
is not here because the lengths then come from the trace rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from testbed.workloads.config import WorkloadConfig


@dataclass(frozen=True)
class FixedLengths:
    value: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


@dataclass(frozen=True)
class UniformLengths:
    """Integers uniform in [low, high], both included."""
    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)


@dataclass(frozen=True)
class LognormalLengths:
    """exp(N(ln median, sigma)) rounded, clipped to [low, high]: the long right
    tail of real chat and summarization prompts."""
    median: int
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(np.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class ZipfLengths:
    """Bounded Zipf by rank: value low + r - 1 for rank r in 1..(high - low + 1),
    with probability proportional to r^-a. Bounded so that any a > 0 works and
    nothing is clipped into a spike at `high`."""
    low: int
    high: int
    a: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        ranks = np.arange(1, self.high - self.low + 2, dtype=np.float64)
        cdf = np.cumsum(ranks ** -self.a)
        cdf /= cdf[-1]
        picked = np.searchsorted(cdf, rng.random(n), side="right")
        return (self.low + np.minimum(picked, len(ranks) - 1)).astype(np.int64)


LENGTHS = {
    "fixed": lambda p: FixedLengths(p["len"]),
    "uniform": lambda p: UniformLengths(p["min"], p["max"]),
    "lognormal": lambda p: LognormalLengths(p["len"], p["sigma"], p["min"], p["max"]),
    "zipf": lambda p: ZipfLengths(p["min"], p["max"], p["zipf_a"]),
}


def make_lengths(cfg: WorkloadConfig, side: str):
    """The distribution for `side` ('prompt' or 'output') of the workload."""
    kind = getattr(cfg, f"{side}_dist")
    if kind not in LENGTHS:
        raise ValueError(f"workload.{side}_dist: '{kind}' is not a synthetic distribution; "
                         f"choose one of {', '.join(LENGTHS)}")
    params = {k: getattr(cfg, f"{side}_{k}") for k in ("len", "min", "max", "sigma", "zipf_a")}
    return LENGTHS[kind](params)
