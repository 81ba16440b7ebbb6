"""The serving engine that `runtime=sim` prices (`engine=NAME`, conf/engine/):
what belongs to the software rather than the accelerator. The same GPU runs
one iteration in different times under vLLM V0 (host work serialized with the
GPU, TP workers driven over Ray), vLLM V1 (CUDA graphs, host work overlapped,
custom all-reduce) and this project's eager engine.

An EngineConfig says: the host's time per iteration as a function of the
batch and TP (host_model, host_time.py); whether it adds to the GPU's time or
overlaps it; the cost of one eager kernel launch; which iterations replay
CUDA graphs and the sizes they are padded to; how TP collectives are done;
and the engine's serving defaults. The cost model (cost_model.py) applies it
through engine_overhead.py. `engine=auto` (the default) is `testbed` on a
profiled CPU and `vllm-v1` on the GPU presets.

Plain types only (a Hydra structured config, registered with the root's
schema in testbed/config.py)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from testbed.model.config import CONF_DIR

AUTO = "auto"
GPU_DEFAULT = "vllm-v1"
TP_COLLECTIVES = ("nccl", "custom_allreduce", "ray")
@dataclass
class EngineConfig:
    """One serving engine. Units: ms, µs, tokens."""
    name: str = AUTO
    # host time per iteration (host_time.py): "linear" is overhead_ms +
    # overhead_per_seq_ms · seqs + overhead_per_token_ms · tokens; "vidur-v0"
    # is vLLM V0's measured host time by batch and TP, fitted at first use
    # from the dataset named in `calibration`
    host_model: str = "linear"
    overhead_ms: float = 0.0
    overhead_per_seq_ms: float = 0.0
    overhead_per_token_ms: float = 0.0
    # true: the host prepares the next iteration while the GPU runs this one
    # (vLLM V1), so an iteration takes max(GPU, host); false: they add
    host_overlap: bool = False
    # the host's cost of one eager kernel launch: an eager iteration is no
    # faster than its launches
    kernel_launch_us: float = 0.0
    # CUDA graphs: iterations of up to max(cuda_graph_sizes) tokens replay a
    # captured graph (no launches), their GEMMs padded to the next captured
    # size; cuda_graph_mixed: prefill chunks too (V1's piecewise graphs, the
    # attention outside the graph), else decode-only iterations (V0)
    cuda_graphs: bool = False
    cuda_graph_sizes: list[int] = field(default_factory=list)
    cuda_graph_mixed: bool = False
    # TP all-reduce: "nccl" through the framework (the hardware's table or the
    # ring on the link), "custom_allreduce" inside the graph (latency priced
    # by allreduce_latency_us per call plus the link's bandwidth), "ray": nccl
    # plus the TP workers' Ray round trip per iteration (in the host model)
    tp_collective: str = "nccl"
    allreduce_latency_us: float = 0.0
    # the attention kernel this engine runs on a GPU ("" = the hardware's)
    attention_kernel: str = ""
    # serving defaults a run gets where it leaves them unset
    scheduler: str = "sarathi"
    token_budget: int = 256
    max_num_seqs: int = 64
    block_size: int = 16
    # the dataset the fitted terms come from ("" = none), and each term's source
    calibration: str = ""
    provenance: dict[str, str] = field(default_factory=dict)
    # the hardware preset `testbed profile` measured the linear host terms on
    # ("" if none): on other hardware they are not this engine's (for_hardware)
    profiled_for: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        from testbed.sim.host_time import HOST_MODELS
        if self.host_model not in HOST_MODELS:
            raise ValueError(f"engine.host_model: '{self.host_model}' is not known; choose one of: "
                             f"{', '.join(sorted(HOST_MODELS))}")
        if self.tp_collective not in TP_COLLECTIVES:
            raise ValueError(f"engine.tp_collective: '{self.tp_collective}' is not known; choose one of: "
                             f"{', '.join(TP_COLLECTIVES)}")
        for f in ("overhead_ms", "overhead_per_seq_ms", "overhead_per_token_ms", "kernel_launch_us",
                  "allreduce_latency_us"):
            if getattr(self, f) < 0:
                raise ValueError(f"engine.{f}: must be >= 0, got {getattr(self, f)}")
        sizes = list(self.cuda_graph_sizes)
        if self.cuda_graphs and (not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1):
            raise ValueError(f"engine.cuda_graph_sizes: with engine.cuda_graphs, the captured sizes in tokens, "
                             f"increasing and >= 1 (e.g. [1,2,4,8,16,32]), got {sizes}")
        for f in ("token_budget", "max_num_seqs", "block_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"engine.{f}: must be >= 1, got {getattr(self, f)}")
        from testbed.sim.attention_kernels import attention_kernel_names
        if self.attention_kernel and self.attention_kernel not in attention_kernel_names():
            raise ValueError(f"engine.attention_kernel: '{self.attention_kernel}' is not known; choose one of: "
                             f"{', '.join(attention_kernel_names())} (or '' for the hardware's)")
        if self.host_model != "linear" and not self.calibration:
            raise ValueError(f"engine.calibration: host_model '{self.host_model}' is fitted to a dataset; "
                             "name it (e.g. vidur-profiles)")

    def for_hardware(self, hardware_name: str) -> "EngineConfig":
        """This engine on `hardware_name`. A profile's linear host terms were
        measured with the launches inside them, so on its own machine there is
        no separate launch cost; on another they do not carry and are left out."""
        if not self.profiled_for:
            return self
        kept = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.profiled_for == hardware_name:
            kept.update(kernel_launch_us=0.0)
        else:
            kept.update(overhead_ms=0.0, overhead_per_seq_ms=0.0, overhead_per_token_ms=0.0, profiled_for="")
        return EngineConfig(**kept)

    def term_provenance(self) -> dict[str, str]:
        """Each term and where its value comes from ("stated" where the preset says nothing)."""
        terms = ("host_model", "host_overlap", "kernel_launch_us", "cuda_graphs", "tp_collective",
                 "attention_kernel", "scheduler")
        return {t: self.provenance.get(t, "stated") for t in terms} | {
            k: v for k, v in self.provenance.items() if k not in terms}


def engine_preset_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "engine").glob("*.yaml"))


def load_engine_preset(name: str, **overrides) -> EngineConfig:
    """conf/engine/NAME.yaml (or a .yaml path) as an EngineConfig."""
    from testbed.sim.config import _load
    return _load("engine", EngineConfig, name, overrides)


def default_engine_name(hardware) -> str:
    """`engine=auto` on `hardware`: the engine preset profiled for this
    machine (`testbed profile` writes one beside the hardware preset), else
    on a GPU preset (one with operator tables) vLLM V1, what GPU users run."""
    if hardware.profiled_for:
        from testbed.sim.config import read_preset
        for path in sorted((CONF_DIR / "engine").glob("*.yaml")):
            if read_preset(path).get("profiled_for") == hardware.name:
                return path.stem
        if not hardware.gemm_table:     # a CPU profile: its engine's terms were measured with it
            raise ValueError(f"engine=auto: no engine preset in conf/engine/ is profiled for hardware "
                             f"'{hardware.name}'; rerun `testbed profile`, or name one (engine=testbed)")
    return GPU_DEFAULT


def resolve_engine(engine: EngineConfig | None, hardware) -> EngineConfig:
    """The engine a run on `hardware` gets: `engine` (None or name=auto: the
    hardware's default), its linear host terms kept only where measured for it."""
    if engine is None or engine.name == AUTO:
        engine = load_engine_preset(default_engine_name(hardware))
    return engine.for_hardware(hardware.name)
