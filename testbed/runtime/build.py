"""Builds a worker from the run config: block manager, scheduler (with its
context), executor (a model for runtime=real, the cost model for runtime=sim),
engine, and the WorkerService of its role (modes/registry.py). Both runtimes
build their workers here and nowhere else."""
from __future__ import annotations

import copy

from testbed.block_manager import BlockManager
from testbed.config import RunConfig
from testbed.engine import Clock, Engine
from testbed.executor import Executor
from testbed.modes.registry import get_role
from testbed.request import Request, SamplingParams
from testbed.runtime.kv_port import KVPort
from testbed.runtime.store_port import StorePort
from testbed.schedulers import SchedulerConfig, SchedulerContext, make_scheduler, scheduler_class
from testbed.schedulers.budget import resolve_token_budget
from testbed.sim.config import ParallelConfig
from testbed.worker import Emit, WorkerService


def pool_parallel(cfg: RunConfig, pool: str | None) -> ParallelConfig:
    """The parallel config of a worker of `pool` (a WorkerService.pool: a
    PoolConfig section of the run config, or None for the run's own)."""
    own = getattr(cfg, pool).parallel if pool is not None else None
    return own if own is not None else cfg.parallel


def pool_config(cfg: RunConfig, pool: str | None) -> RunConfig:
    """The run config a worker of `pool` is built with: the run's, with the
    pool's parallel config, token budget and scheduler where it sets them, and
    (num_kv_blocks=auto) the KV blocks that one GPU of that split holds."""
    own = getattr(cfg, pool) if pool is not None else None
    changes = {"parallel": pool_parallel(cfg, pool)}
    if own is not None and own.token_budget is not None:
        changes["token_budget"] = own.token_budget
    if own is not None and own.scheduler is not None:
        changes["scheduler"] = own.scheduler
    if all(getattr(cfg, k) == v for k, v in changes.items()):
        return cfg
    out = copy.copy(cfg)
    for k, v in changes.items():
        setattr(out, k, v)
    if getattr(cfg, "num_kv_blocks_from_memory", False):      # activations grow with the budget
        own_parallel = own is not None and own.parallel is not None
        out.num_kv_blocks = out.kv_blocks_from_memory(out.parallel, f"{pool}.parallel" if own_parallel else "parallel")
    return out


def scheduler_config(cfg: RunConfig) -> SchedulerConfig:
    """`token_budget=auto` becomes its int here (budget.py), once per worker."""
    token_budget = resolve_token_budget(cfg.token_budget, lambda: predictor(cfg), cfg.slo.tpot_ms,
                                        cfg.max_num_seqs, cfg.adaptive)
    return SchedulerConfig(token_budget=token_budget, max_num_seqs=cfg.max_num_seqs,
                           max_num_batched_tokens=cfg.max_num_batched_tokens, settings=cfg.adaptive)


def predictor(cfg: RunConfig):
    """The step-time predictor policies plan with: the cost model of cfg.hardware
    (a GPU preset on runtime=sim, the `testbed profile` tables on runtime=real)."""
    from testbed.sim.cost_model import CostModel
    return CostModel(cfg.model, cfg.hardware, cfg.parallel, cfg.engine)


def scheduler_context(cfg: RunConfig, clock: Clock) -> SchedulerContext:
    """The one place a policy's context is made, for real and sim alike."""
    needs = scheduler_class(cfg.scheduler).needs_predictor
    return SchedulerContext(clock, cfg.slo.ttft_ms, cfg.slo.tpot_ms, predictor(cfg) if needs else None)


def cuda_graph_sizes(cfg: RunConfig) -> list[int]:
    """The decode batch sizes the real executor captures as CUDA graphs: the one
    place that reads cfg.cuda_graphs and cfg.cuda_graph_sizes. [] (eager) on the CPU."""
    if not cfg.cuda_graphs or cfg.device == "cpu":
        return []
    return sorted(set(cfg.cuda_graph_sizes))


def build_engine(cfg: RunConfig, role: str, clock: Clock, executor_factory=None) -> Engine:
    """`executor_factory(block_table_fn) -> Executor`; default: the real model.
    The role's class says whether its blocks are hashed for prefix reuse and
    whether requests leave after their first token."""
    worker_cls = get_role(role)
    cfg = pool_config(cfg, worker_cls.pool)
    bm = BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching and worker_cls.prefix_caching)
    scheduler = make_scheduler(cfg.scheduler, scheduler_config(cfg), bm, scheduler_context(cfg, clock))
    if executor_factory is None:
        from testbed.model_executor import ModelExecutor
        executor: Executor = ModelExecutor(cfg.model, cfg.num_kv_blocks, cfg.block_size, bm.block_table,
                                           cfg.attention_backend, cfg.device, cuda_graph_sizes(cfg))
    else:
        executor = executor_factory(bm.block_table)
    return Engine(scheduler, executor, clock, prefill_only=worker_cls.prefill_only)


def build_worker(worker_id: str, role: str, engine: Engine, emit: Emit, kv_port: KVPort | None,
                 layerwise: bool, store: StorePort | None = None) -> WorkerService:
    return get_role(role)(worker_id, engine, emit, kv_port, layerwise, store)


def apply_sampling(cfg: RunConfig, requests: list[Request]) -> None:
    """The run's sampling settings on every request (seeded per request)."""
    for r in requests:
        sampled(cfg, r)


def sampled(cfg: RunConfig, r: Request) -> Request:
    """`r` with the run's sampling settings (a lazy workload maps this over its requests)."""
    r.sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                                ignore_eos=cfg.ignore_eos, eos_token_id=r.sampling.eos_token_id)
    return r
