"""The executor interface: run one `Batch`, return a `StepResult`. The real
executor (testbed/model_executor.py) runs the model over the paged KV cache;
the simulator's (testbed/sim/) asks the cost model how long the batch takes."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from testbed.batch import Batch, StepResult

LayerHook = Callable[[int], None]


class Executor(ABC):
    kv_bytes_per_token: int

    @abstractmethod
    def execute(self, batch: Batch, on_layer_done: LayerHook | None = None) -> StepResult:
        """Compute the batch's slices (KV written into each request's blocks)
        and sample a token for every slice that brings its request up to date."""

    def kv_bytes_read(self, batch: Batch) -> int:
        """Attention reads each request's whole context (cached prefix and the
        new tokens) in every layer: a chunked prompt re-reads its prefix once per chunk."""
        return sum(s.end for s in batch.slices) * self.kv_bytes_per_token
