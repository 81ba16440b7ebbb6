"""`scheduler=adaptive` and `token_budget=auto`: the budget search, the exact
budget under a linear predictor (the mean planned at tbt_headroom, the bound
at the whole SLO), max_budget never exceeded and min_budget never starved
over random workloads, the whole prefill when nothing decodes, fluidity slack
spent only for a prompt near its TTFT deadline, self-correction from a
predictor 2x off, the spread (window quantile, per kind, pooled until a kind
has its own) and, in the simulator with step jitter, the spread-aware plan
keeping p99 TBT within the SLO where the mean-only plan misses it, the
records, the config errors, and the same tokens as sarathi on the simulator
and on the real engine (tiny, fp32)."""
from __future__ import annotations

import random

import pytest
import torch

from testbed.batch import Batch, StepResult
from testbed.block_manager import BlockManager
from testbed.engine import Engine, VirtualClock, WallClock
from testbed.executor import Executor
from testbed.model.config import load_model_preset
from testbed.request import Request, RequestStatus
from testbed.schedulers import SchedulerConfig, SchedulerContext, make_scheduler
from testbed.schedulers.adaptive_config import AdaptiveConfig
from testbed.schedulers.budget import auto_token_budget, largest_fitting, resolve_token_budget
from testbed.schedulers.deadlines import TokenDeadlines
from testbed.schedulers.step_correction import (DECODE, MIN_OWN_SAMPLES, MIXED, PREFILL, StepCorrection,
                                                WindowQuantile, window_size)
from testbed.sim.config import load_hardware_preset
from testbed.sim.cost_executor import CostModelExecutor
from testbed.sim.cost_model import CostModel

BLOCK = 16


class LinearPredictor:
    """base_s + per_token_s per new token: budgets come out in closed form."""
    def __init__(self, base_s: float = 0.005, per_token_s: float = 1e-5, scale: float = 1.0):
        self.base_s, self.per_token_s, self.scale = base_s, per_token_s, scale

    def iteration_time_s(self, slices, num_sampled=None) -> float:
        return self.scale * (self.base_s + self.per_token_s * sum(q for q, _ in slices))


class PredictedExecutor(Executor):
    """Takes what `truth` says the batch takes; samples token (position % 97)."""
    kv_bytes_per_token = 0

    def __init__(self, truth):
        self.truth = truth
        self.batches: list[list[tuple[str, int]]] = []     # the prefill slices of each batch

    def execute(self, batch: Batch, on_layer_done=None) -> StepResult:
        self.batches.append([(s.request.request_id, s.num_tokens) for s in batch.slices if not s.is_decode])
        pairs = [(s.num_tokens, s.end) for s in batch.slices]
        sampled = {s.request.request_id: s.end % 97 for s in batch.slices if s.samples}
        return StepResult(sampled, self.truth.iteration_time_s(pairs, len(sampled)))


def engine(truth, predictor=None, tbt_ms=50.0, ttft_ms=2000.0, num_blocks=4096, max_num_seqs=64,
           **adaptive) -> Engine:
    clock = VirtualClock()
    cfg = SchedulerConfig(token_budget=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                          settings=AdaptiveConfig(**adaptive))
    ctx = SchedulerContext(clock, ttft_ms, tbt_ms, predictor or truth)
    sched = make_scheduler("adaptive", cfg, BlockManager(num_blocks, BLOCK), ctx)
    return Engine(sched, PredictedExecutor(truth), clock)


def run_all(e: Engine, requests: list[tuple[float, Request]], limit: int = 100_000) -> list:
    """Arrivals at their times on the engine's virtual clock; the iteration records."""
    pending, records = sorted(requests, key=lambda x: x[0]), []
    while pending or e.has_work():
        if not e.has_work():
            e.clock.t = max(e.clock.t, pending[0][0])
        while pending and pending[0][0] <= e.clock.t:
            e.add_request(pending.pop(0)[1])
        out = e.step()
        if out is not None:
            records.append((out, e.scheduler.prefill_budget))
        assert len(records) < limit
    assert e.bm.all_free()
    return records


def test_largest_fitting_matches_a_scan():
    rng = random.Random(0)
    for _ in range(200):
        m = rng.choice([1, 16, 64])
        lo, hi = m * rng.randint(1, 5), m * rng.randint(5, 40)
        limit = rng.randint(0, hi + m)
        want = max([b for b in range(lo, hi + 1, m) if b <= limit], default=lo)
        assert largest_fitting(lambda b: b <= limit, lo, hi, m) == want


