"""`sarathi_srpt`: sarathi's decode-maximal batching (every running decode
first, chunks into the leftover `token_budget`) with the chunks given
shortest-remaining-prompt-first instead of FCFS: the partial prefills and the
waiting prompts are one queue ordered by the prompt tokens each has left (ties
by arrival), and a new short prompt goes ahead of a long one already chunking.

Why: under a TTFT target that grows with the prompt (k x its whole prefill, the
per-request SLO of experiments/README.md "hybrid capacity"), FCFS chunking
makes a 200-token prompt with a ~50 ms target wait behind every chunk of an
8K one whose target is over a second; shortest-first serves it in the next
iteration and delays the long one by about one iteration. The cost is
starvation under sustained overload: a long prompt waits while shorter ones
keep arriving (no aging here)."""
from __future__ import annotations

from testbed.batch import Batch, ScheduledSlice
from testbed.request import Request, RequestStatus
from testbed.schedulers.sarathi import SarathiScheduler


class SarathiSRPTScheduler(SarathiScheduler):
    name = "sarathi_srpt"

    def _schedule_prefills(self, partial: list[Request], budget: int, batch: Batch) -> None:
        # one queue: (tokens left, arrival order); a waiting prompt's cached prefix counts only once admitted
        queue = sorted([(r.num_tokens - r.num_computed_tokens, r.arrival_s, 0, r) for r in partial] +
                       [(r.num_uncomputed_tokens, r.arrival_s, 1, r) for r in self.waiting],
                       key=lambda e: e[:3])
        min_chunk = self.min_chunk
        admitting = True           # stops at the first waiting prompt memory cannot hold, as FCFS does
        for left, _, waiting, req in queue:
            if budget <= 0 or batch.preempted:
                return
            if budget < min(min_chunk, left):
                continue
            if not waiting:
                budget -= self._add_slice(req, budget, batch)
                continue
            if not admitting or len(self.running) >= self.cfg.max_num_seqs:
                continue
            n = self._try_admit(req, budget)
            if n == 0:
                admitting = False
                continue
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.slices.append(ScheduledSlice(req, n))
            budget -= n
