"""`orca`: iteration-level hybrid batching (Orca). Running decodes and whole
new prefills share one iteration, so decodes do not pause, but an iteration
holding a long prompt takes as long as that whole prefill."""
from __future__ import annotations

from testbed.batch import Batch
from testbed.schedulers.base import Scheduler


class OrcaScheduler(Scheduler):
    name = "orca"

    def schedule(self) -> Batch:
        batch = Batch()
        self._continue_running(batch)
        self._admit_whole_prefills(batch)
        return self._check(batch, None)
