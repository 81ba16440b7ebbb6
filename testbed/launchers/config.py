"""RayConfig: the `ray:` section of the run config, read by `launcher=ray`
only. Plain types, so Hydra can set every field (`ray.address=auto`,
`+ray.strategy.decode=SPREAD`, `+ray.resources.prefill=node_a`: a new key of
a dict takes Hydra's `+`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from testbed.kv_transfer.config import timeout_problem

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RayConfig:
    # None: start a local cluster on loopback (dashboard off) and shut it down at the
    # end of the run; "auto" or "HOST:PORT": join that cluster and leave it running
    address: Optional[str] = None
    # address null: run the whole run (frontend, cluster, workers) in a private network namespace
    # with only loopback (testbed/launchers/netns.py says why); false: Ray listens on every interface
    private_netns: bool = True
    num_cpus: Optional[int] = None        # the local cluster's CPUs; None: what the workers ask for
    actor_cpus: float = 1.0               # per worker actor on CPU (on GPU: parallel.tp * pp GPUs)
    # placement group strategy per pool (a role name); roles not named get PACK
    strategy: Dict[str, str] = field(default_factory=dict)
    # a custom node resource per pool that pins its bundles (`ray start --resources '{"node_a": 8}'`)
    resources: Dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 120.0        # cluster start, placement, actors up

    def strategy_of(self, role: str) -> str:
        return self.strategy.get(role, "PACK")

    def validate(self) -> None:
        for role, s in self.strategy.items():
            if s not in STRATEGIES:
                raise ValueError(f"ray.strategy.{role}: '{s}' is not one of {', '.join(STRATEGIES)}")
        if not self.actor_cpus >= 0:
            raise ValueError(f"ray.actor_cpus: must be >= 0, got {self.actor_cpus}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"ray.num_cpus: must be >= 1 or null, got {self.num_cpus}")
        if problem := timeout_problem(self.start_timeout_s):
            raise ValueError(f"ray.start_timeout_s: {problem}")
