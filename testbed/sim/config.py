"""The physical inputs of `runtime=sim`: an accelerator (`HardwareConfig`), a
link (`LinkConfig`) and how one model replica is split over accelerators
(`ParallelConfig`); the serving software is engine_config.py's. The cost model (cost_model.py) turns a batch into seconds
from a ModelConfig and these; the link model (link_model.py) turns bytes into
seconds. Presets are YAML files in conf/hardware/, conf/link/, conf/parallel/;
`testbed profile` (profile.py) writes a measured HardwareConfig for this CPU.

Plain types only (Hydra structured configs). Fields without a default must
come from a preset: there is no sensible default accelerator."""
from __future__ import annotations

import copy
from dataclasses import MISSING as MISSING_FIELD, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Optional

from testbed.model.config import CONF_DIR
from testbed.preset_yaml import load_yaml
from testbed.sim.timers import ATTENTION_COLUMNS


@dataclass
class HardwareConfig:
    """One accelerator. Units: TFLOP/s, GB/s (1e9 bytes/s), GiB, ms."""
    name: str
    peak_tflops: float                    # dense bf16/fp16 tensor-core peak
    peak_tflops_fp32: float               # dense fp32 peak (the dtype of the CPU models)
    hbm_bw_gbps: float                    # memory bandwidth, GB/s
    memory_gib: float
    compute_efficiency: float             # achieved fraction of peak on large GEMMs
    memory_efficiency: float              # achieved fraction of hbm_bw_gbps when streaming
    peak_tflops_fp8: float = 0.0          # 0: the chip has no fp8 tensor cores
    # A GEMM over m rows reaches m / (m + gemm_ramp_tokens) of compute_efficiency:
    # tile and wave quantisation leave SMs idle on short GEMMs. This is what makes
    # 512-token chunks cost more per token than whole 4K prefills. 0: no ramp.
    gemm_ramp_tokens: float = 0.0
    # multiplies every modeled term but the overheads: `testbed profile` fits it
    # so that the kernels timed alone predict them inside the real engine (cold
    # caches, the machine's other processes); 1 on the GPU presets
    calibration_scale: float = 1.0
    # one way, frontend <-> worker process (the real runtime's loopback ZMQ
    # plus the receiver's wake-up), measured by `testbed profile`; 0 on the GPU
    # presets, whose serving frontend is not modeled
    frontend_hop_ms: float = 0.0
    # the frontend's own time per command (route, serialize, send): commands
    # leave one after another, so a burst reaches an idle worker spread out
    # and its first iteration may start with only the first request
    frontend_message_ms: float = 0.0
    # Measured tables (written by testbed.profiling.profile); when present the cost
    # model uses them instead of the roofline for the shapes they cover.
    gemm_profile: list[list[float]] = field(default_factory=list)       # rows [m, n, k, seconds]
    # rows [num_seqs, single_calls, batched_calls, flops, masked_flops, bytes, seconds] (timers.fit_attention)
    attention_profile: list[list[float]] = field(default_factory=list)
    # quantiles (evenly spaced probabilities, min to max) of a real step's time
    # minus the median time of the same batch, in ms: the machine's noise,
    # which sets p99 token gaps (testbed.sim.jitter); [] = none (GPU presets)
    step_jitter_ms: list[float] = field(default_factory=list)
    # Measured operator tables, from the profile dataset `operator_tables` names
    # (`testbed data list`; Vidur's layout, condensed on first use by
    # operator_table.tables_dir; "" = none, the roofline above):
    # gemm_table prices GEMMs and elementwise ops by shape from a GPU's table
    # ("h100", "a100"; transferred to this chip by the roofline ratio), and
    # allreduce_table prices TP all-reduces from a topology's ("h100_dgx", ...;
    # "" = the ring on parallel.intra_node). attention_kernel picks the attention
    # efficiency model ("triton", "flash_attn"; "" = the roofline), attention_kernels.py.
    operator_tables: str = ""
    gemm_table: str = ""
    allreduce_table: str = ""
    attention_kernel: str = ""
    # a measured dense bf16 matmul of 8192^3 on this chip, TFLOP/s (0: none):
    # when set, the tables' times are transferred to this chip by it against the
    # tables' own 8192^3 throughput, not by the datasheet peaks (gpu_tables.py)
    matmul_tflops_measured: float = 0.0
    # the blocks num_kv_blocks=auto means (0: what the memory holds after the
    # weights and activations at RunConfig.gpu_memory_utilization; sim/defaults.py)
    kv_blocks_default: int = 2048
    # where the preset's numbers come from (printed by `testbed run --cfg job`
    # and in summary.json)
    provenance: str = ""
    # the preset `testbed profile` measured the fields above for ("" if none):
    # they describe that machine only (see __post_init__)
    profiled_for: str = ""
    # the conditions the profile was measured under: torch threads per worker
    # process, and worker processes stepping at once (`testbed profile --workers`);
    # 0: not a CPU profile, or written before they were recorded
    profiled_threads: int = 0
    profiled_workers: int = 0

    def __post_init__(self) -> None:
        if self.profiled_for and self.profiled_for != self.name:
            # Hydra merges a preset (hardware=h100-sxm) over RunConfig's default
            # hardware, the cpu preset: the fields the GPU preset leaves unset
            # would keep this CPU's measurements. They are not the GPU's.
            for f in _MEASURED:
                setattr(self, f.name, f.default_factory() if f.default_factory is not MISSING_FIELD else f.default)
            self.profiled_for = ""
        self.validate()

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for a model dtype (ModelConfig.dtype)."""
        if dtype == "float32":
            return self.peak_tflops_fp32 * 1e12
        if dtype in ("bfloat16", "float16"):
            return self.peak_tflops * 1e12
        if dtype == "fp8":
            if self.peak_tflops_fp8 <= 0:
                raise ValueError(f"hardware.peak_tflops_fp8: '{self.name}' has no fp8 peak; run the model in "
                                 "bfloat16 (model.dtype, model.weight_dtype) or pick a chip with fp8 (h100-sxm, h200)")
            return self.peak_tflops_fp8 * 1e12
        raise ValueError(f"model.dtype: '{dtype}' has no peak on hardware '{self.name}'")

    def operator_tables_dir(self) -> Path:
        """The condensed tables gemm_table and allreduce_table are read from."""
        if not self.operator_tables:
            raise ValueError("hardware.operator_tables: not set, but gemm_table or allreduce_table is; name the "
                             "profile dataset they come from, e.g. hardware.operator_tables=vidur-profiles")
        from testbed.sim.operator_table import tables_dir
        return tables_dir(self.operator_tables, needed_by=f"hardware={self.name}")

    def validate(self) -> None:
        for f in ("peak_tflops", "peak_tflops_fp32", "hbm_bw_gbps", "memory_gib"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware.{f}: must be > 0, got {getattr(self, f)}")
        for f in ("compute_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"hardware.{f}: a fraction in (0, 1], got {getattr(self, f)}")
        if not self.calibration_scale > 0:
            raise ValueError(f"hardware.calibration_scale: must be > 0, got {self.calibration_scale}")
        from testbed.sim.attention_kernels import attention_kernel_names
        if self.attention_kernel and self.attention_kernel not in attention_kernel_names():
            raise ValueError(f"hardware.attention_kernel: '{self.attention_kernel}' is not known; choose one of: "
                             f"{', '.join(attention_kernel_names())} (or '' for the roofline)")
        if self.gemm_table or self.allreduce_table:
            # the dataset is checked here, so that a missing one stops the run at start-up
            from testbed.sim.operator_table import gpu_table_names, network_table_names
            tables = self.operator_tables_dir()
            if self.gemm_table and self.gemm_table not in gpu_table_names(tables):
                raise ValueError(f"hardware.gemm_table: '{self.gemm_table}' is not a GPU table of "
                                 f"{self.operator_tables}; choose one of: {', '.join(gpu_table_names(tables))} "
                                 "(or '' for the roofline)")
            if self.allreduce_table and self.allreduce_table not in network_table_names(tables):
                raise ValueError(f"hardware.allreduce_table: '{self.allreduce_table}' is not a known topology; "
                                 f"choose one of: {', '.join(network_table_names(tables))} (or '' for the ring on "
                                 "parallel.intra_node)")
        for f in ("profiled_threads", "profiled_workers"):
            if getattr(self, f) < 0:
                raise ValueError(f"hardware.{f}: must be >= 0 (0: not profiled), got {getattr(self, f)}")
        if self.kv_blocks_default < 0:
            raise ValueError(f"hardware.kv_blocks_default: must be >= 0 (0: from memory), got {self.kv_blocks_default}")
        for f in ("peak_tflops_fp8", "gemm_ramp_tokens", "matmul_tflops_measured", "frontend_hop_ms",
                  "frontend_message_ms"):
            if getattr(self, f) < 0:
                raise ValueError(f"hardware.{f}: must be >= 0, got {getattr(self, f)}")
        jitter = self.step_jitter_ms
        if jitter and (len(jitter) < 2 or any(b < a for a, b in zip(jitter, jitter[1:]))):
            raise ValueError(f"hardware.step_jitter_ms: expected [] or at least 2 non-decreasing quantiles "
                             f"(ms), got {list(jitter)[:5]}...; rerun `testbed profile`")
        for f, width in (("gemm_profile", 4), ("attention_profile", len(ATTENTION_COLUMNS))):
            for i, row in enumerate(getattr(self, f)):
                if len(row) != width or row[-1] <= 0:
                    raise ValueError(f"hardware.{f}[{i}]: expected {width} numbers ending in a positive "
                                     f"time in seconds, got {row}; rerun `testbed profile`")


_MEASURED = [f for f in fields(HardwareConfig) if f.name in (
    "calibration_scale", "frontend_hop_ms", "frontend_message_ms",
    "gemm_profile", "attention_profile", "step_jitter_ms", "profiled_threads", "profiled_workers")]


# Engine terms that hardware presets used to carry: an old config that sets
# hardware.X is told to set engine.Y instead (testbed/sim/config.py, cli_errors.py)
MOVED_FROM_HARDWARE = {
    "overhead_ms": "overhead_ms", "overhead_per_seq_ms": "overhead_per_seq_ms",
    "overhead_per_token_ms": "overhead_per_token_ms", "kernel_launch_us": "kernel_launch_us",
    "cuda_graphs": "cuda_graphs", "cuda_graph_max_tokens": "cuda_graph_sizes",
    "token_budget_default": "token_budget",
}


def moved_field_error(section: str, name: str) -> str | None:
    """The one-line error for an engine term set on the hardware, or None."""
    new = MOVED_FROM_HARDWARE.get(name)
    if new is None:
        return None
    return (f"{section}.{name}: the engine's term now lives in the engine preset; set engine.{new} "
            f"(conf/engine/, engine=testbed|vllm-v0|vllm-v1) instead")


@dataclass
class LinkConfig:
    """A point-to-point link. Bandwidth is per direction, in Gbit/s."""
    name: str
    bandwidth_gbps: float
    latency_us: float = 0.0               # one-way propagation, paid once per transfer
    per_message_us: float = 0.0           # per message: posting, completion, launch

    def __post_init__(self) -> None:
        self.validate()

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    def validate(self) -> None:
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"link.bandwidth_gbps: must be > 0 (Gbit/s), got {self.bandwidth_gbps}")
        for f in ("latency_us", "per_message_us"):
            if getattr(self, f) < 0:
                raise ValueError(f"link.{f}: must be >= 0, got {getattr(self, f)}")


@dataclass
class ParallelConfig:
    """How one model replica is split: Megatron tensor parallelism over `tp`
    GPUs joined by `intra_node`, and `pp` pipeline stages joined by `pp_link`
    (link preset names)."""
    tp: int = 1
    pp: int = 1
    intra_node: str = "nvlink"
    pp_link: Optional[str] = None         # None: the same link as intra_node

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in ("tp", "pp"):
            if getattr(self, f) < 1:
                raise ValueError(f"parallel.{f}: must be >= 1, got {getattr(self, f)}")
        for f in ("intra_node", "pp_link"):
            name = getattr(self, f)
            if name is not None and _preset_path("link", name) is None:
                raise ValueError(f"parallel.{f}: '{name}' is not a link preset; choose one of: "
                                 f"{', '.join(_preset_names('link'))} (or give the path of a .yaml file)")


def _preset_names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _preset_path(group: str, name_or_path: str) -> Path | None:
    """conf/GROUP/NAME.yaml, or the .yaml file given by its path; None where there is none."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = CONF_DIR / group / f"{name_or_path}.yaml"
    return path if path.exists() else None


