"""Arrival processes: when each synthetic request reaches the frontend.

Each process turns (rng, n) into n non-decreasing arrival times starting at 0.
build.py picks one by `workload.arrival` from ARRIVALS; `trace` is not here
because a trace brings its own timestamps (readers.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from testbed.workloads.config import WorkloadConfig


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    """n - 1 inter-arrival gaps -> n arrival times, the first at 0."""
    return np.concatenate([[0.0], np.cumsum(gaps)])


@dataclass(frozen=True)
class GammaArrivals:
    """Inter-arrival gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)):
    mean 1/rate whatever the burstiness, coefficient of variation
    1/sqrt(burstiness). burstiness=1 is a Poisson process (exponential gaps).
    This is vLLM's benchmark_serving definition."""
    rate: float
    burstiness: float = 1.0

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if n == 0:
            return np.empty(0)
        gaps = rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), size=n - 1)
        return _from_gaps(gaps)


@dataclass(frozen=True)
class ConstantArrivals:
    """One request every 1/rate seconds."""
    rate: float

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.float64) / self.rate


@dataclass(frozen=True)
class BurstArrivals:
    """Everything at time 0: the offline / max-throughput setting."""

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.zeros(n)


ARRIVALS = {
    # poisson is gamma with shape 1; `burstiness` only shapes `gamma`
    "poisson": lambda cfg: GammaArrivals(cfg.rate, 1.0),
    "gamma": lambda cfg: GammaArrivals(cfg.rate, cfg.burstiness),
    "constant": lambda cfg: ConstantArrivals(cfg.rate),
    "burst": lambda cfg: BurstArrivals(),
}


def make_arrivals(cfg: WorkloadConfig):
    if cfg.arrival not in ARRIVALS:
        raise ValueError(f"workload.arrival: '{cfg.arrival}' is not a synthetic process; "
                         f"choose one of {', '.join(ARRIVALS)}")
    return ARRIVALS[cfg.arrival](cfg)
