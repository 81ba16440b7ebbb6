"""Token budgets from the TBT SLO and a step-time predictor.

- `largest_fitting`: the largest multiple of a tile in [lo, hi] whose predicted
  iteration fits a time target (iteration time grows with the budget, so a
  bisection over the multiples finds it). The adaptive policy asks it every
  iteration; the static `auto` budget asks it once.
- `auto_token_budget`: `token_budget=auto` for `sarathi`, the seed essay's
  formula: budget = the decodes it protects + (TBT SLO - their iteration time)
  worth of prefill, rounded down to the tile. The protected batch is
  `adaptive.auto_num_decodes` decodes (default max_num_seqs: the budget holds
  with the batch full) at `adaptive.auto_decode_context` tokens each.
- `resolve_token_budget`: the one place `token_budget` (an int or "auto") becomes the int a
  scheduler runs with."""
from __future__ import annotations

from typing import Callable

from testbed.schedulers.adaptive_config import AdaptiveConfig
from testbed.schedulers.context import StepTimePredictor

AUTO = "auto"


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int, multiple: int) -> int:
    """The largest b = k·multiple in [lo, hi] with fits(b), trying hi first (the
    common case when the batch is light); lo when nothing fits. lo and hi are
    multiples of `multiple`."""
    if fits(hi):
        return hi
    a, b = lo // multiple, hi // multiple - 1      # fits(a·m) unknown, fits((b+1)·m) false
    while a < b:
        mid = (a + b + 1) // 2
        if fits(mid * multiple):
            a = mid
        else:
            b = mid - 1
    return a * multiple


def auto_token_budget(predictor: StepTimePredictor, slo_tbt_ms: float, max_num_seqs: int,
                      cfg: AdaptiveConfig) -> int:
    num_decodes = max_num_seqs if cfg.auto_num_decodes is None else cfg.auto_num_decodes
    decodes = [(1, cfg.auto_decode_context)] * num_decodes
    target_s = cfg.tbt_headroom * slo_tbt_ms * 1e-3

    def fits(prefill: int) -> bool:
        return predictor.iteration_time_s(decodes + [(prefill, prefill)], num_decodes + 1) <= target_s
    return num_decodes + largest_fitting(fits, cfg.min_budget, cfg.max_budget, cfg.budget_multiple)


def resolve_token_budget(token_budget: int | str, predictor: Callable[[], StepTimePredictor],
                         slo_tbt_ms: float, max_num_seqs: int, cfg: AdaptiveConfig | None) -> int:
    """`token_budget` as an int; "auto" asks `predictor()` (built only then),
    bounded by the run's adaptive section (its defaults where it has none)."""
    check_token_budget(token_budget)
    if token_budget == AUTO:
        return auto_token_budget(predictor(), slo_tbt_ms, max_num_seqs, cfg or AdaptiveConfig())
    return token_budget


def check_token_budget(token_budget: int | str) -> None:
    if token_budget != AUTO and (not isinstance(token_budget, int) or token_budget < 1):
        raise ValueError(f"token_budget: must be an integer >= 1 or '{AUTO}', got {token_budget!r}")
