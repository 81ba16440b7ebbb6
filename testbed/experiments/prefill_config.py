"""The prefill studies' settings (prefill.py): `experiment=chunk_overhead`
(whole prefill against chunks) and `experiment=hybrid_batch` (one iteration of
decodes with a prompt's chunk), each on the cost model and the real engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.experiments.config import StudyConfig, at_least


@dataclass
class ChunkOverheadConfig(StudyConfig):
    name: str = "chunk_overhead"
    run = "testbed.experiments.prefill:run_chunk_overhead"
    # the cost model's grid
    models: list[str] = field(default_factory=lambda: ["llama3-8b"])
    hardware: list[str] = field(default_factory=lambda: ["h100-sxm"])
    context_lens: list[int] = field(default_factory=lambda: [2048, 4096, 8192, 16384])
    chunk_sizes: list[int] = field(default_factory=lambda: [512, 1024, 2048])
    # the real engine on this machine
    real: bool = True
    real_models: list[str] = field(default_factory=lambda: ["tiny", "mid"])
    real_context_lens: list[int] = field(default_factory=lambda: [2048, 4096])
    real_chunk_sizes: list[int] = field(default_factory=lambda: [512, 1024, 2048])
    real_max_tokens: int = 32768             # the largest prompt the real engine prefills here
    repeats: int = 2                         # timing repetitions per real measurement

    def validate(self) -> None:
        super().validate()
        at_least(self, 1, "chunk_sizes", "context_lens", "real_context_lens", "real_chunk_sizes", "repeats")


@dataclass
class HybridBatchConfig(ChunkOverheadConfig):
    name: str = "hybrid_batch"
    run = "testbed.experiments.prefill:run_hybrid_batch"
    context_lens: list[int] = field(default_factory=lambda: [4096, 16384])
    num_decodes: int = 16                    # running decodes in every batch
    decode_context_len: int = 1024           # each decode's context

    def validate(self) -> None:
        super().validate()
        at_least(self, 1, "num_decodes", "decode_context_len")
