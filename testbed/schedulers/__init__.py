"""Scheduling policies, chosen by name (`scheduler=NAME`)."""
from __future__ import annotations

from testbed.block_manager import BlockManager
from testbed.schedulers.adaptive import AdaptiveScheduler
from testbed.schedulers.base import Scheduler, SchedulerConfig
from testbed.schedulers.context import SchedulerContext
from testbed.schedulers.orca import OrcaScheduler
from testbed.schedulers.request_level import RequestLevelScheduler
from testbed.schedulers.sarathi import SarathiScheduler
from testbed.schedulers.sarathi_srpt import SarathiSRPTScheduler
from testbed.schedulers.vllm_v0 import VllmV0Scheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (RequestLevelScheduler, VllmV0Scheduler, OrcaScheduler, SarathiScheduler,
                        SarathiSRPTScheduler, AdaptiveScheduler)
}


def scheduler_class(name: str) -> type[Scheduler]:
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler='{name}' is not known; choose one of: {', '.join(sorted(SCHEDULERS))}")
    return SCHEDULERS[name]


def make_scheduler(name: str, cfg: SchedulerConfig, block_manager: BlockManager,
                   context: SchedulerContext | None = None) -> Scheduler:
    return scheduler_class(name)(cfg, block_manager, context)


__all__ = ["SCHEDULERS", "Scheduler", "SchedulerConfig", "SchedulerContext", "make_scheduler", "scheduler_class"]
