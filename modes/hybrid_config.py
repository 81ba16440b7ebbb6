"""HybridConfig: the `hybrid:` section of the run config (mode=hybrid,
modes/hybrid.py). A colocated pool of `colocated_replicas` replicas beside
the run's P/D pools (`prefill_workers`, `decode_workers`); the hybrid router
(`router`, modes/hybrid_router.py) sends a prompt shorter than `threshold`
tokens to the colocated pool and a longer one to the P/D pools. The
colocated pool batches with the run's `token_budget` and `scheduler`; the P/D
pools may set their own (`prefill.token_budget`, `prefill.scheduler`:
testbed/pool_config.py).

`threshold=auto` reads the system crossover L* that the decision study wrote
(`decision_summary`, a decision_summary.json) for this model, hardware and
link: modes/hybrid_threshold.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AUTO = "auto"
SLOS = ("p99_tbt", "fluidity")       # the decision study's smoothness definitions


@dataclass
class HybridConfig:
    # prompts of fewer tokens go to colocation; "auto": decision_summary's l_star.
    # 4,096 is Dynamo's fixed conditional-disaggregation threshold.
    threshold: Any = 4096            # int | "auto"
    decision_summary: str = ""       # threshold=auto: path of a decision_summary.json
    slo: str = "p99_tbt"             # threshold=auto: the entry's smoothness definition
    colocated_replicas: int = 1
    router: str = "length_threshold"     # a name in modes.hybrid_router.HYBRID_ROUTERS

    def validate(self) -> None:
        t = self.threshold
        if t == AUTO:
            if not self.decision_summary:
                raise ValueError("hybrid.threshold=auto reads the crossover from a decision study: set "
                                 "hybrid.decision_summary=PATH/decision_summary.json (experiment=decision writes it)")
        elif isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"hybrid.threshold: a prompt length in tokens (>= 1) or 'auto', got {t!r}")
        if self.slo not in SLOS:
            raise ValueError(f"hybrid.slo='{self.slo}' is not known; choose one of: {', '.join(SLOS)}")
        if self.colocated_replicas < 1:
            raise ValueError(f"hybrid.colocated_replicas: must be >= 1, got {self.colocated_replicas}")
