"""The simulator's executor: no forward pass, the cost model says how long the
batch takes. Sampled tokens are placeholders (0): the simulator measures
time, not text. The per-layer hook is not called: the simulated KV port
(testbed/runtime/sim.py) models layer-wise streaming from the iteration's
duration instead. With a measured `StepJitter` (a profiled CPU) each
iteration's time gains a deviation drawn from it (never below half the
modeled time: a hand-written table cannot make a step free)."""
from __future__ import annotations

from typing import Iterator

from testbed.batch import Batch, StepResult
from testbed.executor import Executor, LayerHook
from testbed.request import Request
from testbed.sim.cost_model import CostModel
from testbed.sim.jitter import StepJitter

_FLOOR = 0.5


class CostModelExecutor(Executor):
    def __init__(self, cost_model: CostModel, jitter: StepJitter | None = None):
        self.cost_model = cost_model
        self.jitter = jitter
        self.kv_bytes_per_token = cost_model.model.kv_bytes_per_token
        self.num_layers = cost_model.model.num_layers
        self.prices_decodes_by_sum = cost_model.decode_iteration_s(1, 1, 1) is not None

    def execute(self, batch: Batch, on_layer_done: LayerHook | None = None) -> StepResult:
        # one pass over the slices (this runs ~10^5 times per simulated run):
        # (new tokens, context after the step) pairs, the sampled requests, and
        # the KV read (Executor.kv_bytes_read: every slice's whole context)
        pairs, sampled, context = [], {}, 0
        for s in batch.slices:
            req, n = s.request, s.num_tokens
            end = req.num_computed_tokens + n
            pairs.append((n, end))
            context += end
            if end == req.num_tokens:
                sampled[req.request_id] = 0
        return StepResult(sampled=sampled, duration_s=self._duration_s(pairs, len(sampled)),
                          kv_bytes_read=context * self.kv_bytes_per_token)

    def execute_decodes(self, requests: list[Request]) -> tuple[list[int], float, int]:
        # execute()'s figures for one decode per request, without the batch's objects
        # (most of a simulated run's iterations: ~1/3 of the steady decode step's time)
        n = len(requests)
        if self.prices_decodes_by_sum:
            # (the kernel model: by the contexts' sum and longest, no slices; ~15% faster at 2 decodes)
            contexts = [r.num_computed_tokens for r in requests]
            context = sum(contexts) + n
            duration = self._jittered(self.cost_model.decode_iteration_s(n, context, max(contexts) + 1))
            return [0] * n, duration, context * self.kv_bytes_per_token
        pairs = [(1, r.num_computed_tokens + 1) for r in requests]
        context = sum(end for _, end in pairs)
        return [0] * n, self._duration_s(pairs, n), context * self.kv_bytes_per_token

    def decode_steps(self, requests: list[Request]) -> Iterator[tuple[list[int], float, int]]:
        if not self.prices_decodes_by_sum:
            yield from super().decode_steps(requests)
            return
        # execute_decodes' figures, the contexts' sum and longest carried from one iteration to
        # the next (2.3x faster than execute_decodes per iteration at 2 decodes)
        n, kv_bytes_per_token = len(requests), self.kv_bytes_per_token
        price, jittered = self.cost_model.decode_pricer(n), self._jittered
        contexts = [r.num_computed_tokens for r in requests]
        context, longest = sum(contexts) + n, max(contexts) + 1
        while True:
            yield [0] * n, jittered(price(context, longest)), context * kv_bytes_per_token
            context += n
            longest += 1

    def _duration_s(self, pairs: list[tuple[int, int]], num_sampled: int) -> float:
        return self._jittered(self.cost_model.iteration_time_s(pairs, num_sampled))

    def _jittered(self, duration: float) -> float:
        if self.jitter is not None:
            duration = max(duration + self.jitter(), duration * _FLOOR)
        return duration
