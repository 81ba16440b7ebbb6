"""`sarathi`: decode-maximal, stall-free batching (Sarathi-Serve; vLLM V1's
default). Every running decode first, then prefill chunks (partial prefills
first, then new requests, FCFS) into the leftover `token_budget`. A long prompt
therefore never stalls the decodes: it is spread over iterations in chunks."""
from __future__ import annotations

from testbed.batch import Batch, ScheduledSlice
from testbed.schedulers.base import Scheduler


class SarathiScheduler(Scheduler):
    name = "sarathi"

    def schedule(self) -> Batch:
        # No prefill or decode phase: each running request's num_computed_tokens
        # catches up with its tokens; a decode needs 1, a partial prefill the rest.
        batch = Batch()
        budget = self.cfg.token_budget
        decodes = [r for r in self.running if not r.is_prefill]
        prefills = [r for r in self.running if r.is_prefill]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req not in self.running:          # preempted by an earlier allocation
                continue
            n = min(req.num_uncomputed_tokens, budget)
            if self._grow_or_preempt(req, n, batch):
                batch.slices.append(ScheduledSlice(req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not batch.preempted:
            req = self.waiting[0]
            n = self._try_admit(req, budget)
            if n == 0:
                break
            self._start(req)
            batch.slices.append(ScheduledSlice(req, n))
            budget -= n
        # a preempted request may already have a slice scheduled: drop it
        if batch.preempted:
            batch.slices = [s for s in batch.slices if s.request in self.running]
        return self._check(batch, self.cfg.token_budget)
