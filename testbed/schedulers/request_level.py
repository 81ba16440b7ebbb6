"""`request_level`: static batching (FasterTransformer). A batch is formed only
when the previous one has drained; its requests reserve KV for their whole
lifetime (prompt + max_tokens) and nobody joins until all of them finish."""
from __future__ import annotations

from testbed.batch import Batch
from testbed.schedulers.base import Scheduler


class RequestLevelScheduler(Scheduler):
    name = "request_level"

    def schedule(self) -> Batch:
        batch = Batch()
        if not self.running:
            while self.waiting and len(self.running) < self.cfg.max_num_seqs:
                req = self.waiting[0]
                lifetime = req.prompt_len + req.max_tokens - 1   # the last token never needs KV
                if self._try_admit(req, None) == 0:
                    break
                if not self.bm.allocate(req, max(lifetime, req.num_tokens)):
                    self.bm.free(req.request_id)
                    req.num_computed_tokens = 0
                    if self.running:
                        break
                    # even alone it cannot reserve its lifetime: run it anyway and
                    # let preemption handle the shortfall rather than starve it
                    self._try_admit(req, None)
                self._start(req)
        self._continue_running(batch)
        return self._check(batch, None)