def _eight_decodes_and_a_long_prompt(**adaptive) -> Engine:
    """8 decodes running (their prompts' step taught the correction: exact),
    a 20,000-token prompt waiting; one step planned at TBT 50 ms."""
    e = engine(LinearPredictor(), max_budget=8192, **adaptive)
    for i in range(8):
        e.add_request(Request(f"d{i}", list(range(1, 33)), 50))
    e.step()                                     # the 8 short prompts, whole: nothing decodes yet
    e.add_request(Request("long", list(range(20_000)), 4))
    return e


def test_budget_is_the_largest_multiple_the_deadline_allows():
    """The mean-only plan, headroom 0.9: 45 ms - 5 ms base = 4,000 tokens of
    10 µs; less the 8 decodes, 3,992, rounded down to 64: 3,968."""
    e = _eight_decodes_and_a_long_prompt(tbt_quantile=None)
    e.step()
    assert e.scheduler.prefill_budget == 3968
    assert e.executor.truth.iteration_time_s([(3968 + 8, 0)]) <= 0.045


def test_spread_aware_budget_plans_the_bound_to_the_whole_slo():
    """No spread measured (the predictor is exact): the whole 50 ms (less the
    1 µs edge) - 5 ms = 4,499 tokens, less 8 decodes, rounded to 64: 4,480.
    Mixed steps that ran up to 25% over their prediction: the bound must fit,
    so 40 ms - 5 ms = 3,499 tokens, less 8: 3,456."""
    e = _eight_decodes_and_a_long_prompt(ewma_alpha=1e-9)      # the mean stays put: residual = measured / raw
    e.scheduler.schedule()
    assert e.scheduler.prefill_budget == 4480
    for i in range(MIN_OWN_SAMPLES):
        e.scheduler.correction.observe(MIXED, 0.04, 0.05 if i == 3 else 0.04)
    e.scheduler.schedule()
    assert e.scheduler.correction.spread(MIXED) == pytest.approx(1.25)
    assert e.scheduler.prefill_budget == 3456


def test_no_decodes_takes_the_whole_prefill_up_to_max_budget():
    e = engine(LinearPredictor(per_token_s=1e-3), max_budget=4096)    # 4 s per 4,096 tokens: no deadline to keep
    e.add_request(Request("a", list(range(10_000)), 2))
    out = e.step()
    assert (out.iteration.num_prefill_tokens, out.iteration.token_budget) == (4096, 4096)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("per_token_s", [1e-6, 1e-3])        # every budget fits / nothing fits
def test_never_exceeds_max_budget_and_never_starves(seed, per_token_s):
    rng = random.Random(seed)
    e = engine(LinearPredictor(per_token_s=per_token_s), min_budget=64, max_budget=512, max_num_seqs=16)
    reqs = [(rng.uniform(0, 2), Request(f"r{i}", list(range(rng.randint(1, 2000))), rng.randint(1, 30)))
            for i in range(40)]
    for out, budget in run_all(e, reqs):
        assert out.iteration.num_prefill_tokens <= budget <= 512
        assert budget >= 64
    assert all(r.status is RequestStatus.FINISHED and len(r.output_token_ids) == r.max_tokens for _, r in reqs)


