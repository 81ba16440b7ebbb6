"""`sarathi`: decode-maximal, stall-free batching (Sarathi-Serve; vLLM V1's
default). Every running decode first, then prefill chunks (partial prefills
first, then new requests, FCFS) into the leftover `token_budget`. A long prompt
therefore never stalls the decodes: it is spread over iterations in chunks.
A prompt is scheduled only with at least `min_chunk` tokens (or its
remainder): 1 here, adaptive's min_budget in its subclass."""
from __future__ import annotations

from testbed.batch import Batch, ScheduledSlice
from testbed.request import Request, RequestStatus
from testbed.schedulers.steady_running import SteadyRunning


class SarathiScheduler(SteadyRunning):
    name = "sarathi"
    min_chunk = 1

    def schedule(self) -> Batch:
        # No prefill or decode phase: each running request's num_computed_tokens
        # catches up with its tokens; a decode needs 1, a partial prefill the rest.
        batch = Batch()
        slices = batch.slices
        budget = token_budget = batch.token_budget = self.iteration_budget()
        prefills = []
        grow, bs = self._grow, self.bm.block_size
        for req in list(self.running):               # decodes first, in running order
            computed = req.num_computed_tokens
            if computed < req.prompt_len:
                prefills.append(req)
            elif budget:
                if batch.preempted and req.status is not RequestStatus.RUNNING:
                    continue                         # preempted by an earlier allocation
                # usually 1; more when a recompute's last chunk runs into the outputs
                n = req.prompt_len + len(req.output_token_ids) - computed
                if n != 1 or not computed % bs:      # else: _grow's fast path, inlined for the hot loop
                    n = grow(req, n if n < budget else budget, batch)
                if n:
                    slices.append(ScheduledSlice(req, n))
                    budget -= n
        self._schedule_prefills(prefills, budget, batch)
        # a preempted request may already have a slice scheduled: drop it
        if batch.preempted:
            batch.slices = [s for s in slices if s.request.status is RequestStatus.RUNNING]
        return self._check(batch, token_budget)

    def _schedule_prefills(self, partial: list[Request], budget: int, batch: Batch) -> None:
        """Chunks into what the decodes left of the budget: the partial
        prefills (in running order), then new requests FCFS."""
        min_chunk = self.min_chunk
        for req in partial:
            if budget < min(min_chunk, req.num_tokens - req.num_computed_tokens):
                break
            budget -= self._add_slice(req, budget, batch)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not batch.preempted:
            req = self.waiting[0]
            if budget < min(min_chunk, req.num_uncomputed_tokens):
                return
            n = self._try_admit(req, budget)
            if n == 0:
                return
            self._start(req)
            batch.slices.append(ScheduledSlice(req, n))
            budget -= n

    def _add_slice(self, req: Request, budget: int, batch: Batch) -> int:
        """Schedule up to `budget` of a running request's missing tokens; returns how many."""
        if batch.preempted and req.status is not RequestStatus.RUNNING:
            return 0                                 # preempted by an earlier allocation
        n = self._grow(req, min(req.num_tokens - req.num_computed_tokens, budget), batch)
        if n:
            batch.slices.append(ScheduledSlice(req, n))
        return n
