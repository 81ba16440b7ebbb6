"""The decision study (testbed/experiments/decision.py) on a constructed case
whose L* follows by hand (tests/decision_case.py says why: L* = 4,096), the
steady-state rule of a capacity probe (testbed/steady_state.py), the
summary's format and L* rule, and the validation of the study's config
fields."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from testbed.config import from_dict, validate
from testbed.experiments.decision_config import DecisionConfig
from testbed.experiments.decision_summary import crossovers, l_star
from testbed.metrics import RequestRecord
from testbed.experiments.decision import run_decision
from testbed.steady_state import SteadyRule, judged_window

from decision_case import DATA, ENGINE, GRID, constructed, read_rows  # noqa: E402  (tests/ on sys.path: conftest)

def test_the_study_finds_the_crossover_the_arithmetic_gives(tmp_path):        # ~5 s here
    cfg = constructed()
    # the study's own result: run_experiment pops its W&B series and tables (tests/test_wandb.py reads those back)
    result = run_decision(cfg, tmp_path, print)
    summary = json.loads((tmp_path / "decision_summary.json").read_text())
    rows = read_rows(tmp_path / "decision.csv")
    assert list(rows[0]) == ["model", "hardware", "link", "link_gbps", "num_gpus", "slo", "tbt_slo_ms", "ttft_slo_ms",
                             "context_len", "deployment", "family", "capacity_per_gpu", "bound", "limited_by",
                             "steady", "probes", "source", "first_failing_per_gpu"]
    assert len(rows) == len(GRID) * 2 * 2                 # L x (sarathi-1100, disagg-1P1D) x 2 definitions
    assert {r["ttft_slo_ms"] for r in rows} == {"35.0"}
    by = {(r["slo"], r["deployment"], int(r["context_len"])): r for r in rows}
    for slo in ("p99_tbt", "fluidity"):
        for L in (4096, 8192):           # 4 chunks of 10 ms: no rate meets a 35 ms TTFT
            col = by[(slo, "sarathi-1100", L)]
            assert (col["capacity_per_gpu"], col["bound"], col["limited_by"]) == ("", "none", "ttft")
            assert float(col["first_failing_per_gpu"]) > 0          # the lowest rate probed, failed
        for L in GRID:
            dis = by[(slo, "disagg-1P1D", L)]
            assert dis["bound"] == "bracketed" and dis["steady"] == "True" and float(dis["capacity_per_gpu"]) > 0
            # the bracket: the first failing rate above the capacity, within the search's 10%
            assert 1.0 < float(dis["first_failing_per_gpu"]) / float(dis["capacity_per_gpu"]) <= 1.1 + 1e-9
        for L in (512, 1024):            # twice the prefill throughput: ~2x, at least 1.4x
            col, dis = by[(slo, "sarathi-1100", L)], by[(slo, "disagg-1P1D", L)]
            assert col["steady"] == "True" and col["bound"] == "bracketed"
            assert float(col["capacity_per_gpu"]) > 1.4 * float(dis["capacity_per_gpu"])
        # below the prefill throughput bounds, per GPU of 2: prompts per 10 ms iteration x 100 / 2
        # (colocation: 2 replicas of 1,100 // L prompts; disagg: one worker of max(1, 1,100 // L))
        for L in GRID:
            per_iteration = max(1, 1100 // L)
            assert float(by[(slo, "disagg-1P1D", L)]["capacity_per_gpu"]) <= per_iteration * 100 / 2
            if L <= 1024:
                assert float(by[(slo, "sarathi-1100", L)]["capacity_per_gpu"]) <= 2 * per_iteration * 100 / 2
    # each probe row carries the verdict of the definition that ran it: the rows of that definition
    # passed at their capacity and missed their limit at their first failing rate
    # (key: model/hardware/N/deployment/link/L/TBT target; rates are the deployment's, 2 GPUs each)
    probes = {(p["key"].split("/")[3], int(p["key"].split("/")[5]), round(float(p["rate"]) / 2, 9)): p
              for p in read_rows(tmp_path / "decision_probes.csv")}
    assert {p["judged_by"] for p in probes.values()} == {"p99_tbt"}         # fluidity reused every run
    assert {p["verdict"] for p in probes.values()} >= {"pass", "ttft"}
    # a row per probe; a probe re-run longer counts each run (and its wall time) in its row
    assert sum(int(p["runs"]) for p in probes.values()) == summary["num_probe_runs"] > len(probes)
    for r in (r for r in rows if r["slo"] == "p99_tbt"):
        at = lambda per_gpu: probes[(r["deployment"], int(r["context_len"]), round(float(per_gpu), 9))]
        if r["capacity_per_gpu"]:
            assert at(r["capacity_per_gpu"])["verdict"] == "pass"
        assert at(r["first_failing_per_gpu"])["verdict"] == r["limited_by"]
    assert {c["slo"]: c["l_star"] for c in summary["crossovers"]} == {"p99_tbt": 4096, "fluidity": 4096}
    c = summary["crossovers"][0]
    assert c["best_colocated"] == {"512": "sarathi-1100", "1024": "sarathi-1100"}
    assert c["best_disaggregated"] == {str(L): "disagg-1P1D" for L in GRID}
    assert summary["assumptions"]["ttft_k"] == 3.5
    assert result["tables"]["lstar"][0]["l_star"] == 4096
    series = result["series"][0]
    assert series["xs"] == GRID and series["keys"] == ["sarathi-1100", "disagg-1P1D"]
    assert series["ys"][0][2:] == [None, None] and all(y > 0 for y in series["ys"][1])
    assert {p.name for p in tmp_path.glob("*.png")} == set(result["figures"]) and result["figures"]
    assert any(name.startswith("phase_") for name in result["figures"])
    assert result["experiment"] == "decision"


def test_a_sweep_on_the_next_link_probes_the_bracket_the_previous_link_found(tmp_path):
    """Two links that deliver KV alike: disagg's searches on the second probe the
    first's bracket (its capacity, then its first failing rate) and, the verdicts
    agreeing, end there: the same rows in two probes where the first link's
    search doubled and bisected (the second definition's on the same runs,
    judged alike, starts from their bracket too)."""
    cfg = constructed(links=[str(DATA / "decision_link.yaml"), str(DATA / "decision_link_b.yaml")],
                      context_lens=[512, 1024, 4096])
    run_decision(cfg, tmp_path, print)
    rows = [r for r in read_rows(tmp_path / "decision.csv") if r["deployment"] == "disagg-1P1D"]
    by = {(r["link"], r["slo"], int(r["context_len"])): r for r in rows}
    same = ("capacity_per_gpu", "first_failing_per_gpu", "bound", "limited_by", "steady")
    for slo in ("p99_tbt", "fluidity"):
        for L in (512, 1024, 4096):
            first, warm = by[("instant", slo, L)], by[("instant-b", slo, L)]
            assert first["bound"] == "bracketed" and first["steady"] == "True"
            assert [warm[c] for c in same] == [first[c] for c in same]
            assert int(warm["probes"]) == 2
    assert int(by[("instant", "p99_tbt", 512)]["probes"]) >= 4 and int(by[("instant", "fluidity", 512)]["probes"]) == 2
    probes = read_rows(tmp_path / "decision_probes.csv")
    rates = lambda link: sorted(float(p["rate"]) for p in probes if p["key"].split("/")[4] == link)
    assert set(rates("instant-b")) <= set(rates("instant")) and len(rates("instant-b")) == 2 * 3
    colocated = [r for r in read_rows(tmp_path / "decision.csv") if r["family"] == "colocated"]
    assert {r["link"] for r in colocated} == {"instant", "instant-b"}     # one sweep, its rows under both


def record(arrival: float, start: float, finish: float) -> RequestRecord:
    return RequestRecord("r", "finished", 16, [0, 0], arrival, start, start + 0.01, [start + 0.01, finish], finish)


def test_a_probe_too_short_for_its_service_time_is_flagged_not_steady():
    rule = SteadyRule(span_factor=10, min_judged=5)
    # 10 arrivals over 9 s, each served for 2 s: the span is 4.5 service times, not 10
    short = judged_window([record(t, t, t + 2.0) for t in range(10)], rule)
    assert not short.steady and "span" in short.reason and short.service_s == 2.0
    # 100 arrivals over 99 s: steady; the first and last 2 s of arrivals are warm-up and drain
    long = judged_window([record(t, t + 0.5, t + 2.5) for t in range(100)], rule)
    assert long.steady and long.reason == "ok"
    assert [r.arrival_s for r in long.judged] == list(range(2, 98))
    # one outlier among 100 one-second services does not set S (its p99 does)
    outlier = judged_window([record(t, t, t + 1.0) for t in range(100)] + [record(50, 50, 100.0)], rule)
    assert outlier.service_s == 1.0 and outlier.steady
    # a long span but too few requests in the window
    sparse = judged_window([record(t, t, t + 1.0) for t in (0, 5, 10, 15)], rule)
    assert not sparse.steady and "min_judged" in sparse.reason


def test_a_probe_with_an_empty_judged_window_fails_instead_of_passing_vacuously():
    """A burst whose services outlast its span leaves no arrival between the
    warm-up and the drain; passing it let llama2-70b's disagg searches double
    past 10^8 req/s per GPU. It fails as `unjudged`, the same probe's well
    judged twin passes, and an unfinished request still says `unfinished`."""
    from testbed.experiments.decision_prober import ProbeRun
    from testbed.experiments.decision_search import verdict
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    rule, targets = SteadyRule(span_factor=10, min_judged=5), SLOTargets(ttft_ms=1e6, tbt_ms=1e6)
    burst = judged_window([record(t * 0.01, 0.0, 30.0) for t in range(50)], rule)
    assert burst.judged == [] and not burst.steady
    spread = judged_window([record(t, t, t + 1.0) for t in range(100)], rule)
    for name in ("p99_tbt", "fluidity"):
        smooth = get_smoothness(name)
        assert verdict(ProbeRun(burst, 50, 50), smooth, targets) == "unjudged"
        assert verdict(ProbeRun(spread, 100, 100), smooth, targets) == ""
        assert verdict(ProbeRun(spread, 100, 99), smooth, targets) == "unfinished"


def test_a_probe_is_sized_to_reach_steady_state():
    rule = SteadyRule(span_factor=10, min_judged=20, max_requests=4000)
    assert rule.num_requests(10.0, 2.0) == 220                      # 1.1 x 10 req/s x 20 s
    assert rule.num_requests(0.01, 2.0) == 30                       # at least min_judged in the window
    assert rule.num_requests(1000.0, 10.0) == 4000
    # a probe that must judge 100 (the ceiling's): 100 x 20 s / 16 s window x 1.1, plus 2
    assert rule.num_requests(0.01, 2.0, min_judged=100) == 140
    assert rule.num_requests(10.0, 2.0, min_judged=100) == 220      # the span asks for more already


def test_an_unsteady_row_does_not_count_for_the_winner_or_l_star():
    def row(L, dep, fam, cap, steady=True):
        return {"model": "m", "hardware": "h", "link": "l", "link_gbps": 1.0, "num_gpus": 2, "slo": "p99_tbt",
                "tbt_slo_ms": 100, "context_len": L, "deployment": dep, "family": fam, "capacity_per_gpu": cap,
                "steady": steady}
    rows = [row(1024, "sarathi-2048", "colocated", 10.0), row(1024, "disagg-1P1D", "disaggregated", 5.0),
            row(2048, "sarathi-2048", "colocated", 4.0), row(2048, "disagg-1P1D", "disaggregated", 5.0),
            row(4096, "sarathi-2048", "colocated", 9.0, steady=False), row(4096, "disagg-1P1D", "disaggregated", 3.0)]
    (c,) = crossovers(rows)
    assert c["l_star"] == 2048 and c["best_colocated"] == {"1024": "sarathi-2048", "2048": "sarathi-2048"}
    assert set(c) >= {"model", "hardware", "link", "link_gbps", "num_gpus", "slo", "tbt_slo_ms", "l_star",
                      "best_colocated", "best_disaggregated"}
    # counted, the unsteady 9.0 would have beaten disagg at 4096 and left no L*
    rows[4]["steady"] = True
    assert crossovers(rows)[0]["l_star"] is None


def test_a_winner_inside_a_rivals_bracket_is_a_tie():
    """A capacity is bracketed to [capacity, first failing rate): where the
    other family's bracket reaches above the winner's capacity the order is
    not resolved, and the summary lists that L under `ties`."""
    def row(L, fam, cap, fail, steady=True):
        return {"model": "m", "hardware": "h", "link": "l", "link_gbps": 1.0, "num_gpus": 2, "slo": "p99_tbt",
                "tbt_slo_ms": 100, "context_len": L, "deployment": fam[:6], "family": fam, "capacity_per_gpu": cap,
                "steady": steady, "first_failing_per_gpu": fail}
    rows = [row(1024, "colocated", 10.0, 11.0), row(1024, "disaggregated", 9.5, 10.45),    # 10.45 > 10: a tie
            row(2048, "colocated", 4.0, 4.4), row(2048, "disaggregated", 5.0, 5.5),        # 4.4 < 5: disagg wins
            row(4096, "colocated", 3.0, 3.3), row(4096, "disaggregated", 2.0, 3.5, steady=False),  # not counted
            row(8192, "colocated", 2.5, 2.75), row(8192, "disaggregated", 2.0, ""),        # never failed: a tie
            # the rival failed at the rate the winner passed (its bracket top is the winner's capacity, as
            # the searches' shared grid of rates gives it, rounding included): beaten, not tied
            row(16384, "colocated", 1.9014899999999998, 2.07), row(16384, "disaggregated", 1.74, 1.90149)]
    (c,) = crossovers(rows)
    assert c["ties"] == [1024, 8192]
    assert c["l_star"] is None                                  # the L* rule itself is unchanged
    for r in rows:
        del r["first_failing_per_gpu"]                          # a decision.csv from before the column
    assert crossovers(rows)[0]["ties"] == []


def test_l_star_must_hold_at_every_larger_length():
    assert l_star([1, 2, 4, 8], {1: 5, 2: 1, 4: 5, 8: 1}, {1: 1, 2: 5, 4: 1, 8: 5}) == 8
    assert l_star([1, 2, 4], {1: 5, 2: 5, 4: 5}, {1: 1, 2: 1, 4: 1}) is None
    assert l_star([1, 2, 4], {1: 5}, {1: 1, 2: 1, 4: 1}) == 2          # colocation serves nothing from 2 on
    assert l_star([1, 2, 4], {1: 5}, {1: 1, 2: 1}) == 2                # nothing fits at 4: no winner there


@pytest.mark.parametrize("field,value,message", [
    ("smoothness", ["p95_tbt"], "experiment.smoothness"),
    ("tbt_slos_ms", [], "experiment.tbt_slos_ms"),
    ("num_gpus", [0], "experiment.num_gpus"),
    ("fluidity_min", 1.5, "experiment.fluidity_min"),
    ("ttft_k", 0.0, "experiment.ttft_k"),
    ("reuse", 1.0, "experiment.reuse"),
    ("span_factor", 2.0, "experiment.span_factor"),
    ("colocated", ["orca"], "experiment.colocated"),
    ("max_requests_per_gpu", 5, r"experiment.max_requests_per_gpu: 5 x the fewest GPUs \(2\)"),
    ("tp", {"llama2-70b": 0}, "experiment.tp"),
    ("kv_blocks", {"h100-sxm": 0}, "experiment.kv_blocks"),
    ("kv_blocks", {"h100": 4096}, r"experiment.kv_blocks.*\['h100'\] is no hardware"),
    ("turns", 1, "experiment.turns"),
    ("parallel", "two", "experiment.parallel: 'auto', or a number of worker processes >= 1"),
    ("parallel", "0", "experiment.parallel"),
    ("sweep_by", "link", "experiment.sweep_by: 'link': choose from family, cell"),
])
def test_bad_decision_fields_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(DecisionConfig(), **{field: value}).validate()


def test_decision_kv_blocks_sizes_each_hardwares_workers_and_leaves_the_rest_auto():
    from testbed.experiments.decision_search import point_cfg
    cfg = from_dict({"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "wandb": {"mode": "disabled"}})
    cfg = dataclasses.replace(cfg, experiment=dataclasses.replace(
        DecisionConfig(hardware=["cpu-2w", "h100-sxm"]), kv_blocks={"cpu-2w": 8192}))
    cfg.experiment.validate()
    assert point_cfg(cfg, "tiny", "cpu-2w").num_kv_blocks == 8192
    # the other hardware keeps auto: the memory left after weights (far more than cpu-2w's 2,048 default)
    assert point_cfg(cfg, "llama3-8b", "h100-sxm").num_kv_blocks_from_memory
    plain = dataclasses.replace(cfg, experiment=dataclasses.replace(cfg.experiment, kv_blocks={}))
    assert point_cfg(plain, "tiny", "cpu-2w").num_kv_blocks == 2048


def test_never_fit_share_is_the_lognormal_tail_past_one_workers_kv():
    from testbed.experiments.decision_search import never_fit_share
    e = dataclasses.replace(DecisionConfig(), output_len=32, prompt_sigma=0.1)
    # cpu-2w's 2,048 blocks of 16 at L = 32K: the pool ends just under the median prompt
    assert never_fit_share(e, 32768, 2048, 16) == pytest.approx(0.5, abs=0.01)
    assert never_fit_share(e, 32768, 8192, 16) == 0.0          # 128K tokens: past the 2L clip
    assert never_fit_share(e, 16384, 2048, 16) < 1e-9          # 32K tokens: 7 sigma above a 16K median
    assert never_fit_share(e, 65536, 2048, 16) == 1.0          # below the L/2 clip: nothing fits
    # one sigma above the median: the normal tail, 15.9%
    longest = round(32768 * math.exp(0.1))
    assert never_fit_share(e, 32768, (longest + 31) // 16, 16) == pytest.approx(0.1587, abs=0.003)


def test_the_default_decision_config_validates():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs
    from testbed.model.config import CONF_DIR
    register_configs()
    for name in ("decision", "decision-full"):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = OmegaConf.to_object(compose("config", [f"experiment={name}"]))
        validate(cfg)
        assert cfg.experiment.name == "decision" and cfg.runtime.name == "sim"
        assert cfg.experiment.context_lens[0] == 1024 and cfg.experiment.context_lens[-1] == 1048576


def test_every_deployment_occupies_the_gpu_count_it_is_compared_at():
    from testbed.experiments.deployments import deployments
    cfg = from_dict({"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "wandb": {"mode": "disabled"}})
    e = DecisionConfig(token_budgets=[512], pool_tp=[1, 2])
    deps = deployments(e, 4, 1, reuse=True)
    labels = [d.label for d in deps]
    assert labels[:2] == ["sarathi-512", "adaptive"]
    assert {"disagg-1P3D", "disagg-2P2D", "disagg-3P1D", "disagg-2P1D-p_tp1-d_tp2", "disagg-1P2D-p_tp2-d_tp1",
            "disagg-1P1D-p_tp2-d_tp2", "kvstore-1P3D"} <= set(labels)
    assert {d.family for d in deps} == {"colocated", "disaggregated"}
    for d in deps:
        assert d.num_gpus(cfg) == 4, d.label
    applied = next(d for d in deps if d.label == "disagg-1P2D-p_tp2-d_tp1").apply(cfg)
    assert (applied.prefill.parallel.tp, applied.decode.parallel.tp) == (2, 1)
    assert (applied.prefill_workers, applied.decode_workers) == (1, 2)
    # a model that needs tp=4 has no deployment on 2 GPUs, and only tp >= 4 pools on 8
    assert deployments(e, 2, 4, reuse=False) == []
    assert [d.label for d in deployments(e, 8, 4, reuse=False)][-1] == "disagg-1P1D-p_tp4-d_tp4"


def test_the_winner_changes_with_the_definition_only_when_no_winner_is_shared():
    from testbed.experiments.decision_summary import definition_changes

    def row(slo, dep, cap):
        return {"model": "m", "hardware": "h", "link": "l", "num_gpus": 2, "tbt_slo_ms": 100, "context_len": 1024,
                "slo": slo, "deployment": dep, "capacity_per_gpu": cap, "steady": True}
    tied = [row("p99_tbt", "adaptive", 2.0), row("p99_tbt", "sarathi-2048", 1.0),
            row("fluidity", "adaptive", 2.0), row("fluidity", "sarathi-2048", 2.0)]
    assert definition_changes(tied) == []
    tied[2]["capacity_per_gpu"] = 1.5
    tied[3]["capacity_per_gpu"] = 3.0
    (change,) = definition_changes(tied)
    assert change["winners"] == {"p99_tbt": ["adaptive"], "fluidity": ["sarathi-2048"]}
    for r in tied:                   # nothing served under either definition: no change to report
        r["capacity_per_gpu"] = None
    assert definition_changes(tied) == []


def test_find_capacity_with_the_steady_rule_lengthens_a_short_probe_and_judges_the_window(tmp_path):
    from testbed.capacity import find_capacity
    from omegaconf import OmegaConf
    hardware = OmegaConf.to_container(OmegaConf.load(DATA / "decision_hardware.yaml"))
    cfg = from_dict({"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "wandb": {"mode": "disabled"},
                     "progress": False, "hardware": hardware, "engine": ENGINE,
                     "slo": {"ttft_ms": 35.0, "tpot_ms": 50.0}, "token_budget": 1100,
                     "workload": {"name": "w", "arrival": "poisson", "rate": 50.0, "num_requests": 10,
                                  "prompt_dist": "fixed", "prompt_len": 512, "output_dist": "fixed",
                                  "output_len": 16}})
    rule = SteadyRule(span_factor=10, min_judged=20, max_requests=2000)
    res = find_capacity(cfg, tmp_path, rel_tol=0.2, max_probes=6, log=lambda *_: None, steady=rule)
    first = res.probes[0]
    # 10 requests at 50 req/s span 0.2 s, far below 10 service times (>= 0.17 s each): re-run longer
    assert first.num_requests > 10 and first.steady
    assert res.rate is not None and res.first_failing_rate is not None and res.steady
    saved = json.loads((tmp_path / "capacity.json").read_text())
    assert saved["steady"] is True and all("steady" in p for p in saved["probes"])


def test_decision_deployments_keeps_the_named_rows_and_names_an_unknown_one():
    from testbed.experiments.deployments import deployments
    e = DecisionConfig(token_budgets=[512], deployments=["adaptive", "disagg-1P1D"])
    assert [d.label for d in deployments(e, 2, 1, reuse=False)] == ["adaptive", "disagg-1P1D"]
    e = dataclasses.replace(e, deployments=["disagg-3P1D"])
    with pytest.raises(ValueError, match=r"experiment.deployments: \['disagg-3P1D'\] .*disagg-1P1D"):
        deployments(e, 2, 1, reuse=False)


def test_adaptive_spends_banked_slack_only_under_the_definition_that_credits_it(tmp_path):
    from testbed.experiments.decision_search import judged_run
    from testbed.experiments.decision_slo import get_smoothness
    p99, fluid = get_smoothness("p99_tbt"), get_smoothness("fluidity")
    cfg = dataclasses.replace(constructed(), scheduler="adaptive", experiment=None)
    assert cfg.adaptive.max_slack_tbt > 0
    assert judged_run(cfg, fluid) is cfg
    assert judged_run(cfg, p99).adaptive.max_slack_tbt == 0.0
    assert judged_run(cfg, p99).adaptive.min_budget == cfg.adaptive.min_budget
    sarathi = dataclasses.replace(cfg, scheduler="sarathi")
    assert judged_run(sarathi, p99) is sarathi
    # in the study: adaptive's runs differ per definition (p99_tbt's keyed no-slack), sarathi's are shared
    run_decision(constructed(colocated=["sarathi", "adaptive"], context_lens=[512],
                             deployments=["sarathi-1100", "adaptive"]), tmp_path, lambda *_: None)
    probes = read_rows(tmp_path / "decision_probes.csv")
    judged = {(p["key"].split("/")[3], p["key"].endswith("/no-slack"), p["judged_by"]) for p in probes}
    assert judged == {("sarathi-1100", False, "p99_tbt"), ("adaptive", True, "p99_tbt"),
                      ("adaptive", False, "fluidity")}
    rows = read_rows(tmp_path / "decision.csv")
    assert {(r["deployment"], r["slo"]) for r in rows} == {(d, s) for d in ("sarathi-1100", "adaptive")
                                                          for s in ("p99_tbt", "fluidity")}


def test_a_probe_is_capped_at_max_requests_per_gpu_times_its_deployments_gpus(tmp_path):
    """The arrival rate a deployment is probed at grows with its GPU count N,
    and with it the requests a span of span_factor service times takes: the cap
    is per GPU, so N = 4's probes may run twice as long as N = 2's (a flat cap
    left N = 8's colocated probes at 1K-8K unsteady, and colocation uncounted)."""
    run_decision(constructed(num_gpus=[2, 4], max_requests_per_gpu=12, context_lens=[512],
                             smoothness=["p99_tbt"]), tmp_path, lambda *_: None)
    sizes: dict[int, set[int]] = {}
    for p in read_rows(tmp_path / "decision_probes.csv"):
        sizes.setdefault(int(p["key"].split("/")[2]), set()).add(int(p["num_requests"]))
    # 20 judged over 8 of 10 service times take at least 30 requests: every probe is at its cap
    assert max(sizes[2]) == 24 and max(sizes[4]) == 48
    summary = json.loads((tmp_path / "decision_summary.json").read_text())
    assert summary["assumptions"]["steady_state"]["max_requests_per_gpu"] == 12


def test_a_search_whose_shared_first_prompts_never_fit_ends_at_its_first_probe(tmp_path):
    """513 KV blocks of 16 tokens hold a prompt of 8,193 tokens and its answer's first token: at
    L = 8,192 about half the prompts never fit a worker, among them some of the first ones every
    probe shares (the same seed), so every rate fails `unfinished` and one probe says so where
    halving would take max_probes. At 4,096 everything fits and the search is as before."""
    hardware = str(DATA / "decision_hardware.yaml")
    cfg = constructed(context_lens=[4096, 8192], kv_blocks={hardware: 513}, smoothness=["p99_tbt"])
    run_decision(cfg, tmp_path, lambda *_: None)
    by = {(r["deployment"], int(r["context_len"])): r for r in read_rows(tmp_path / "decision.csv")}
    for dep in ("sarathi-1100", "disagg-1P1D"):
        stuck = by[(dep, 8192)]
        assert (stuck["capacity_per_gpu"], stuck["limited_by"], stuck["probes"], stuck["steady"]) == \
            ("", "unfinished", "1", "True")
    assert by[("disagg-1P1D", 4096)]["bound"] == "bracketed"
    probes = [p for p in read_rows(tmp_path / "decision_probes.csv") if p["key"].split("/")[5] == "8192"]
    assert len(probes) == 2 and {p["verdict"] for p in probes} == {"unfinished"}
    assert all(0 < int(p["num_finished"]) < int(p["num_requests"]) for p in probes)
