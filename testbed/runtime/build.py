"""Builds a worker's engine from the run config: block manager, scheduler,
executor (a model for runtime=real, the cost model for runtime=sim)."""
from __future__ import annotations

from testbed.block_manager import BlockManager
from testbed.config import RunConfig
from testbed.engine import Clock, Engine
from testbed.executor import Executor
from testbed.request import Request, SamplingParams
from testbed.schedulers import SchedulerConfig, make_scheduler


def scheduler_config(cfg: RunConfig) -> SchedulerConfig:
    return SchedulerConfig(token_budget=cfg.token_budget, max_num_seqs=cfg.max_num_seqs,
                           max_num_batched_tokens=cfg.max_num_batched_tokens)


def build_engine(cfg: RunConfig, role: str, clock: Clock, executor_factory=None) -> Engine:
    """`executor_factory(block_table_fn) -> Executor`; default: the real model.

    Prefix caching is a prefill-side feature: a decode worker's blocks are
    reserved fresh and filled by transfer, and nothing there looks a prefix
    up, so hashing them would cost as much as on the prefill side for no hit."""
    bm = BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching and role != "decode")
    scheduler = make_scheduler(cfg.scheduler, scheduler_config(cfg), bm)
    if executor_factory is None:
        from testbed.model_executor import ModelExecutor
        executor: Executor = ModelExecutor(cfg.model, cfg.num_kv_blocks, cfg.block_size, bm.block_table,
                                           cfg.attention_backend, cfg.device)
    else:
        executor = executor_factory(bm.block_table)
    return Engine(scheduler, executor, clock, prefill_only=(role == "prefill"))


def apply_sampling(cfg: RunConfig, requests: list[Request]) -> None:
    """The run's sampling settings on every request (seeded per request)."""
    for r in requests:
        r.sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                                    ignore_eos=cfg.ignore_eos, eos_token_id=r.sampling.eos_token_id)
