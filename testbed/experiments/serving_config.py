"""The serving studies' settings (serving.py): `experiment=stall` (one stall
event under each policy, on the real engine) and `experiment=capacity` (the
highest rate each policy serves within the SLOs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from testbed.experiments.config import StudyConfig, at_least, fraction, parse_split


@dataclass
class StallConfig(StudyConfig):
    """The policies compared: each scheduler colocated (sarathi once per token
    budget), and disagg at each xPyD split with disagg_scheduler in both pools."""
    name: str = "stall"
    run = "testbed.experiments.serving:run_stall"
    schedulers: list[str] = field(default_factory=lambda: ["vllm_v0", "orca", "sarathi"])
    token_budgets: list[int] = field(default_factory=lambda: [256])
    disagg_splits: list[str] = field(default_factory=lambda: ["1P1D"])
    disagg_scheduler: str = "vllm_v0"        # whole prefills, as in Splitwise

    def validate(self) -> None:
        super().validate()
        at_least(self, 1, "token_budgets")
        for s in self.disagg_splits:
            parse_split(s)


@dataclass
class CapacityConfig(StallConfig):
    name: str = "capacity"
    run = "testbed.experiments.serving:run_capacity"
    schedulers: list[str] = field(default_factory=lambda: ["vllm_v0", "sarathi"])
    token_budgets: list[int] = field(default_factory=lambda: [512, 2048])
    # name -> {preset: a conf/workload name (optional), slo: {ttft_ms, tbt_ms}, rate_start and
    # max_probes (optional), workload: WorkloadConfig fields over the preset}; capacity.yaml sets them
    workloads: dict[str, Any] = field(default_factory=dict)
    rate_start: float = 1.0                  # requests/s per GPU where a search without its own starts
    rel_tol: float = 0.1                     # stop when the bracket's hi/lo - 1 is below this
    max_probes: int = 10                     # runs per search at most
    # the real engine's point on this machine: steady-state probes (testbed/steady_state.py)
    real: bool = True
    real_models: list[str] = field(default_factory=lambda: ["tiny"])
    real_policies: list[str] = field(default_factory=lambda: ["sarathi-512"])
    real_workload: dict[str, Any] = field(default_factory=dict)   # one spec as in workloads, plus its name
    span_factor: float = 10.0                # arrivals span this many longest service times
    min_judged: int = 20                     # requests judged per probe at least
    max_requests: int = 300                  # requests per probe at most

    def validate(self) -> None:
        super().validate()
        if self.rate_start <= 0:
            raise ValueError(f"experiment.rate_start: must be > 0, got {self.rate_start}")
        fraction(self, "rel_tol")
        if self.max_probes < 2:
            raise ValueError(f"experiment.max_probes: at least 2 to bracket a rate, got {self.max_probes}")
        if not self.span_factor > 2:
            raise ValueError(f"experiment.span_factor: must be > 2 (warm-up and drain each take one "
                             f"longest service time), got {self.span_factor}")
        if self.min_judged < 1 or self.max_requests < self.min_judged:
            raise ValueError(f"experiment.max_requests: need max_requests >= min_judged >= 1, got "
                             f"{self.max_requests} and {self.min_judged}")
