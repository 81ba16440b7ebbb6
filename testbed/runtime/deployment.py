"""What the two runtimes share above the worker: the run's mode (its layout and
controller, from modes/registry.py) and the result of a run. runtime/real.py
and runtime/sim.py both import this module and never each other."""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field, fields

from testbed.config import RunConfig
from testbed.metrics import IterationRecord, RequestRecord
from testbed.modes.hybrid_config import AUTO as HYBRID_AUTO
from testbed.modes.hybrid_threshold import threshold_from_summary
from testbed.modes.registry import Mode, ModeSettings, get_mode, get_role
from testbed.modes.routers import RouterContext
from testbed.pool_config import POOLS
from testbed.record_log import RecordLog
from testbed.run_stats import RunStats
from testbed.runtime.build import pool_config, pool_parallel


@dataclass
class RunResult:
    """A run's outcome. Its records were streamed to `log` (testbed/record_log.py)
    as they came; `records` (in arrival order) and `iterations` read them back
    on first use."""
    log: RecordLog
    worker_stats: dict[str, dict] = field(default_factory=dict)
    duration_s: float = 0.0
    interrupted: bool = False
    store_stats: dict | None = None         # mode=kvstore: the KV store's counters

    @functools.cached_property
    def records(self) -> list[RequestRecord]:
        """Every request's record, in arrival order."""
        return self.log.requests()

    @functools.cached_property
    def iterations(self) -> list[IterationRecord]:
        return self.log.iterations()


def record_log(cfg: RunConfig, record_dir=None) -> RecordLog:
    """Where a runtime streams the run's records: `record_dir` (a run
    directory), else memory (a temporary directory past the log's
    memory_iterations, living as long as the log)."""
    return RecordLog(RunStats(cfg.slo.ttft_ms, cfg.slo.tpot_ms), record_dir,
                     writer_after=cfg.runtime.record_writer_after)


def mode_settings(cfg: RunConfig) -> ModeSettings:
    shared = {f.name for f in fields(ModeSettings)} & {f.name for f in fields(cfg)}
    return ModeSettings(**{name: getattr(cfg, name) for name in shared}, slo_ttft_ms=cfg.slo.ttft_ms,
                        kv_bytes_per_token=cfg.model.kv_bytes_per_token,
                        router_context=lambda: router_context(cfg),
                        pool_kv_blocks={p: pool_config(cfg, p).num_kv_blocks for p in POOLS},
                        colocated_replicas=cfg.hybrid.colocated_replicas, hybrid_router=cfg.hybrid.router,
                        hybrid_threshold=functools.cache(lambda: hybrid_threshold(cfg)),
                        max_model_len=max_model_len(cfg))


def max_model_len(cfg: RunConfig) -> int | None:
    """The positions the real engine's model was trained for: model.max_position_embeddings,
    from the checkpoint's config.json where model.path names one here. None on the
    simulator, whose cost model extrapolates past a preset's context (the studies go to 1M)."""
    if cfg.runtime.name != "real":
        return None
    model = cfg.model
    if model.path and os.path.isdir(model.path):
        from testbed.model.loader import config_from_checkpoint
        model = config_from_checkpoint(model)
    return model.max_position_embeddings


def router_context(cfg: RunConfig) -> RouterContext:
    """The cost model as step-time predictor of the prefill pool it routes
    over (a GPU preset on runtime=sim, this CPU's `testbed profile` tables on
    runtime=real) and the link to the store."""
    from testbed.sim.cost_model import CostModel
    from testbed.sim.link_model import LinkModel
    link = LinkModel(cfg.link)
    cost = CostModel(cfg.model, cfg.hardware, pool_parallel(cfg, "prefill"), cfg.engine)
    return RouterContext(cost, link.transfer_time_s,
                         cfg.model.kv_bytes_per_token, pool_config(cfg, "prefill").token_budget)


def hybrid_threshold(cfg: RunConfig) -> int:
    """hybrid.threshold, or with `auto` the decision study's L* for this
    model, hardware, link and GPU count (modes/hybrid_threshold.py)."""
    h = cfg.hybrid
    if h.threshold != HYBRID_AUTO:
        return h.threshold
    threshold, note = threshold_from_summary(h.decision_summary, cfg.model.name, cfg.hardware.name, cfg.link.name,
                                             num_gpus(cfg), h.slo, cfg.slo.tpot_ms)
    print(note, file=sys.stderr)
    return threshold


def build_mode(cfg: RunConfig) -> Mode:
    """The run's mode, checked (Mode.check) before any worker is built."""
    mode = get_mode(cfg.mode, mode_settings(cfg))
    mode.check()
    return mode


def num_gpus(cfg: RunConfig) -> int:
    """GPUs the deployment occupies: over its workers, tp x pp of each
    worker's pool (prefill.parallel, decode.parallel, else parallel)."""
    total = 0
    for _, role in get_mode(cfg.mode, mode_settings(cfg)).layout():
        p = pool_parallel(cfg, get_role(role).pool)
        total += p.tp * p.pp
    return total
