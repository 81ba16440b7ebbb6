"""`adaptive`: sarathi's decode-maximal batching with the prefill budget chosen
every iteration from the running decodes' token deadlines and a step-time
predictor, instead of one static token budget.

Each iteration (iteration_budget):
- every running decode runs, as in sarathi; the prefill budget P is the
  largest multiple of `budget_multiple` in [min_budget, max_budget] for which
  the predicted iteration (the decodes plus the chunks P would schedule, FCFS)
  ends before the earliest decode's next token deadline, one TBT SLO after
  its last token. "Predicted" is a bound, not a mean: the corrected
  prediction times the `tbt_quantile` of the recent measured/predicted ratios
  (StepCorrection.bound), so on a noisy machine the plan leaves the room the
  noise takes (with tbt_quantile null: the mean, planned at tbt_headroom of
  the SLO). Nothing fits: min_budget, so prompts never starve (each scheduled
  prompt gains at least min_budget tokens, or its remainder);
- no running decodes: nobody to protect, P = max_budget (then the rollout below);
- TTFT awareness: when the oldest waiting prompt would miss its TTFT deadline
  at P, the decodes' banked fluidity slack (TokenDeadlines, at most
  max_slack_tbt SLOs each) extends the deadline, and P is chosen again;
- several prompts fit under P (`ttft_rollout`): P becomes the budget <= P,
  whole prompts at a time, that minimises the waiting prompts' summed
  predicted TTFT (ttft_rollout.py: one more prompt past a GEMM tile step can
  delay the rest by more than deferring it costs it); with
  adaptive.rollout_arrivals, the prompts expected to arrive meanwhile too
  (Traffic: the observed arrival rate and typical iteration);
- `prefill_first`, the decodes' slack spent on fresh prompts: when every
  waiting prompt arrived during the last iteration and every decode can wait
  one iteration within its deadline, the prompts run alone first and the
  decodes next, if what the prompts gain exceeds what the split's extra step
  costs the prompts arriving meanwhile (prefill_first.py); never twice in a row.

The predictor is the cost model (SchedulerContext); StepCorrection scales it
per batch kind by the measured/predicted ratio of finished steps (on_step), so
a wrong profile converges instead of misleading the budget, and keeps the
spread of what is left. Each batch carries its budget and corrected (mean)
prediction into iterations.jsonl."""
from __future__ import annotations

import itertools
import math
from typing import Callable

from testbed.batch import Batch
from testbed.block_manager import BlockManager
from testbed.request import Request
from testbed.schedulers.adaptive_config import AdaptiveConfig
from testbed.schedulers.base import SchedulerConfig
from testbed.schedulers.budget import largest_fitting
from testbed.schedulers.context import SchedulerContext
from testbed.schedulers.deadlines import TokenDeadlines
from testbed.schedulers.prefill_first import defers_decodes
from testbed.schedulers.sarathi import SarathiScheduler
from testbed.schedulers.step_correction import DECODE, MIXED, StepCorrection, batch_kind
from testbed.schedulers.traffic import Traffic
from testbed.schedulers.ttft_rollout import ttft_minimising_budget

# a noise-free simulation plans iterations to end exactly on the deadline: 1 µs keeps the
# float rounding of token times from putting a gap over the SLO
_EDGE_S = 1e-6


