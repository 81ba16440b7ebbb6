"""ExperimentConfig: the `experiment` node of the run config. Empty `name`
means a plain run; otherwise `testbed run experiment=NAME` runs that study
(conf/experiment/NAME.yaml sets these values; `NAME-full` is the long sweep).
One flat dataclass: each study reads the fields it needs."""
from __future__ import annotations

from dataclasses import dataclass, field

EXPERIMENTS = ("crossover", "capacity", "stall", "chunk_overhead", "hybrid_batch")


@dataclass
class ExperimentConfig:
    name: str | None = None
    variant: str = "default"                 # default | full
    # the simulator's grid
    models: list[str] = field(default_factory=lambda: ["llama3-8b", "llama2-70b", "yi-34b", "llama2-7b",
                                                       "deepseek-v2-lite"])
    hardware: list[str] = field(default_factory=lambda: ["a100-80gb-sxm", "h100-sxm", "h200"])
    links: list[str] = field(default_factory=lambda: ["tcp-25", "rdma-100", "rdma-200", "rdma-400", "nvlink"])
    chunk_sizes: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192])
    context_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536,
                                                             131072, 262144, 524288, 1048576])
    # the real engine on this machine
    real: bool = True
    real_models: list[str] = field(default_factory=lambda: ["tiny", "mid"])
    real_context_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    real_chunk_sizes: list[int] = field(default_factory=lambda: [512, 2048])
    real_transports: list[str] = field(default_factory=lambda: ["zmq", "torch_dist"])
    real_link_gbps: list[float] = field(default_factory=lambda: [25.0])   # shaped links emulated on loopback
    real_max_tokens: int = 32768             # the largest prompt the real engine prefills here
    # serving studies (capacity, stall)
    schedulers: list[str] = field(default_factory=lambda: ["vllm_v0", "orca", "sarathi"])
    token_budgets: list[int] = field(default_factory=lambda: [512, 2048])
    disagg_splits: list[str] = field(default_factory=lambda: ["1P1D"])
    repeats: int = 3                         # timing repetitions per real measurement

    def validate(self) -> None:
        if self.name is not None and self.name not in EXPERIMENTS:
            raise ValueError(f"experiment.name='{self.name}' is not known; choose one of: {', '.join(EXPERIMENTS)}")
        for f in ("chunk_sizes", "context_lens", "real_context_lens", "real_chunk_sizes", "token_budgets"):
            if any(v < 1 for v in getattr(self, f)):
                raise ValueError(f"experiment.{f}: every value must be >= 1, got {getattr(self, f)}")
        if self.repeats < 1:
            raise ValueError(f"experiment.repeats: must be >= 1, got {self.repeats}")
