"""CrossoverConfig: `experiment=crossover` (crossover.py), the chunk re-read
tax against the KV transfer tax over a simulated grid, plus the real engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.experiments.config import StudyConfig, at_least


@dataclass
class CrossoverConfig(StudyConfig):
    name: str = "crossover"
    run = "testbed.experiments.crossover:run_crossover"
    # the simulator's grid
    models: list[str] = field(default_factory=lambda: ["llama3-8b", "llama2-70b", "yi-34b", "llama2-7b",
                                                       "deepseek-v2-lite"])
    hardware: list[str] = field(default_factory=lambda: ["a100-80gb-sxm", "h100-sxm", "h200"])
    links: list[str] = field(default_factory=lambda: ["tcp-25", "rdma-100", "rdma-200", "rdma-400", "nvlink"])
    chunk_sizes: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192])
    context_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536,
                                                             131072, 262144, 524288, 1048576])
    # the piggyback tax: B decodes at context decode_context_len in every chunk's batch
    piggyback_decodes: list[int] = field(default_factory=lambda: [0, 8, 32, 128])
    decode_context_len: int = 1024
    # the real engine on this machine
    real: bool = True
    real_models: list[str] = field(default_factory=lambda: ["tiny"])
    real_context_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    real_chunk_sizes: list[int] = field(default_factory=lambda: [512, 2048])
    real_transports: list[str] = field(default_factory=lambda: ["zmq", "torch_dist"])
    real_link_gbps: list[float] = field(default_factory=lambda: [25.0])   # shaped links emulated on loopback
    real_max_tokens: int = 32768             # the largest prompt the real engine prefills here
    repeats: int = 3                         # timing repetitions per real measurement

    def validate(self) -> None:
        super().validate()
        at_least(self, 1, "chunk_sizes", "context_lens", "real_context_lens", "real_chunk_sizes",
                 "decode_context_len", "repeats")
        if not self.piggyback_decodes or any(b < 0 for b in self.piggyback_decodes):
            raise ValueError(f"experiment.piggyback_decodes: a non-empty list of decode counts >= 0, got "
                             f"{self.piggyback_decodes}")
