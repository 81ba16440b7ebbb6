"""The deployments the `decision` study compares at an equal GPU count: a
deployment is a label, a family (colocated, disaggregated, hybrid), the run
settings it applies to a RunConfig, and the GPUs it occupies. New kinds
(`hybrid`, per-pool parallel configs) are new entries of `deployments()`,
never branches in the study."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from testbed.config import RunConfig
from testbed.experiments.config import ExperimentConfig

FAMILIES = ("colocated", "disaggregated", "hybrid")


@dataclass(frozen=True)
class Deployment:
    label: str                       # "sarathi-512", "adaptive", "disagg-1P1D", "kvstore-1P1D"
    family: str                      # colocated | disaggregated | hybrid
    mode: str
    scheduler: str
    token_budget: int | None = None  # None: the run's
    replicas: int = 1
    prefill_workers: int = 1
    decode_workers: int = 1
    # its runs read the SLOs (adaptive plans each iteration from the TBT target, the
    # KV store's router rejects by the TTFT target): probes are not shared across SLOs
    reads_slo: bool = False

    def apply(self, cfg: RunConfig) -> RunConfig:
        """`cfg` served by this deployment, as a plain run (no experiment, no W&B run of its own)."""
        return dataclasses.replace(
            cfg, mode=self.mode, scheduler=self.scheduler, token_budget=self.token_budget or cfg.token_budget,
            replicas=self.replicas, prefill_workers=self.prefill_workers, decode_workers=self.decode_workers,
            experiment=ExperimentConfig(), wandb=dataclasses.replace(cfg.wandb, mode="disabled"), progress=False)

    def num_gpus(self, cfg: RunConfig) -> int:
        """Accelerators of the applied run: its workers, each tp x pp GPUs."""
        from testbed.runtime.deployment import build_mode
        return len(build_mode(self.apply(cfg)).layout()) * cfg.parallel.tp * cfg.parallel.pp


def deployments(e: ExperimentConfig, num_gpus: int, gpus_per_worker: int, reuse: bool) -> list[Deployment]:
    """Every deployment on `num_gpus` GPUs of workers of `gpus_per_worker`:
    sarathi at each of e.token_budgets and adaptive on num_gpus/gpus_per_worker
    replicas; disagg (e.disagg_scheduler in both pools) at every xPyD split
    with x + y workers; the same splits with the KV store when the workload
    reuses prefixes. Empty when num_gpus is not a multiple of gpus_per_worker."""
    if num_gpus % gpus_per_worker:
        return []
    workers = num_gpus // gpus_per_worker
    out = [Deployment(f"sarathi-{c}", "colocated", "colocated", "sarathi", c, replicas=workers)
           for c in e.token_budgets]
    if "adaptive" in e.decision_colocated:
        out.append(Deployment("adaptive", "colocated", "colocated", "adaptive", replicas=workers, reads_slo=True))
    splits = [(x, workers - x) for x in range(1, workers)]
    out += [Deployment(f"disagg-{x}P{y}D", "disaggregated", "disagg", e.disagg_scheduler,
                       prefill_workers=x, decode_workers=y) for x, y in splits]
    if reuse:
        out += [Deployment(f"kvstore-{x}P{y}D", "disaggregated", "kvstore", e.disagg_scheduler,
                           prefill_workers=x, decode_workers=y, reads_slo=True) for x, y in splits]
    return out
