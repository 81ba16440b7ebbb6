"""The deployments the `decision` study compares at an equal GPU count: a
deployment is a label, a family (colocated, disaggregated, hybrid), the run
settings it applies to a RunConfig, and the GPUs it occupies. New kinds
(`hybrid`, further parallel layouts) are new entries of `deployments()`,
never branches in the study."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import product

from testbed.config import RunConfig
from testbed.experiments.decision_config import DecisionConfig
from testbed.pool_config import PoolConfig

FAMILIES = ("colocated", "disaggregated", "hybrid")


@dataclass(frozen=True)
class Deployment:
    label: str                       # "sarathi-512", "adaptive", "disagg-1P1D", "disagg-1P2D-p_tp2-d_tp1"
    family: str                      # colocated | disaggregated | hybrid
    mode: str
    scheduler: str
    token_budget: int | None = None  # None: the run's
    replicas: int = 1
    prefill_workers: int = 1
    decode_workers: int = 1
    prefill_tp: int | None = None    # a pool's own tensor parallelism (None: the run's parallel)
    decode_tp: int | None = None
    # its runs read the SLOs (adaptive plans each iteration from the TBT target, the KV
    # store's router rejects by the TTFT target): probe runs are not shared across SLOs
    reads_slo: bool = False
    uses_link: bool = True           # False: its workers never send KV (its runs are the same on every link)

    def apply(self, cfg: RunConfig) -> RunConfig:
        """`cfg` served by this deployment, as a plain run (no experiment, no W&B run of its own)."""
        def pool(tp: int | None) -> PoolConfig:
            return PoolConfig(None if tp is None else dataclasses.replace(cfg.parallel, tp=tp))
        return replace_run(
            cfg, mode=self.mode, scheduler=self.scheduler, token_budget=self.token_budget or cfg.token_budget,
            replicas=self.replicas, prefill_workers=self.prefill_workers, decode_workers=self.decode_workers,
            prefill=pool(self.prefill_tp), decode=pool(self.decode_tp), experiment=None,
            wandb=dataclasses.replace(cfg.wandb, mode="disabled"), progress=False)

    def num_gpus(self, cfg: RunConfig) -> int:
        """Accelerators of the applied run: over its workers, tp x pp of each one's pool."""
        from testbed.runtime.deployment import num_gpus
        return num_gpus(self.apply(cfg))


def replace_run(cfg: RunConfig, **changes) -> RunConfig:
    """dataclasses.replace that keeps num_kv_blocks=auto: the replaced config
    re-derives its KV blocks per pool from the memory (runtime/build.py)
    only while num_kv_blocks is still 'auto'."""
    if getattr(cfg, "num_kv_blocks_from_memory", False) and "num_kv_blocks" not in changes:
        changes["num_kv_blocks"] = "auto"
    return dataclasses.replace(cfg, **changes)


def deployments(e: DecisionConfig, num_gpus: int, tp: int, reuse: bool) -> list[Deployment]:
    """Every deployment on `num_gpus` GPUs, each worker at least `tp` GPUs:
    sarathi at each of e.token_budgets and adaptive on num_gpus/tp replicas;
    disagg (e.disagg_scheduler in both pools) at every xPyD split and tensor
    parallelism per pool from e.pool_tp (at least `tp`) with
    x * prefill tp + y * decode tp = num_gpus; the same with the KV store when
    the workload reuses prefixes. e.deployments, when given, keeps
    only those labels (each must name one of them)."""
    out = []
    if num_gpus % tp == 0:
        replicas = num_gpus // tp
        out += [Deployment(f"sarathi-{c}", "colocated", "colocated", "sarathi", c, replicas=replicas,
                           uses_link=False) for c in e.token_budgets]
        if "adaptive" in e.colocated:
            out.append(Deployment("adaptive", "colocated", "colocated", "adaptive", replicas=replicas,
                                  reads_slo=True, uses_link=False))
    tps = sorted({t for t in e.pool_tp if t >= tp} | {tp})
    splits = [(x, tp_p, (num_gpus - x * tp_p) // tp_d, tp_d) for tp_p, tp_d in product(tps, tps)
              for x in range(1, num_gpus // tp_p + 1)
              if num_gpus - x * tp_p >= tp_d and (num_gpus - x * tp_p) % tp_d == 0]
    # the KV store's router rejects by the TTFT target: its runs read the SLOs
    for mode, reads_slo in [("disagg", False)] + ([("kvstore", True)] if reuse else []):
        for x, tp_p, y, tp_d in splits:
            suffix = "" if (tp_p, tp_d) == (1, 1) else f"-p_tp{tp_p}-d_tp{tp_d}"
            out.append(Deployment(f"{mode}-{x}P{y}D{suffix}", "disaggregated", mode, e.disagg_scheduler,
                                  prefill_workers=x, decode_workers=y, prefill_tp=tp_p, decode_tp=tp_d,
                                  reads_slo=reads_slo))
    if not e.deployments:
        return out
    labels = [d.label for d in out]
    unknown = [k for k in e.deployments if k not in labels]
    if unknown:
        raise ValueError(f"experiment.deployments: {unknown} not among the deployments on {num_gpus} "
                         f"GPUs: choose from {', '.join(labels)}")
    return [d for d in out if d.label in e.deployments]
