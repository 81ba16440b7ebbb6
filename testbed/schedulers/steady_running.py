"""`SteadyRunning`: the simulator's SteadyDecodes
(testbed/runtime/sim_fast_forward.py) for a policy whose schedule(), with
nothing waiting, gives each running request its one missing token in
running order (sarathi's decodes first, vllm_v0's continue-running)."""
from __future__ import annotations

from abc import ABC

from testbed.batch import Batch
from testbed.request import Request
from testbed.schedulers.base import Scheduler


class SteadyRunning(Scheduler, ABC):
    observes_steady = False     # schedule() plans nothing that a steady batch must update

    def steady_decodes(self) -> tuple[list[Request], int | None] | None:
        return self._steady_running(self.iteration_budget())

    def observe_steady(self, num_decodes: int, context_tokens: int, longest_context: int,
                       start_s: float, end_s: float) -> float | None:
        return None

    def _steady_running(self, budget: int | None) -> tuple[list[Request], int | None] | None:
        """The running requests as one decode each within `budget` tokens
        (None: no budget): nothing waits, every running request is one token
        behind and each one that starts a block gets one, so nothing is
        preempted."""
        running, bm = self.running, self.bm
        if self.waiting or not running or (budget is not None and len(running) > budget):
            return None
        bs = bm.block_size
        starting = 0
        for req in running:
            computed = req.num_computed_tokens
            if computed < req.prompt_len or req.prompt_len + len(req.output_token_ids) - computed != 1:
                return None
            if not computed % bs:
                starting += 1
        if starting:
            if starting > bm.num_free_blocks:
                return None
            batch = Batch()           # no preemption can reach it
            for req in running:
                if not req.num_computed_tokens % bs:
                    self._grow(req, 1, batch)
        return list(running), budget