def read_preset(path: Path) -> dict:
    """A preset file's values, parsed once per version of the file: runs resolve
    their engine and hardware per cost model."""
    stat = path.stat()
    return copy.deepcopy(_parsed(str(path), stat.st_mtime_ns, stat.st_size))


@lru_cache(maxsize=64)
def _parsed(path: str, mtime_ns: int, size: int) -> dict:
    return load_yaml(path) or {}


def _load(group: str, cls, name_or_path: str, overrides: dict):
    path = _preset_path(group, name_or_path)
    if path is None:
        raise ValueError(f"{group}='{name_or_path}' is not a known preset; choose one of: "
                         f"{', '.join(_preset_names(group))} (or give the path of a .yaml file)")
    raw = read_preset(path)
    raw.update(overrides)
    unknown = set(raw) - {f.name for f in fields(cls)}
    if unknown and cls is HardwareConfig:
        moved = next((e for e in map(lambda n: moved_field_error("hardware", n), sorted(unknown)) if e), None)
        if moved:
            raise ValueError(f"{path}: {moved}")
    if unknown:
        stale = " (a profile written by an older testbed: rerun `testbed profile`)" if raw.get("profiled_for") else ""
        raise ValueError(f"{path}: unknown field(s) {sorted(unknown)}{stale}")
    return cls(**raw)


def hardware_preset_names() -> list[str]:
    return _preset_names("hardware")


def link_preset_names() -> list[str]:
    return _preset_names("link")


def load_hardware_preset(name: str, **overrides) -> HardwareConfig:
    """conf/hardware/NAME.yaml (or a .yaml path, e.g. a fresh profile) as a HardwareConfig."""
    return _load("hardware", HardwareConfig, name, overrides)


def load_link_preset(name: str, **overrides) -> LinkConfig:
    """conf/link/NAME.yaml (or a .yaml path) as a LinkConfig."""
    return _load("link", LinkConfig, name, overrides)
