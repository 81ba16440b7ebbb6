"""The executor interface: run one `Batch`, return a `StepResult`. The real
executor (testbed/model_executor.py) runs the model over the paged KV cache;
the simulator's (testbed/sim/) asks the cost model how long the batch takes."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterator

from testbed.batch import Batch, ScheduledSlice, StepResult
from testbed.request import Request

LayerHook = Callable[[int], None]


class Executor(ABC):
    kv_bytes_per_token: int

    @abstractmethod
    def execute(self, batch: Batch, on_layer_done: LayerHook | None = None) -> StepResult:
        """Compute the batch's slices (KV written into each request's blocks)
        and sample a token for every slice that brings its request up to date."""

    def execute_decodes(self, requests: list[Request]) -> tuple[list[int], float, int]:
        """execute() of a batch of one decode per request (the simulator's
        steady decodes, testbed/runtime/sim_decode_run.py): the sampled tokens
        in request order, the duration and the KV bytes read."""
        result = self.execute(Batch([ScheduledSlice(r, 1) for r in requests]))
        return ([result.sampled[r.request_id] for r in requests], result.duration_s, result.kv_bytes_read)

    def decode_steps(self, requests: list[Request]) -> Iterator[tuple[list[int], float, int]]:
        """execute_decodes(requests) of successive iterations, each when every
        request has one more computed token than at the one before
        (a decode run, where nothing else changes between them)."""
        while True:
            yield self.execute_decodes(requests)

    def kv_bytes_read(self, batch: Batch) -> int:
        """Attention reads each request's whole context (cached prefix and the
        new tokens) in every layer: a chunked prompt re-reads its prefix once per chunk."""
        return sum(s.end for s in batch.slices) * self.kv_bytes_per_token
