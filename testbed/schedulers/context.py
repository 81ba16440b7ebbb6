"""SchedulerContext: what a policy may read beyond its queues, built in one
place for both runtimes (testbed/runtime/build.py): the clock, the SLOs, and
a step-time predictor (the cost model: a GPU preset on runtime=sim, the
`testbed profile` tables of this CPU on runtime=real)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from testbed.clock import Clock


class StepTimePredictor(Protocol):
    def iteration_time_s(self, slices: Sequence[tuple[int, int]], num_sampled: int | None = None) -> float:
        """Seconds for one iteration of slices (new tokens, context after the step)."""


@dataclass(frozen=True)
class SchedulerContext:
    clock: Clock
    slo_ttft_ms: float
    slo_tbt_ms: float
    predictor: StepTimePredictor | None = None    # built only for a policy that asks (needs_predictor)