class AdaptiveScheduler(SarathiScheduler):
    name = "adaptive"
    needs_predictor = True

    def __init__(self, cfg: SchedulerConfig, block_manager: BlockManager, context: SchedulerContext | None = None):
        super().__init__(cfg, block_manager, context)
        if context is None or context.predictor is None:
            raise ValueError("scheduler=adaptive: needs a SchedulerContext with a step-time predictor "
                             "(testbed/runtime/build.py's scheduler_context builds one)")
        self.acfg = cfg.settings if cfg.settings is not None else AdaptiveConfig()
        self.acfg.validate()
        self.min_chunk = self.acfg.min_budget
        self.predictor = context.predictor
        self.tbt_s = context.slo_tbt_ms * 1e-3
        self.ttft_s = context.slo_ttft_ms * 1e-3
        self.deadlines = TokenDeadlines(self.tbt_s)
        self.correction = StepCorrection(self.acfg.ewma_alpha, self.acfg.tbt_quantile)
        # the arrivals the rollout and prefill_first expect; observed only when one of them uses it
        self.traffic = Traffic(self.acfg.rollout_window) \
            if self.acfg.rollout_arrivals or self.acfg.prefill_first else None
        # the part of a TBT SLO an iteration may take: all of it when bound() carries the error margin
        self.plan_s = (self.tbt_s - _EDGE_S if self.acfg.tbt_quantile is not None
                       else self.acfg.tbt_headroom * self.tbt_s)
        self.prefill_budget = self.acfg.max_budget     # the budget of the batch being planned
        self._planned: tuple[Batch, str, float] | None = None    # (batch, kind, raw prediction)
        self._last_step_start_s: float | None = None   # when the last finished step began
        self.num_deferrals = 0               # prefill_first's prompt-only iterations so far
        self._decode_pricers: dict[int, Callable[[int, int], float]] = {}    # the predictor's, per batch size
        # a steady decode batch is planned and observed without its slices where the predictor
        # prices decodes by their contexts' sum and longest (CostModel.decode_pricer: the same
        # float as iteration_time_s of the slices); else it goes through schedule() and on_step
        make = getattr(self.predictor, "decode_pricer", None)
        self.observes_steady = make is not None and self._decode_pricer(1) is not None

    def schedule(self) -> Batch:
        # with prefill_first, maybe the whole queue alone, every decode deferred one iteration;
        # else (or when no prompt could start: KV memory) sarathi's schedule() (every decode,
        # then chunks FCFS) under iteration_budget()'s budget
        prompt_only = self._prompt_only_budget() if self.acfg.prefill_first else 0
        batch = self._prompts_alone(prompt_only) if prompt_only else Batch()
        if batch:
            self.num_deferrals += 1
        else:
            batch = super().schedule()
        if batch:
            pairs = [(s.num_tokens, s.end) for s in batch.slices]
            raw = self.predictor.iteration_time_s(pairs, sum(s.samples for s in batch.slices))
            kind = batch_kind(batch.num_prefill_tokens, batch.num_decode_tokens)
            batch.predicted_s = self.correction.corrected(raw, kind)
            self._planned = (batch, kind, raw)
        assert batch.num_prefill_tokens <= self.prefill_budget <= self.acfg.max_budget, "prefill budget exceeded"
        assert all(s.num_tokens >= min(self.min_chunk, s.request.num_tokens - s.request.num_computed_tokens)
                   for s in batch.slices if not s.is_decode), "a prompt was scheduled below min_budget"
        return batch

    def steady_decodes(self) -> tuple[list[Request], int] | None:
        # with no prompt to budget, schedule() gives each running request its decode
        # under decodes + max_budget: sarathi's steady batch (observe_steady plans it)
        # (asked before every step on the simulator: a prompt in the queues ends it before the budget is priced)
        if not self.observes_steady or self.waiting or \
                any(r.num_computed_tokens < r.prompt_len for r in self.running):
            return None
        return self._steady_running(self.iteration_budget())

    def observe_steady(self, num_decodes: int, context_tokens: int, longest_context: int,
                       start_s: float, end_s: float) -> float:
        # schedule()'s prediction and on_step's observation of that batch, in their order
        raw = self._decode_pricer(num_decodes)(context_tokens, longest_context)
        predicted = self.correction.corrected(raw, DECODE)
        duration_s = end_s - start_s
        self._last_step_start_s = start_s
        if self.traffic is not None:
            self.traffic.observe_step(duration_s)
        self.correction.observe(DECODE, raw, duration_s)
        return predicted

    def _decode_pricer(self, num_decodes: int) -> Callable[[int, int], float] | None:
        pricer = self._decode_pricers.get(num_decodes)
        if pricer is None:
            pricer = self._decode_pricers[num_decodes] = self.predictor.decode_pricer(num_decodes)
        return pricer

    def add(self, request: Request) -> None:
        super().add(request)
        if self.traffic is not None:
            self.traffic.observe_arrival(self.context.clock.now())

    def on_step(self, batch: Batch, duration_s: float) -> None:
        self._last_step_start_s = self.context.clock.now() - duration_s
        if self.traffic is not None:
            self.traffic.observe_step(duration_s)
        planned = self._planned
        if planned is not None and planned[0] is batch:
            self.correction.observe(planned[1], planned[2], duration_s)

    def remove(self, request: Request) -> None:
        super().remove(request)
        self.deadlines.forget(request.request_id)

    # -- the budget ------------------------------------------------------------------------
    def iteration_budget(self) -> int:
        """The running decodes' tokens plus this iteration's prefill budget."""
        cfg = self.acfg
        decodes, prefills, decode_tokens, last_token_s = [], [], 0, math.inf
        for req in self.running:
            c = req.num_computed_tokens
            if c < req.prompt_len:
                prefills.append(req)
                continue
            n = req.num_tokens - c       # 1, or more when a recompute runs into the outputs
            decode_tokens += n
            decodes.append((n, c + n))
            if req.token_times_s:
                last_token_s = min(last_token_s, req.token_times_s[-1])
        work = self._prefill_work(prefills)
        if not work:
            self.prefill_budget = cfg.max_budget
            return decode_tokens + cfg.max_budget
        budget = cfg.max_budget if not decodes or last_token_s == math.inf else \
            self._deadline_budget(decodes, work, last_token_s)
        if cfg.ttft_rollout and work[0].num_tokens - work[0].num_computed_tokens < budget:
            budget = self._ttft_budget(decodes, prefills, budget)
        self.prefill_budget = budget
        return decode_tokens + budget

    def _deadline_budget(self, decodes: list[tuple[int, int]], work: list[Request], last_token_s: float) -> int:
        """The largest budget the decodes' next token deadlines allow (with
        banked slack when the oldest prompt would miss its TTFT deadline)."""
        cfg = self.acfg
        now = self.context.clock.now()
        plan_s = self.plan_s
        budget = self._largest(decodes, work, last_token_s + plan_s - now)
        head = work[0]
        if cfg.max_slack_tbt and self._misses_ttft(head, budget, plan_s, now):
            cap = cfg.max_slack_tbt * self.tbt_s
            slack_due = min(req.token_times_s[-1] + plan_s + min(self.deadlines.slack_s(req), cap)
                            for req in self.running if req.num_computed_tokens >= req.prompt_len
                            and req.token_times_s)
            if slack_due > last_token_s + plan_s:
                budget = self._largest(decodes, work, slack_due - now)
        return budget

    def _ttft_budget(self, decodes: list[tuple[int, int]], partial: list[Request], budget: int) -> int:
        """The budget <= `budget` that minimises the summed predicted TTFT of
        every prompt that may start (the partial prefills, then the waiting
        ones within max_num_seqs), by ttft_rollout's one-step rollout."""
        seats = self.cfg.max_num_seqs - len(self.running)
        todo = [(r.num_tokens - r.num_computed_tokens, r.num_computed_tokens) for r in partial]
        todo += [(r.num_tokens - r.num_computed_tokens, r.num_computed_tokens)
                 for r in itertools.islice(self.waiting, max(seats, 0))]
        predict, correct, kind = self.predictor.iteration_time_s, self.correction.corrected, batch_kind(1, len(decodes))

        def price(pairs, sampled):
            return correct(predict(pairs, sampled), kind)       # the mean: TTFT is summed, not bounded
        traffic = self.traffic
        rate, typical_s = (traffic.rate_per_s(self.context.clock.now()), traffic.typical_step_s()) \
            if self.acfg.rollout_arrivals else (0.0, 0.0)
        return ttft_minimising_budget(price, decodes, todo, budget, self.min_chunk, self.acfg.min_budget,
                                      self.acfg.budget_multiple, rate, typical_s)

    def _prompt_only_budget(self) -> int:
        """prefill_first: the budget of a prompt-only iteration (the whole
        queue's tokens rounded up to budget_multiple) that defers every running
        decode one iteration; 0 when a prompt waited through a whole iteration
        (a backlog) or is part-prefilled, a decode sampled nothing in the last
        iteration (the last one deferred it), the queue does not fit the seats
        or max_budget, or defers_decodes says no."""
        waiting, running, cfg = self.waiting, self.running, self.acfg
        start = self._last_step_start_s
        if not waiting or not running or start is None or len(running) + len(waiting) > self.cfg.max_num_seqs:
            return 0
        prompts, tokens = [], 0
        for req in waiting:
            if req.arrival_s < start:
                return 0
            n = req.num_uncomputed_tokens
            prompts.append((n, req.num_computed_tokens + n))
            tokens += n
        budget = -(-tokens // cfg.budget_multiple) * cfg.budget_multiple
        if budget > cfg.max_budget:
            return 0
        decodes, last_token_s = [], math.inf
        for req in running:
            c = req.num_computed_tokens
            if c < req.prompt_len or req.num_tokens - c != 1 or not req.token_times_s:
                return 0              # a partial prefill, a recompute's catch-up or no first token yet
            decodes.append((1, c + 1))
            last_token_s = min(last_token_s, req.token_times_s[-1])
        if last_token_s <= start:
            return 0                  # a decode had no token in the last iteration (it was deferred): never twice
        now = self.context.clock.now()
        fits = defers_decodes(self.predictor.iteration_time_s, self.correction, decodes, prompts,
                              last_token_s + self.plan_s - now, self.traffic.rate_per_s(now))
        return budget if fits else 0

    def _prompts_alone(self, budget: int) -> Batch:
        """The waiting prompts, FCFS within `budget`, and no decode; empty when
        none could start (KV memory)."""
        self.prefill_budget = budget
        batch = Batch(token_budget=budget)
        self._schedule_prefills([], budget, batch)
        return self._check(batch, budget)

    def _prefill_work(self, partial: list[Request]) -> list[Request]:
        """The prompts this iteration may chunk, in sarathi's order (partial
        prefills, then waiting FCFS within max_num_seqs), until they hold
        max_budget tokens."""
        work, tokens = [], 0
        seats = self.cfg.max_num_seqs - len(self.running)
        for req in partial:
            work.append(req)
            tokens += req.num_tokens - req.num_computed_tokens
        for req in self.waiting:
            if tokens >= self.acfg.max_budget or seats <= 0:
                break
            work.append(req)
            tokens += req.num_uncomputed_tokens
            seats -= 1
        return work

    def _largest(self, decodes: list[tuple[int, int]], work: list[Request], target_s: float) -> int:
        """The largest prefill budget whose predicted iteration (the bound) takes at most target_s."""
        cfg, correct, min_chunk = self.acfg, self.correction, self.min_chunk
        todo = [(r.num_tokens - r.num_computed_tokens, r.num_computed_tokens) for r in work]
        make = getattr(self.predictor, "pricer_after", None)
        if make is None:
            predict = self.predictor.iteration_time_s
            price = lambda chunks, sampled: predict(decodes + chunks, sampled)    # noqa: E731
        else:
            price = make(decodes)     # the decodes' part priced once for every budget tried

        def fits(budget: int) -> bool:
            pairs, sampled = [], len(decodes)
            for remaining, computed in todo:
                if budget < min(min_chunk, remaining):
                    break
                n = min(remaining, budget)
                pairs.append((n, computed + n))
                sampled += n == remaining
                budget -= n
                if not budget:
                    break
            return correct.bound(price(pairs, sampled), MIXED) <= target_s
        return largest_fitting(fits, cfg.min_budget, cfg.max_budget, cfg.budget_multiple)

    def _misses_ttft(self, head: Request, budget: int, plan_s: float, now: float) -> bool:
        """Whether `head`, given `budget` tokens per iteration of about plan_s,
        would sample its first token after its TTFT deadline."""
        remaining = head.num_tokens - head.num_computed_tokens
        return now + math.ceil(remaining / budget) * plan_s > head.arrival_s + self.ttft_s
