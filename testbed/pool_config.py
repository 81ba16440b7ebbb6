"""PoolConfig: what one pool of a disaggregated deployment sets for itself
(the `prefill:` and `decode:` sections of the run config). DistServe's point
is that prefill wants compute and decode wants memory, so each pool may split
its model replica its own way: `prefill.parallel.tp=2 decode.parallel.tp=1`.
Likewise its batching: `prefill.token_budget=8192` chunks prompts on the
prefill workers at 8,192 while the run's `token_budget` (mode=hybrid's
colocated pool, say) stays at 512, and `prefill.scheduler=vllm_v0` prefills
whole prompts there. A pool that sets nothing runs with the run's `parallel`,
`token_budget` and `scheduler`.

The runtimes read it through testbed/runtime/build.py (`pool_config`), which
gives each worker the run config of its role's pool (WorkerService.pool)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from testbed.sim.config import ParallelConfig

POOLS = ("prefill", "decode")       # the RunConfig sections of type PoolConfig


@dataclass
class ParallelOverride(ParallelConfig):
    """The Hydra schema's stand-in for a pool's unset `parallel`: OmegaConf
    cannot set a field inside a None (`prefill.parallel.tp=2` on the command
    line would fail), so the schema holds this instead. The fields given
    override the run's `parallel`; PoolConfig.resolve turns it into a plain
    ParallelConfig, or back into None when nothing was given."""
    tp: Optional[int] = None
    pp: Optional[int] = None
    intra_node: Optional[str] = None
    pp_link: Optional[str] = None

    def validate(self) -> None:
        """Checked once resolved (PoolConfig.resolve)."""


@dataclass
class PoolConfig:
    parallel: Optional[ParallelConfig] = None     # None: the run's `parallel`
    token_budget: Optional[Union[int, str]] = None     # an int or "auto"; None: the run's `token_budget`
    scheduler: Optional[str] = None               # a name in testbed.schedulers.SCHEDULERS; None: the run's

    def resolve(self, section: str, run_parallel: ParallelConfig) -> None:
        """A ParallelOverride becomes the run's `parallel` with the fields it set (or None)."""
        p = self.parallel
        if isinstance(p, ParallelOverride):
            given = {f.name: getattr(p, f.name) for f in dataclasses.fields(ParallelConfig)
                     if getattr(p, f.name) is not None}
            self._check(section, given)
            self.parallel = dataclasses.replace(run_parallel, **given) if given else None

    def validate(self, section: str) -> None:
        if self.parallel is not None:
            self._check(section, {"tp": self.parallel.tp, "pp": self.parallel.pp})
        from testbed.schedulers import SCHEDULERS
        from testbed.schedulers.budget import AUTO
        b = self.token_budget
        if b is not None and b != AUTO and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"{section}.token_budget: must be an integer >= 1 or '{AUTO}' (or unset: the run's "
                             f"token_budget), got {b!r}")
        if self.scheduler is not None and self.scheduler not in SCHEDULERS:
            raise ValueError(f"{section}.scheduler='{self.scheduler}' is not known; choose one of: "
                             f"{', '.join(sorted(SCHEDULERS))} (or unset it: the run's scheduler)")

    @staticmethod
    def _check(section: str, given: dict) -> None:
        for f in ("tp", "pp"):
            if f in given and (isinstance(given[f], bool) or not isinstance(given[f], int) or given[f] < 1):
                raise ValueError(f"{section}.parallel.{f}: must be an integer >= 1, got {given[f]!r}")

    def check_runs_on_real_engine(self, section: str) -> None:
        """The real engine runs one process per worker, one device each: no
        tensor or pipeline parallelism (testbed/model_executor.py)."""
        p = self.parallel
        if p is not None and p.tp * p.pp != 1:
            raise ValueError(f"{section}.parallel: tp={p.tp} pp={p.pp} needs tensor or pipeline parallelism, which "
                             f"runtime=real does not have (one process per worker at tp=1 pp=1); use runtime=sim, "
                             f"or unset {section}.parallel")
