"""The simulator's executor: no forward pass, the cost model says how long the
batch takes. Sampled tokens are placeholders (0): the simulator measures
time, not text."""
from __future__ import annotations

from testbed.batch import Batch, StepResult
from testbed.executor import Executor, LayerHook
from testbed.sim.cost_model import CostModel


class CostModelExecutor(Executor):
    def __init__(self, cost_model: CostModel):
        self.cost_model = cost_model
        self.kv_bytes_per_token = cost_model.model.kv_bytes_per_token
        self.num_layers = cost_model.model.num_layers

    def execute(self, batch: Batch, on_layer_done: LayerHook | None = None) -> StepResult:
        slices = [(s.num_tokens, s.end) for s in batch.slices]
        sampled = {s.request.request_id: 0 for s in batch.slices if s.samples}
        duration = self.cost_model.iteration_time_s(slices, len(sampled))
        return StepResult(sampled=sampled, duration_s=duration, kv_bytes_read=self.kv_bytes_read(batch))
