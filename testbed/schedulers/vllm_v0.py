"""`vllm_v0`: prefill-prioritizing iteration-level scheduling (vLLM V0 without
chunked prefill). Whenever waiting prompts fit in memory, the iteration runs
only their whole prefills and every running decode pauses: the generation stall
that Sarathi-Serve removes."""
from __future__ import annotations

from testbed.batch import Batch
from testbed.request import Request
from testbed.schedulers.steady_running import SteadyRunning


class VllmV0Scheduler(SteadyRunning):
    name = "vllm_v0"

    def schedule(self) -> Batch:
        batch = Batch()
        self._admit_whole_prefills(batch)
        if not batch.slices:
            self._continue_running(batch)
        return self._check(batch, None)

    def steady_decodes(self) -> tuple[list[Request], None] | None:
        # with nothing waiting, schedule() continues every running request: one decode each
        return self._steady_running(None)