def test_each_scheduled_prompt_gains_min_budget_or_its_remainder():
    e = engine(LinearPredictor(per_token_s=1e-3), min_budget=128, max_budget=1024)   # only min_budget fits
    e.add_request(Request("d", list(range(1, 9)), 40))
    e.step()
    for i, n in enumerate((100, 300, 50)):
        e.add_request(Request(f"p{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + n)), 2))   # no shared prefix
    for _ in range(5):
        e.step()
    # p0 whole (100); p1 would get 28 < 128: waits; then 128, 128, its last 44 with p2's 50
    assert e.executor.batches[1:] == [[("p0", 100)], [("p1", 128)], [("p1", 128)], [("p1", 44), ("p2", 50)], []]


def test_fluidity_slack_follows_the_metrics_view():
    d = TokenDeadlines(0.1)
    r = Request("a", [1], 10)
    r.token_times_s = [0.0, 0.05, 0.1]              # two early tokens bank 0.1 s
    assert d.slack_s(r) == pytest.approx(0.1)
    r.token_times_s.append(0.45)                    # due 0.3: missed, deadlines count from here
    assert d.slack_s(r) == pytest.approx(0.0)
    r.token_times_s.append(0.5)
    assert d.slack_s(r) == pytest.approx(0.05)


def _budget_with_slack(max_slack_tbt: float, arrival_s: float) -> int:
    """One decode far ahead of its deadlines and a 3,000-token prompt that
    arrived at arrival_s (TTFT SLO 1 s); the budget chosen at t = 1 s."""
    e = engine(LinearPredictor(per_token_s=1e-4), tbt_ms=50.0, ttft_ms=1000.0, max_slack_tbt=max_slack_tbt,
               tbt_quantile=None)
    d = Request("d", list(range(1, 9)), 100)
    e.add_request(d)
    e.step()
    d.token_times_s = [0.881 + 0.001 * i for i in range(20)]     # 20 tokens 1 ms apart: 0.93 s banked
    d.output_token_ids = [1] * 20
    d.num_computed_tokens = d.num_tokens - 1
    e.clock.t = 0.9
    p = Request("p", list(range(3000)), 2, arrival_s=arrival_s)
    e.add_request(p)
    e.scheduler.schedule()
    return e.scheduler.prefill_budget


def test_slack_is_spent_only_for_a_prompt_near_its_ttft_deadline():
    plain = _budget_with_slack(0.0, arrival_s=0.0)
    assert plain == 384                                    # (45 - 5) ms / 0.1 ms - 1 decode, rounded to 64
    assert _budget_with_slack(1.0, arrival_s=0.85) == plain     # 0.95 s of TTFT left: 8 iterations suffice
    assert _budget_with_slack(1.0, arrival_s=0.0) == 896       # late: the decode's 50 ms of slack buys 500 more


def test_self_correction_from_a_predictor_2x_off():
    truth = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    e = engine(truth, predictor=_Scaled(truth, 2.0), tbt_ms=50.0)
    rng = random.Random(1)
    reqs = [(rng.uniform(0, 3), Request(f"r{i}", list(range(rng.randint(100, 6000))), rng.randint(20, 200)))
            for i in range(60)]
    records = run_all(e, reqs)
    errors = [abs(o.iteration.predicted_s / o.iteration.duration_s - 1) for o, _ in records]
    assert errors[0] == pytest.approx(1.0)                  # 2x off at the start
    assert max(errors[200:]) < 0.15 and len(errors) > 400
    assert e.scheduler.correction.ratio["mixed"] == pytest.approx(0.5, rel=0.01)   # most steps are mixed


def test_window_quantile_is_the_nearest_rank_of_the_last_values():
    w = WindowQuantile(0.9, 10)
    assert w.value() == 1.0                                 # nothing measured: no spread
    for x in [5.0, 1.0, 3.0]:
        w.add(x)
    assert w.value() == 5.0                                 # ceil(0.9 * 3) = 3rd smallest
    for x in range(20, 0, -1):                              # 20 down to 1: the window keeps 10..1
        w.add(float(x))
    assert len(w) == 10 and w.sorted == [float(x) for x in range(1, 11)]
    assert w.value() == 9.0                                 # the 9th smallest of ten
    assert window_size(0.99) == 200 and window_size(0.995) == 400 and window_size(0.5) == 100


def test_spread_is_the_residual_quantile_per_kind_pooled_until_a_kind_has_its_own():
    c = StepCorrection(alpha=0.5, quantile=0.995)
    c.observe(DECODE, 1.0, 2.0)          # against the pooled 1.0: residual 2.0; the ratio becomes 1.5
    c.observe(DECODE, 1.0, 3.0)          # against 1.5: residual 2.0 again
    assert c.spread(DECODE) == c.spread(MIXED) == 2.0       # neither has MIN_OWN_SAMPLES: pooled
    c = StepCorrection(alpha=1e-9, quantile=0.995)          # the mean stays at 1: residual = measured / raw
    for i in range(MIN_OWN_SAMPLES):
        c.observe(MIXED, 1.0, 1.4 if i == 7 else 1.0)
        c.observe(DECODE, 1.0, 2.0)
    assert c.spread(MIXED) == pytest.approx(1.4) and c.spread(DECODE) == pytest.approx(2.0)
    assert c.spread(PREFILL) == pytest.approx(2.0)          # not seen: the pooled window's
    assert c.bound(0.01, MIXED) == pytest.approx(0.014)
    assert StepCorrection(0.2).spread(MIXED) == StepCorrection(0.2).bound(0.01, MIXED) / 0.01 == 1.0


# this CPU's kind of noise on a GPU-sized step: deciles of added ms, median 0, p99 ~ +11 ms
_JITTER_MS = [-6.0, -3.0, -2.0, -1.2, -0.5, 0.0, 0.6, 1.4, 2.6, 4.4, 12.0]


def _jittered_tbt_p99_ms(tmp_path, tbt_quantile, seed: int) -> float:
    """p99 TBT of adaptive on the simulator (llama3-8b on h100-sxm, a 50 ms
    TBT SLO) with _JITTER_MS added to every iteration, 120 prompts of
    100-6,000 tokens at 20/s: more than it serves, so prompts always wait
    and most iterations carry prefill planned to the deadline."""
    import dataclasses

    from testbed.config import RunConfig, RuntimeConfig, WandbConfig
    from testbed.run import execute
    from testbed.workloads.config import WorkloadConfig
    hw = dataclasses.replace(load_hardware_preset("h100-sxm"), step_jitter_ms=_JITTER_MS)
    wl = WorkloadConfig(name="jittered", num_requests=120, rate=20.0, prompt_min=100, prompt_max=6000,
                        output_min=20, output_max=200)
    cfg = RunConfig(runtime=RuntimeConfig("sim"), scheduler="adaptive", max_num_seqs=128, num_kv_blocks=8192,
                    model=load_model_preset("llama3-8b"), hardware=hw, workload=wl, seed=seed, progress=False,
                    wandb=WandbConfig(mode="disabled"), adaptive=AdaptiveConfig(tbt_quantile=tbt_quantile,
                                                                                max_slack_tbt=0.0))
    cfg.slo.tpot_ms = 50.0
    return execute(cfg, tmp_path / f"q{tbt_quantile}-s{seed}")["tbt_ms"]["p99"]


@pytest.mark.parametrize("seed", [0, 1])
def test_spread_aware_plan_keeps_p99_tbt_within_the_slo_under_step_jitter(tmp_path, seed):
    """The mean-only plan leaves 10% of the SLO (5 ms) for a jitter whose p90
    is +4.4 ms and p99 +11 ms: ~8% of its iterations overrun, p99 TBT misses.
    The spread-aware plan learns the residuals' 99.5th percentile and stays
    within. (Seeds 0-7 all behave so: mean-only 54-56 ms, spread-aware
    43-50 ms.)"""
    assert _jittered_tbt_p99_ms(tmp_path, None, seed) > 50.0
    assert _jittered_tbt_p99_ms(tmp_path, 0.995, seed) <= 50.0


class _Scaled:
    def __init__(self, inner, scale):
        self.inner, self.scale = inner, scale

    def iteration_time_s(self, slices, num_sampled=None):
        return self.scale * self.inner.iteration_time_s(slices, num_sampled)


def test_auto_budget_is_the_essays_formula():
    cfg = AdaptiveConfig(auto_num_decodes=32)
    # 45 ms - 5 ms = 4,000 tokens of 10 µs; less 32 decodes, 3,968 (a multiple of 64) of prefill
    assert auto_token_budget(LinearPredictor(), 50.0, 256, cfg) == 32 + 3968
    assert resolve_token_budget(512, lambda: pytest.fail("no predictor for an int"), 50.0, 256, cfg) == 512
    with pytest.raises(ValueError, match="token_budget: must be an integer >= 1 or 'auto', got 'big'"):
        resolve_token_budget("big", LinearPredictor, 50.0, 256, cfg)


@pytest.mark.parametrize("changes,message", [
    ({"min_budget": 100}, "adaptive.min_budget: must be a multiple of adaptive.budget_multiple=64, got 100"),
    ({"max_budget": 64, "min_budget": 128}, "adaptive.max_budget: 64 is below adaptive.min_budget=128"),
    ({"tbt_headroom": 1.5}, "adaptive.tbt_headroom: must be in (0, 1], got 1.5"),
    ({"ewma_alpha": 0.0}, "adaptive.ewma_alpha: must be in (0, 1], got 0.0"),
    ({"tbt_quantile": 1.0}, "adaptive.tbt_quantile: must be in (0, 1) (0.995 for a p99 TBT SLO) or null "
                            "(plan the mean at adaptive.tbt_headroom), got 1.0"),
    ({"budget_multiple": 0}, "adaptive.budget_multiple: must be >= 1, got 0"),
    ({"rollout_window": 1}, "adaptive.rollout_window: must be >= 2 (a rate needs two arrivals), got 1"),
])
def test_adaptive_config_errors_name_the_field(changes, message):
    with pytest.raises(ValueError) as e:
        AdaptiveConfig(**changes).validate()
    assert str(e.value) == message


def test_adaptive_without_a_predictor_says_so():
    with pytest.raises(ValueError, match="scheduler=adaptive: needs a SchedulerContext with a step-time predictor"):
        make_scheduler("adaptive", SchedulerConfig(256, 8, 64), BlockManager(8, 16))


# ---- whole runs ---------------------------------------------------------------------------

def _sim_cfg(tmp_path, scheduler: str, token_budget=512, **more):
    from testbed.config import RunConfig
    from testbed.workloads.config import load_workload_preset
    cfg = RunConfig(scheduler=scheduler, token_budget=token_budget, max_num_seqs=128, num_kv_blocks=8192,
                    model=load_model_preset("llama3-8b"), hardware=load_hardware_preset("h100-sxm"),
                    workload=load_workload_preset("mixed", num_requests=40, rate=20.0, prompt_max=6000),
                    progress=False, **more)
    cfg.runtime.name = "sim"
    cfg.wandb.mode = "disabled"
    cfg.slo.tpot_ms = 30.0
    return cfg


def test_sim_records_and_same_outputs_as_sarathi(tmp_path):
    from testbed.metrics import read_iterations, read_requests
    from testbed.run import execute
    summaries, outputs = {}, {}
    for name, budget in (("sarathi", 512), ("sarathi", "auto"), ("adaptive", 512)):
        out = tmp_path / f"{name}-{budget}"
        summaries[name, budget] = execute(_sim_cfg(tmp_path, name, budget), out)
        outputs[name, budget] = {r.request_id: (r.status, r.num_output_tokens) for r in read_requests(out / "requests.jsonl")}
        its = read_iterations(out / "iterations.jsonl")
        assert all(it.token_budget is not None for it in its)
        assert all((it.predicted_s is not None) == (name == "adaptive") for it in its)
    assert outputs["adaptive", 512] == outputs["sarathi", 512] == outputs["sarathi", "auto"]
    it = summaries["adaptive", 512]["iterations"]
    assert it["predictor_error"]["abs_p99"] < 1e-9          # the simulator's own cost model predicts itself
    assert 64 <= it["prefill_budget"]["min"] <= it["prefill_budget"]["max"] <= 8192
    assert "predictor_error" not in summaries["sarathi", 512]["iterations"]
    auto = {it.token_budget for it in read_iterations(tmp_path / "sarathi-auto" / "iterations.jsonl")}
    # auto is one static budget, the essay's formula on this run's SLO and cost model
    from testbed.schedulers.budget import auto_token_budget
    from testbed.sim.cost_model import CostModel
    cfg = _sim_cfg(tmp_path, "sarathi", "auto")
    assert cfg.adaptive is None         # sarathi's run has no adaptive section: auto takes its defaults
    want = auto_token_budget(CostModel(cfg.model, cfg.hardware, cfg.parallel), cfg.slo.tpot_ms, cfg.max_num_seqs,
                             AdaptiveConfig())
    assert auto == {want}


def test_run_config_rejects_a_bad_token_budget():
    from testbed.config import RunConfig, validate
    with pytest.raises(ValueError, match="token_budget: must be an integer >= 1 or 'auto', got 'lots'"):
        validate(RunConfig(token_budget="lots"))


WORKLOAD = [(23, 6), (50, 4), (9, 8), (70, 5), (33, 7), (300, 5), (140, 9)]   # (prompt_len, max_tokens)


def _real_tokens(scheduler: str) -> dict[str, list[int]]:
    from testbed.model_executor import ModelExecutor
    torch.set_num_threads(1)
    model = load_model_preset("tiny")
    bm = BlockManager(256, BLOCK)
    clock = WallClock()
    ctx = SchedulerContext(clock, 2000.0, 20.0, CostModel(model, load_hardware_preset("cpu")))
    sched = make_scheduler(scheduler, SchedulerConfig(32, 16, 4096, AdaptiveConfig(min_budget=16, budget_multiple=16)),
                           bm, ctx if scheduler == "adaptive" else None)
    e = Engine(sched, ModelExecutor(model, 256, BLOCK, bm.block_table), clock)
    reqs = [Request(f"r{i}", torch.randint(0, model.vocab_size, (n,), generator=torch.Generator().manual_seed(100 + i))
                    .tolist(), m) for i, (n, m) in enumerate(WORKLOAD)]
    for r in reqs:
        e.add_request(r)
    while e.has_work():
        e.step()
    assert bm.all_free()
    return {r.request_id: r.output_token_ids for r in reqs}


def test_real_engine_same_tokens_as_sarathi():
    assert _real_tokens("adaptive") == _real_tokens("sarathi")
