"""RunConfig: the typed root of every Hydra config (conf/config.yaml).

Every default lives in these dataclasses exactly once; YAML files only set
values. `validate()` runs at start-up, before any process starts, and raises
one clear error that names the field and the fix."""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from testbed.data.config import DataConfig
from testbed.experiments.config import StudyConfig
from testbed.kv_transfer.config import TransferConfig, timeout_problem
from testbed.kv_transfer.store_config import KVStoreConfig
from testbed.launchers.config import RayConfig
from testbed.model.config import ModelConfig
from testbed.modes.hybrid_config import HybridConfig
from testbed.pool_config import POOLS, ParallelOverride, PoolConfig
from testbed.schedulers.adaptive_config import AdaptiveConfig
from testbed.sim.config import HardwareConfig, LinkConfig, ParallelConfig, load_hardware_preset, load_link_preset
from testbed.sim.engine_overhead import VLLM_CUDA_GRAPH_SIZES
from testbed.sim.engine_config import EngineConfig, resolve_engine
from testbed.workloads.config import WorkloadConfig

RUNTIMES = ("real", "sim")
AUTO = "auto"
ADAPTIVE = "adaptive"       # the scheduler whose settings are the `adaptive` section


@dataclass
class RuntimeConfig:
    """`runtime=real|sim` picks the preset (conf/runtime/); `runtime.host` is
    the address the frontend binds and workers reach it on."""
    name: str = "real"             # real | sim
    host: str = "127.0.0.1"
    # CURVE keys generated per run for every socket the frontend and the KV receivers bind;
    # required (a bind is refused without them) when runtime.host or transfer.host is not loopback
    curve: bool = False
    # liveness, both ways (runtime=real): the frontend pings every worker each heartbeat_s and
    # each answers between steps; inside a step that computes it says Busy each heartbeat_s
    # instead (runtime/step_watch.py), so a step may be longer than hang_timeout_s; a worker
    # silent for hang_timeout_s (stopped, or blocked without computing) is killed and its
    # requests fail; a worker that hears nothing from the frontend for frontend_timeout_s
    # (the frontend was killed) exits by itself
    heartbeat_s: float = 1.0
    hang_timeout_s: float = 60.0
    frontend_timeout_s: float = 15.0
    # runtime=sim: a worker that nothing can reach before its next iteration ends runs its
    # iterations back to back, steady decode batches on a short path (runtime/sim.py); the
    # outputs are the same either way (tests/test_sim_fast_forward.py)
    sim_fast_forward: bool = True
    # once a run has written this many iteration records, a process of its own encodes and
    # writes requests.jsonl and iterations.jsonl (testbed/record_writer.py: the same bytes, on
    # another core); null: always this process
    record_writer_after: int | None = 100_000
    # runtime=sim: simulate a colocated round-robin run's replicas in this many processes, in
    # groups, and merge their records into the run's (runtime/sim_split.py: the same files and
    # summary as one process); auto: one per CPU this process may run on. A run it does not
    # apply to says why and runs in one process
    sim_processes: Any = 1

    def validate(self) -> None:
        n = self.sim_processes
        if n != AUTO and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"runtime.sim_processes: must be an integer >= 1 or auto, got {n!r}; "
                             "1 simulates in this process, N splits a colocated run's replicas over N")
        if self.record_writer_after is not None and self.record_writer_after < 0:
            raise ValueError(f"runtime.record_writer_after: must be >= 0 or null, got {self.record_writer_after}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"runtime.heartbeat_s: must be > 0, got {self.heartbeat_s}")
        for f in ("hang_timeout_s", "frontend_timeout_s"):
            if getattr(self, f) <= 2 * self.heartbeat_s:
                raise ValueError(f"runtime.{f}: must exceed two heartbeats (runtime.heartbeat_s="
                                 f"{self.heartbeat_s}), got {getattr(self, f)}; raise it or lower the heartbeat")
        # a worker's event socket gives up on the frontend after it (zmq's SNDTIMEO)
        if problem := timeout_problem(self.frontend_timeout_s):
            raise ValueError(f"runtime.frontend_timeout_s: {problem}")

    def num_sim_processes(self) -> int:
        """sim_processes, auto resolved to the CPUs this process may run on."""
        return len(os.sched_getaffinity(0)) if self.sim_processes == AUTO else self.sim_processes


@dataclass
class SLOConfig:
    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0

    def validate(self) -> None:
        for f in ("ttft_ms", "tpot_ms"):
            if not getattr(self, f) > 0:
                raise ValueError(f"slo.{f}: must be > 0 (ms), got {getattr(self, f)}")


@dataclass
class WandbConfig:
    mode: str = "offline"          # offline | online | disabled
    project: str = "pd-testbed"
    entity: str | None = None
    group: str | None = None       # a sweep's points default to the sweep (testbed/sweep_names.py)
    name: str | None = None        # None: a sweep point's overrides, else mode-scheduler-model-workload


@dataclass
class RunConfig:
    mode: str = "colocated"        # a name in modes.registry.MODES: colocated | disagg | kvstore | hybrid
    # request_level | vllm_v0 | orca | sarathi | adaptive; None: the engine's (sarathi; vllm_v0 for engine=vllm-v0)
    scheduler: str | None = None
    # two budgets because they bound different things: token_budget caps every token of a
    # chunking policy's iteration (decodes included; a prompt is cut to fit), while
    # max_num_batched_tokens caps the whole prompts a whole-prefill policy admits together
    # None: the hardware's default; "auto": derived from slo.tpot_ms and the cost model (sarathi)
    token_budget: int | str | None = None   # sarathi / adaptive: tokens per iteration
    max_num_seqs: int | None = None     # None: the engine's (64 for the testbed engine, 256 for vLLM's)
    max_num_batched_tokens: int = 8192   # whole-prefill schedulers: prompt tokens per iteration
    num_kv_blocks: Any = "auto"    # KV memory per worker, in blocks; auto: testbed/sim/defaults.py
    gpu_memory_utilization: float = 0.9   # num_kv_blocks=auto: the share of the accelerator's memory used
    block_size: int | None = None       # None: the engine's (16)
    enable_prefix_caching: bool = True
    attention_backend: str = "torch"
    device: str = "cpu"
    # runtime=real on CUDA: decode-only steps of up to max(cuda_graph_sizes) requests replay a
    # CUDA graph captured for the next of these batch sizes (testbed/model/cuda_graphs.py);
    # other steps, and every step on the CPU, run eagerly ([] or false: always eager)
    cuda_graphs: bool = True
    cuda_graph_sizes: list[int] = field(default_factory=lambda: list(VLLM_CUDA_GRAPH_SIZES))
    torch_threads: int = 1         # per worker process; 2 cores here, so 1 each
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = True
    launcher: str = "local"        # runtime=real: where worker processes run (testbed/launchers/)
    # colocated
    replicas: int = 1
    router: str = "round_robin"    # a name in modes.routers.ROUTERS
    # disagg
    prefill_workers: int = 1
    decode_workers: int = 1
    prefill_router: str = "least_prompt_tokens"
    decode_router: str = "most_free_blocks"
    # each pool's own split of the model (None: `parallel`), testbed/pool_config.py
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)     # mode=hybrid
    timeout_s: float = 120.0       # a run (or a worker that stops answering) fails after this
    progress: bool = True
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    kvstore: KVStoreConfig = field(default_factory=KVStoreConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    # scheduler=adaptive's settings: present only where a worker runs it (the scheduler=adaptive preset
    # adds them; a pool's scheduler=adaptive gets the defaults); token_budget=auto reads them too
    adaptive: Optional[AdaptiveConfig] = None
    # the presets conf/config.yaml selects (hardware=NAME, link=NAME)
    # Hydra merges the chosen preset over this default; measured tables only count for
    # the preset named in their profiled_for, so cpu.yaml's never leak into a GPU's
    hardware: HardwareConfig = field(default_factory=lambda: load_hardware_preset("cpu"))
    link: LinkConfig = field(default_factory=lambda: load_link_preset("tcp-25"))
    # the serving engine `runtime=sim` prices (engine=NAME, conf/engine/); auto: the
    # hardware's default (testbed on a profiled CPU, vllm-v1 on a GPU), resolved where
    # it is priced, so a config whose hardware is replaced gets the new hardware's
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    ray: RayConfig = field(default_factory=RayConfig)      # launcher=ray
    experiment: Optional[StudyConfig] = None     # experiment=NAME: that study's settings (experiments/studies.py)
    # where datasets are read from (testbed/data/); the command line applies it before the
    # config objects are built (testbed.data.config.use_data_dir)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        for name in POOLS:
            getattr(self, name).resolve(name, self.parallel)
        if self.adaptive is None and ADAPTIVE in self.schedulers():
            self.adaptive = AdaptiveConfig()
        self.hardware_defaults_note = self._resolve_hardware_defaults()    # not a field: the run header's line

    def _resolve_hardware_defaults(self) -> str:
        """The knobs whose defaults follow the hardware, once: the serving
        defaults of its engine (scheduler, token_budget: 256 for this CPU's
        testbed engine, 2,048 for vLLM's online serving; max_num_seqs,
        block_size) and num_kv_blocks=auto
        (hardware.kv_blocks_default, or where that is 0 the KV memory left
        after weights and activations: testbed/sim/defaults.py). An explicit
        value always wins. Returns what was chosen ('' if both were given)."""
        notes = []
        unset = [f for f in ("scheduler", "token_budget", "max_num_seqs", "block_size") if getattr(self, f) is None]
        if unset:
            engine = self.run_engine()
            for f in unset:
                setattr(self, f, getattr(engine, f))
            notes.append(" ".join(f"{f}={getattr(self, f)}" for f in unset) + f" (engine {engine.name}'s defaults)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: a fraction in (0, 1], got {self.gpu_memory_utilization}")
        if not isinstance(self.block_size, int) or self.block_size < 1:     # num_kv_blocks=auto divides by it
            raise ValueError(f"block_size: must be an integer >= 1 (tokens per KV block; 16 is the usual value), "
                             f"got {self.block_size}")
        # not a field: a pool with its own parallel config re-derives its blocks (runtime/build.py)
        self.num_kv_blocks_from_memory = self.num_kv_blocks == AUTO and not self.hardware.kv_blocks_default
        if self.num_kv_blocks == AUTO:
            if self.hardware.kv_blocks_default:
                self.num_kv_blocks = self.hardware.kv_blocks_default
                notes.append(f"num_kv_blocks=auto -> {self.num_kv_blocks} ({self.hardware.name}'s default)")
            elif users := self._run_parallel_users():
                try:
                    self.num_kv_blocks = self.kv_blocks_from_memory(self.parallel)
                except ValueError as e:
                    if None in users:      # colocated replicas: the run's split is theirs
                        raise
                    pools = " and ".join(f"{p} pool" for p in users)
                    raise ValueError(f"{e}; the {pools} runs with it (or give it a split of its own: "
                                     f"{users[0]}.parallel.tp=N)") from None
                notes.append(f"num_kv_blocks=auto -> {self.num_kv_blocks} (the KV memory left after weights and "
                             f"activations at gpu_memory_utilization={self.gpu_memory_utilization})")
            else:
                # every worker's pool splits the model its own way and sizes its own KV
                # (runtime/build.py), so the run's `parallel` need not fit: a 70B model
                # with both pools at tp=4 runs under the default parallel.tp=1. What stands
                # here is the least that a worker holds (the decision study's never-fit share)
                self.num_kv_blocks = min(self.kv_blocks_from_memory(getattr(self, p).parallel, f"{p}.parallel",
                                                                    getattr(self, p).token_budget) for p in POOLS)
                notes.append(f"num_kv_blocks=auto -> each pool's own, from its parallel config (the KV memory left "
                             f"after weights and activations at gpu_memory_utilization={self.gpu_memory_utilization})")
        elif isinstance(self.num_kv_blocks, (str, bool)):
            raise ValueError(f"num_kv_blocks: expected a number of blocks or 'auto', got '{self.num_kv_blocks}'")
        return "; ".join(notes)

    def schedulers(self) -> set[str]:
        """The schedulers this run's workers may run: the run's and each pool's own."""
        return {self.scheduler} | {getattr(self, p).scheduler for p in POOLS if getattr(self, p).scheduler}

    def run_engine(self) -> EngineConfig:
        """The engine this run's hardware runs (engine=auto resolved)."""
        return resolve_engine(self.engine, self.hardware)

    def _run_parallel_users(self) -> list[str | None]:
        """The pools of this mode whose workers run with the run's own `parallel`:
        None for the roles outside the P/D pools (colocated replicas), and each
        pool that sets no parallel config of its own. An unknown mode counts as
        colocated (validate names it)."""
        from testbed.modes.registry import MODES
        pools = MODES[self.mode].pools if self.mode in MODES else (None,)
        return [p for p in pools if p is None or getattr(self, p).parallel is None]

    def kv_blocks_from_memory(self, parallel: ParallelConfig, field: str = "parallel",
                              token_budget: int | str | None = None) -> int:
        """num_kv_blocks=auto for one GPU of a replica split as `parallel` (the config section `field`),
        whose iterations take up to `token_budget` tokens (None: the run's)."""
        from testbed.sim.defaults import kv_blocks_from_memory
        budget = self.token_budget if token_budget is None else token_budget
        max_tokens = max(budget if isinstance(budget, int) else 0, self.max_num_batched_tokens)
        return kv_blocks_from_memory(self.model, self.hardware, parallel, self.block_size,
                                     self.gpu_memory_utilization, max_tokens, self.max_num_seqs, field)


def _one_of(field_name: str, value: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"{field_name}='{value}' is not known; choose one of: {', '.join(sorted(choices))}")


def _check_device(device: str, launcher: str) -> None:
    """runtime=real's device: cpu or cuda[:N], and a CUDA GPU where the workers
    start on this machine (launcher=local)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device: '{device}' is not one the engine runs on; use cpu or cuda (cuda:N for one GPU)")
    if device != "cpu" and launcher == "local":
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"device: '{device}', but torch {torch.__version__} sees no CUDA GPU on this machine; "
                             "use device=cpu")


def _check_cuda_graphs(cfg: RunConfig) -> None:
    if any(not isinstance(n, int) or n < 1 for n in cfg.cuda_graph_sizes):
        raise ValueError(f"cuda_graph_sizes: decode batch sizes >= 1, got {list(cfg.cuda_graph_sizes)}")
    if cfg.cuda_graphs and cfg.cuda_graph_sizes and cfg.device != "cpu" and cfg.attention_backend == "torch":
        # its graph path pads every decode to the whole cache (kernels/torch_backend.py)
        raise ValueError("cuda_graphs: attention_backend=torch cannot replay decodes on a GPU; choose "
                         "attention_backend=triton (or flash_attn), or cuda_graphs=false")


def _check_local_paths(cfg: RunConfig) -> None:
    """What the worker and store processes will read or make on this machine
    (launcher=local; under Ray the paths are the worker nodes'), checked before
    any starts: the checkpoint's config.json, and the KV store's disk tier
    directory (kv_transfer/store_service.py makes it if missing)."""
    if cfg.model.path:
        from testbed.model.loader import config_from_checkpoint
        config_from_checkpoint(cfg.model)
    disk = cfg.kvstore.disk_path
    if cfg.kvstore.disk_capacity_bytes and os.path.exists(disk) and not os.path.isdir(disk):
        raise ValueError(f"kvstore.disk_path: '{disk}' is a file, not a directory; name a directory for "
                         "the disk tier's files (the store creates it if missing)")


def validate(cfg: RunConfig) -> None:
    from testbed.launchers import LAUNCHERS
    from testbed.modes.registry import MODES
    from testbed.modes.routers import ROUTERS
    from testbed.schedulers import SCHEDULERS
    _one_of("mode", cfg.mode, MODES)
    _one_of("runtime", cfg.runtime.name, RUNTIMES)
    _one_of("launcher", cfg.launcher, LAUNCHERS)
    _one_of("scheduler", cfg.scheduler, SCHEDULERS)
    for f in ("router", "prefill_router", "decode_router"):
        _one_of(f, getattr(cfg, f), ROUTERS)
    _one_of("kvstore.prefill_router", cfg.kvstore.prefill_router, ROUTERS)
    from testbed.modes.hybrid_router import HYBRID_ROUTERS
    _one_of("hybrid.router", cfg.hybrid.router, HYBRID_ROUTERS)
    if not cfg.runtime.host:
        raise ValueError(f"runtime.host: must name an address to bind, e.g. {RuntimeConfig.host}")
    if cfg.runtime.name == "real":      # (the registry imports torch; the simulator never needs it)
        from testbed.kernels.attention import attention_backend_names
        _one_of("attention_backend", cfg.attention_backend, attention_backend_names())
        _check_device(cfg.device, cfg.launcher)
        _check_cuda_graphs(cfg)
        if cfg.launcher == "local":
            _check_local_paths(cfg)
    _one_of("wandb.mode", cfg.wandb.mode, ("offline", "online", "disabled"))
    from testbed.schedulers.budget import check_token_budget
    check_token_budget(cfg.token_budget)
    for f in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
              "replicas", "prefill_workers", "decode_workers", "torch_threads"):
        if getattr(cfg, f) < 1:
            raise ValueError(f"{f}: must be >= 1, got {getattr(cfg, f)}")
    if cfg.timeout_s <= 0:
        raise ValueError(f"timeout_s: must be > 0, got {cfg.timeout_s}")
    if not cfg.temperature >= 0.0:
        raise ValueError(f"temperature: must be >= 0 (0: greedy), got {cfg.temperature}")
    if not 0.0 < cfg.top_p <= 1.0:
        raise ValueError(f"top_p: must be in (0, 1], got {cfg.top_p}")
    for sub in (cfg.runtime, cfg.model, cfg.workload, cfg.transfer, cfg.kvstore, cfg.hardware, cfg.engine,
                cfg.link, cfg.parallel, cfg.experiment, cfg.adaptive, cfg.ray, cfg.hybrid, cfg.slo, cfg.data):
        if sub is not None:
            sub.validate()
    if cfg.transfer.lease_s <= 2 * cfg.runtime.heartbeat_s:
        # the heartbeat renews the leases of what the frontend still counts on
        raise ValueError(f"transfer.lease_s: must exceed two heartbeats (runtime.heartbeat_s="
                         f"{cfg.runtime.heartbeat_s}), got {cfg.transfer.lease_s}; raise it or lower the heartbeat")
    for name in POOLS:
        getattr(cfg, name).validate(name)
        if cfg.runtime.name == "real":
            getattr(cfg, name).check_runs_on_real_engine(name)


def register_configs() -> None:
    """The schema conf/config.yaml's presets are merged over: RunConfig's
    defaults, except that its hardware (the cpu preset) leaves out the measured
    tables. Hydra copies and merges the schema node by node several times per
    run (~0.15 s of start-up for cpu.yaml's tables), and they never reach a
    config: hardware=cpu sets its own, and any other preset has them reset as
    not profiled for it (HardwareConfig.__post_init__)."""
    schema = RunConfig()
    schema.token_budget, schema.num_kv_blocks = None, "auto"      # resolved per run, after the presets merge
    schema.scheduler = schema.max_num_seqs = schema.block_size = None
    schema.hardware = dataclasses.replace(schema.hardware, gemm_profile=[], attention_profile=[], step_jitter_ms=[])
    for name in POOLS:     # settable field by field from the command line (pool_config.py)
        setattr(schema, name, PoolConfig(parallel=ParallelOverride()))
    store = ConfigStore.instance()
    store.store(name="run_schema", node=schema)
    from testbed.experiments.studies import STUDIES
    for name, study in STUDIES.items():     # conf/experiment/NAME.yaml: `- /study/NAME@experiment`
        store.store(group="study", name=name, node=study)
    from testbed.schedulers import SCHEDULERS
    for name in SCHEDULERS:                 # scheduler=NAME; adaptive's brings its settings
        node = {"scheduler": name, ADAPTIVE: AdaptiveConfig} if name == ADAPTIVE else {"scheduler": name}
        store.store(group="scheduler", name=name, package="_global_", node=node)
    register_resolvers()


def register_resolvers() -> None:
    """conf/config.yaml's resolvers: `or_engine` writes a knob the engine
    will set as 'engine'; `dir_safe` names a sweep point's directory by its overrides
    with each '/' of a value (a path: workload.trace_path, experiment.probe_cache) as '_', and cut
    with a hash past 200 bytes (sweep_names.py); Hydra's override_dirname keeps the '/', and the
    point's files went into directories named by the path's parts."""
    from omegaconf import OmegaConf
    from testbed.sweep_names import dir_safe
    OmegaConf.register_new_resolver("dir_safe", dir_safe, replace=True)
    # a knob left to the engine's default is still None while Hydra names the run's directory
    OmegaConf.register_new_resolver("or_engine", lambda value: "engine" if value is None else value, replace=True)


def to_dict(cfg: RunConfig) -> dict:
    from omegaconf import OmegaConf
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def from_dict(d: dict) -> RunConfig:
    """A RunConfig from plain values (worker processes, tests), type-checked
    against the schema like a Hydra config. A dict that names its hardware
    gets a schema built on it, not on the cpu preset: `testbed profile` runs
    real workers while it replaces that preset, which may be stale."""
    from omegaconf import OmegaConf
    hardware, engine = d.get("hardware"), d.get("engine")
    if isinstance(hardware, dict):
        hardware = HardwareConfig(**hardware)
    if isinstance(hardware, HardwareConfig):
        # the run's own engine too: the schema resolves the engine's defaults for this hardware
        engine = EngineConfig(**engine) if isinstance(engine, dict) else EngineConfig()
        schema = RunConfig(hardware=hardware, engine=engine)
    else:
        schema = RunConfig
    node = OmegaConf.structured(schema)
    for name in POOLS:      # as register_configs: a pool's unset fields follow `parallel`
        node[name].parallel = ParallelOverride()
    if isinstance(d.get("experiment"), dict):      # the study's own schema, by its name
        from testbed.experiments.studies import study_config
        node.experiment = OmegaConf.structured(study_config(d["experiment"].get("name")))
    return OmegaConf.to_object(OmegaConf.merge(node, d))
