"""AdaptiveConfig: the `adaptive:` section of the run config. It bounds the
per-iteration prefill budget of `scheduler=adaptive`, and the static budget
`token_budget=auto` derives once for `sarathi` (testbed/schedulers/budget.py).
Every default lives here; `validate()` raises one line naming the field."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveConfig:
    min_budget: int = 64           # prefill tokens a scheduled prompt gains per iteration, at least
    max_budget: int = 8192         # prefill tokens per iteration, at most
    budget_multiple: int = 64      # budgets are rounded down to a multiple of this (GEMM tiles)
    # the share of iterations the adaptive plan keeps within the running decodes' token
    # deadlines: each is planned so that its corrected prediction times this quantile of the
    # recent measured/predicted ratios of its batch kind fits the whole TBT SLO, so the room
    # left for the predictor's error follows the measured noise. 0.995 for a p99 TBT SLO: the
    # planned iterations get half of its 1% of late gaps, the rest is left to what no budget
    # prevents (decode-only iterations over the SLO, the estimate's first steps). null: plan
    # the mean prediction at tbt_headroom of the SLO (no spread).
    tbt_quantile: float | None = 0.995
    # the part of each token's TBT deadline an iteration is planned to use by token_budget=auto
    # (and by adaptive when tbt_quantile is null): the rest is room for the predictor's error
    tbt_headroom: float = 0.9
    # banked fluidity slack (in TBT SLOs) one iteration may spend, and only while the
    # oldest waiting prompt would miss its TTFT deadline at the plain budget
    max_slack_tbt: float = 1.0
    # when the oldest prompts fit under the deadline budget: take the budget (at most that one) that
    # minimises the waiting prompts' summed predicted TTFT (testbed/schedulers/ttft_rollout.py);
    # false: always the largest budget the deadlines allow
    ttft_rollout: bool = True
    # the rollout also prices the prompts that arrive during the iterations it sizes, at the
    # arrival rate and typical iteration measured over the last rollout_window arrivals and
    # steps (testbed/schedulers/traffic.py). Off by default: on chat it moved TTFT's tail, not
    # its p50, and cost capacity (275 -> 252 req/s; experiments/README.md, "adaptive")
    rollout_arrivals: bool = False
    rollout_window: int = 64
    # spend the decodes' slack on fresh prompts: when every waiting prompt arrived during the last
    # iteration and each decode's next token meets its deadline one iteration later, run the
    # prompts alone first and the decodes next, if what the prompts gain exceeds what the split's
    # extra step costs the prompts arriving meanwhile (testbed/schedulers/prefill_first.py)
    prefill_first: bool = True
    ewma_alpha: float = 0.2        # weight of the newest step in the measured/predicted correction
    # token_budget=auto: the decode batch the static budget must protect
    auto_num_decodes: int | None = None    # None: max_num_seqs
    auto_decode_context: int = 2048

    def validate(self) -> None:
        if self.rollout_window < 2:
            raise ValueError(f"adaptive.rollout_window: must be >= 2 (a rate needs two arrivals), "
                             f"got {self.rollout_window}")
        for f in ("min_budget", "max_budget", "budget_multiple", "auto_decode_context"):
            if getattr(self, f) < 1:
                raise ValueError(f"adaptive.{f}: must be >= 1, got {getattr(self, f)}")
        for f in ("min_budget", "max_budget"):
            if getattr(self, f) % self.budget_multiple:
                raise ValueError(f"adaptive.{f}: must be a multiple of adaptive.budget_multiple="
                                 f"{self.budget_multiple}, got {getattr(self, f)}")
        if self.max_budget < self.min_budget:
            raise ValueError(f"adaptive.max_budget: {self.max_budget} is below adaptive.min_budget={self.min_budget}")
        if not 0.0 < self.tbt_headroom <= 1.0:
            raise ValueError(f"adaptive.tbt_headroom: must be in (0, 1], got {self.tbt_headroom}")
        if self.tbt_quantile is not None and not 0.0 < self.tbt_quantile < 1.0:
            raise ValueError(f"adaptive.tbt_quantile: must be in (0, 1) (0.995 for a p99 TBT SLO) or null "
                             f"(plan the mean at adaptive.tbt_headroom), got {self.tbt_quantile}")
        if self.max_slack_tbt < 0:
            raise ValueError(f"adaptive.max_slack_tbt: must be >= 0, got {self.max_slack_tbt}")
        if not 0.0 < self.ewma_alpha <= 1.0:
            raise ValueError(f"adaptive.ewma_alpha: must be in (0, 1], got {self.ewma_alpha}")
        if self.auto_num_decodes is not None and self.auto_num_decodes < 0:
            raise ValueError(f"adaptive.auto_num_decodes: must be >= 0 or null (max_num_seqs), "
                             f"got {self.auto_num_decodes}")
