"""The decision study's prior brackets (testbed/experiments/decision_brackets.py):
a search started from the neighbouring length's capacity finds the capacity
the unseeded search finds, in fewer probes; a deployment skipped as
`dominated` is one that failed at a capacity its family's best passed in the
same cell, and skipping it changes no winner."""
from __future__ import annotations

import math
from pathlib import Path

from testbed.config import from_dict
from testbed.experiments.decision import run_decision
from testbed.experiments.decision_brackets import Known, below_dominated, best_first, neighbour_brackets
from testbed.experiments.decision_search import Search
from testbed.experiments.decision_summary import DOMINATED
from testbed.experiments.decision_summary import best_by_family, winners
from testbed.experiments.deployments import Deployment

from decision_case import DATA, constructed, read_rows  # noqa: E402  (tests/ on sys.path: conftest)

CELL = ("link", "slo", "tbt_slo_ms", "context_len")


def tiny_on_cpu(prior: bool) -> object:
    """tiny on the profiled cpu preset: sarathi-256 and disagg-1P1D at four lengths."""
    e = dict(name="decision", models=["tiny"], hardware=["cpu"], links=[str(DATA / "decision_link.yaml")],
             context_lens=[256, 512, 1024, 2048], token_budgets=[256], colocated=["sarathi"], tbt_slos_ms=[100],
             smoothness=["p99_tbt"], output_len=16, num_gpus=[2], rel_tol=0.1, max_probes=10, min_judged=20,
             max_requests_per_gpu=300, real=False, parallel="1", prior_brackets=prior)
    return from_dict({"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "wandb": {"mode": "disabled"},
                      "progress": False, "experiment": e})


def study(cfg, out: Path) -> list[dict]:
    out.mkdir()
    run_decision(cfg, out, lambda *_: None)
    return read_rows(out / "decision.csv")


def test_a_neighbour_length_bracket_finds_the_unseeded_capacity_in_fewer_probes(tmp_path):   # ~20 s here
    seeded, unseeded = study(tiny_on_cpu(True), tmp_path / "seeded"), study(tiny_on_cpu(False), tmp_path / "plain")
    assert len(seeded) == len(unseeded) == 2 * 4
    for a, b in zip(seeded, unseeded):
        assert (a["deployment"], a["context_len"]) == (b["deployment"], b["context_len"])
        assert a["bound"] == b["bound"] == "bracketed" and a["steady"] == b["steady"] == "True"
        lo_a, hi_a = float(a["capacity_per_gpu"]), float(a["first_failing_per_gpu"])
        lo_b, hi_b = float(b["capacity_per_gpu"]), float(b["first_failing_per_gpu"])
        # each bracket holds the capacity to within rel_tol; the two overlap: the same capacity
        assert hi_a / lo_a <= 1.1 + 1e-9 and hi_b / lo_b <= 1.1 + 1e-9
        assert lo_a < hi_b and lo_b < hi_a
        if a["context_len"] == "256":          # the grid's first L: nothing known, the same search
            assert a == b
    probes = lambda rows: sum(int(r["probes"]) for r in rows)
    assert probes(seeded) < probes(unseeded)
    # at a later L a guess that holds ends the search in two probes
    assert any(r["probes"] == "2" and r["context_len"] != "256" for r in seeded)


def test_a_skipped_deployment_failed_at_its_familys_measured_capacity_in_the_cell(tmp_path):
    """N = 4 of the constructed case (decision_case.py): prefill binds, so 3P1D
    outserves 2P2D and 1P3D. Those fail at 3P1D's capacity, or below it at their
    own bracket's top, and are skipped; the winners and each family's best are
    those of the full searches."""
    kw = dict(num_gpus=[4], pool_tp=[1], context_lens=[512, 1024, 4096])
    rows, full = study(constructed(**kw), tmp_path / "skip"), study(constructed(prior_brackets=False, **kw),
                                                                    tmp_path / "full")
    probes = {(p["key"].split("/")[3], p["key"].split("/")[5], round(float(p["rate"]), 6)): p["verdict"]
              for p in read_rows(tmp_path / "skip" / "decision_probes.csv")}
    dominated = [r for r in rows if r["limited_by"] == DOMINATED]
    assert dominated and not any(r["limited_by"] == DOMINATED for r in full)
    cell = lambda r: tuple(r[k] for k in CELL)
    for r in dominated:
        rivals = [s for s in rows if cell(s) == cell(r) and s["family"] == r["family"] and s["capacity_per_gpu"]
                  and s["steady"] == "True"]
        best = max(float(s["capacity_per_gpu"]) for s in rivals)
        assert r["capacity_per_gpu"] == "" and r["probes"] == "1"
        # the bound is a verdict: the deployment's own probe (its 4 GPUs) failed at the family's best, or
        # below it at its own bracket's top
        failed = float(r["first_failing_per_gpu"])
        assert failed <= best * (1 + 1e-12)
        assert probes[(r["deployment"], r["context_len"], round(failed * 4, 6))] not in ("pass", "unjudged")
    for key in {cell(r) for r in rows}:
        here, there = [r for r in rows if cell(r) == key], [r for r in full if cell(r) == key]
        assert winners(here) == winners(there)
        for family in ("colocated", "disaggregated"):
            assert {L: d for L, (d, _) in best_by_family(here, family).items()} == \
                {L: d for L, (d, _) in best_by_family(there, family).items()}
    assert sum(int(r["probes"]) for r in rows) < sum(int(r["probes"]) for r in full)


def test_the_likely_winner_goes_first_and_a_dominated_rate_is_no_guess():
    deps = [Deployment(label, "disaggregated", "disagg", "vllm_v0") for label in ("a", "b", "c")]
    known = {d.label: Known() for d in deps}
    assert best_first(deps, known, None) == deps                                    # nothing known: the grid's
    known["a"].found[512] = Search(None, "none", DOMINATED, True, 1, first_failing=30.0)
    known["b"].found[512] = Search(10.0, "bracketed", "ttft", True, 4, first_failing=11.0)
    known["c"].found[512] = Search(20.0, "bracketed", "ttft", True, 4, first_failing=22.0)
    assert [d.label for d in best_first(deps, known, 512)] == ["c", "b", "a"]
    known["c"].searches[512] = {(100, "p99_tbt"): known["c"].found[512],
                                (100, "fluidity"): Search(None, "none", "unfinished", True, 1, first_failing=5.0)}
    known["a"].searches[512] = {(100, "p99_tbt"): known["a"].found[512]}
    work = {512: 1.0, 1024: 2.0}
    guesses = neighbour_brackets(known["c"], 1024, 512, work, 0.1)
    assert list(guesses) == [(100, "p99_tbt")]                                  # no capacity: no guess
    lo, hi = guesses[(100, "p99_tbt")]
    assert math.isclose(lo * hi, 10.0 ** 2) and math.isclose(hi / lo, 1.1)      # centred on 20 x 1/2
    assert neighbour_brackets(known["a"], 1024, 512, work, 0.1) == {}
    # dominated at 512 (failed at 30 req/s): below that rate, scaled by the work; only for it
    assert below_dominated(known["a"], 1024, 512, work, 0.1) == {(100, "p99_tbt"): (15.0 / 1.1, 15.0)}
    assert below_dominated(known["c"], 1024, 512, work, 0.1) == {}


class ScriptedProber:
    """A Prober whose probes pass below `capacity` (req/s) and miss the TTFT above it, each judging
    `judged(rate)` requests, steady where `steady(rate)`; the search under test sees only these
    figures. As the Prober does, it replays a rate it ran (`made`: the rates it ran)."""

    def __init__(self, capacity: float, judged, smooth, targets, steady=lambda rate: True,
                 overloaded=lambda rate: False):
        from testbed.steady_state import SteadyRule
        self.capacity, self.judged, self.steady, self.rates, self.min_judged = capacity, judged, steady, [], []
        self.overloaded = overloaded
        self.key = f"{smooth.name} {targets.ttft_ms!r} {targets.tbt_ms!r} {targets.fluidity_min!r}"
        self.rule, self.service_s, self.made = SteadyRule(10.0, 20, 1000), {}, {}
        self.runner = type("Runner", (), {"none_finished_is_memory": True})()

    def probe(self, key, cfg, rate, first_service_s, limit, asker, max_requests, rule_out=0):
        from testbed.experiments.decision_prober import ProbeRun
        from testbed.steady_state import Window
        self.rates.append(rate)
        self.min_judged.append(rule_out)
        if rate not in self.made:
            self.made[rate] = ProbeRun(Window([], self.steady(rate), "ok", 100.0, 1.0), 200, 200,
                                       num_judged=self.judged(rate), overloaded=self.overloaded(rate),
                                       verdicts={self.key: "" if rate <= self.capacity else "ttft"})
        return self.made[rate]

    def known(self, key):
        return self.made


def test_a_failure_at_the_ceiling_over_few_judged_requests_rules_nothing_out():
    """A p99 over fewer than 100 judged requests is the worst one's: failing the ceiling there, the
    search goes on (and finds the capacity); over enough of them it ends, dominated, in one probe.
    With a bracket of its own below the ceiling, that bracket's top is the rate probed: a probe
    near its capacity rather than an overloaded one."""
    from testbed.experiments.decision_search import MIN_JUDGED_TO_SKIP, search
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    smooth, targets = get_smoothness("p99_tbt"), SLOTargets(1000.0, 100.0)
    cfg = tiny_on_cpu(True)
    for bracket, first in ((None, 10.0), ((8.5, 9.35), 9.35)):
        for judged, dominated in ((MIN_JUDGED_TO_SKIP - 1, False), (MIN_JUDGED_TO_SKIP, True)):
            prober = ScriptedProber(8.0, lambda rate, j=judged: j, smooth, targets)
            res = search(prober, ("k",), cfg, smooth, targets, 4.0, 1.0, 0.1, 10, bracket, ceiling=10.0)
            assert prober.rates[0] == first and prober.min_judged[0] == MIN_JUDGED_TO_SKIP  # sized to rule out
            if dominated:
                assert (res.capacity, res.limited_by, res.probes, res.first_failing) == (None, DOMINATED, 1, first)
            else:
                assert res.limited_by == "ttft" and 8.0 / 1.1 <= res.capacity <= 8.0 < res.first_failing


def test_an_overloaded_probe_at_the_ceiling_rules_out_one_that_judged_none_does_not():
    """An unjudged probe at the ceiling says nothing (the search goes on), unless the Prober found
    its queue growing with the run (ProbeRun.overloaded): then its capacity lies below that rate."""
    from testbed.experiments.decision_search import search
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    smooth, targets = get_smoothness("p99_tbt"), SLOTargets(1000.0, 100.0)
    unjudged_above = lambda rate: 0 if rate > 8.0 else 200
    for overloaded in (False, True):
        prober = ScriptedProber(8.0, unjudged_above, smooth, targets, overloaded=lambda rate, o=overloaded: o)
        res = search(prober, ("k",), tiny_on_cpu(True), smooth, targets, 4.0, 1.0, 0.1, 10, None, ceiling=10.0)
        assert prober.rates[0] == 10.0
        if overloaded:
            assert (res.capacity, res.limited_by, res.probes, res.first_failing) == (None, DOMINATED, 1, 10.0)
        else:
            assert res.probes > 1 and 8.0 / 1.1 <= res.capacity <= 8.0


def test_with_sweep_by_cell_either_familys_best_rules_the_other_out(tmp_path):
    """The constructed case in one sweep: sarathi outserves disagg-1P1D at L <= 1,024 and serves
    nothing from 4,096 on. At 512 and 1,024 disagg fails at sarathi's measured capacity; at 8,192
    disagg (which won 4,096) goes first and sarathi fails at its capacity. Every skipped row's
    bound is at most the other family's measured best, its own probe failed there, and the
    winners and L* are those of the full searches, in fewer probes than family by family."""
    from testbed.experiments.decision_grid import sweeps
    from testbed.experiments.decision_summary import crossovers
    # every probe judging 100 requests: each capacity then stands on as long a probe as a rival's failure
    cell = constructed(sweep_by="cell", min_judged=100)
    assert [[d.label for d in s.deployments] for s in sweeps(cell)] == [["sarathi-1100", "disagg-1P1D"]]
    rows = study(cell, tmp_path / "cell")
    full = study(constructed(prior_brackets=False, min_judged=100), tmp_path / "full")
    family = study(constructed(min_judged=100), tmp_path / "family")
    probes = {(p["key"].split("/")[3], p["key"].split("/")[5], round(float(p["rate"]), 6)): p["verdict"]
              for p in read_rows(tmp_path / "cell" / "decision_probes.csv")}
    key = lambda r: tuple(r[k] for k in CELL)
    dominated = {(r["deployment"], r["context_len"]) for r in rows if r["limited_by"] == DOMINATED}
    assert dominated == {("disagg-1P1D", "512"), ("disagg-1P1D", "1024"), ("sarathi-1100", "8192")}
    for r in rows:
        if r["limited_by"] != DOMINATED:
            continue
        rival = max(float(s["capacity_per_gpu"]) for s in rows if key(s) == key(r) and s["capacity_per_gpu"]
                    and s["family"] != r["family"] and s["steady"] == "True")
        assert r["capacity_per_gpu"] == "" and r["probes"] == "1"
        failed = float(r["first_failing_per_gpu"])
        assert failed <= rival * (1 + 1e-12)
        assert probes[(r["deployment"], r["context_len"], round(failed * 2, 6))] not in ("pass", "unjudged")
    for k in {key(r) for r in rows}:
        assert winners([r for r in rows if key(r) == k]) == winners([r for r in full if key(r) == k])
    lstar = lambda rs: [(c["slo"], c["l_star"]) for c in crossovers(rs)]
    assert lstar(rows) == lstar(full) and {L for _, L in lstar(rows)} == {4096}
    total = lambda rs: sum(int(r["probes"]) for r in rs)
    assert total(rows) < total(family) and total(rows) < total(full)


def test_a_colocated_row_is_ruled_out_only_by_the_link_familys_lowest_best_over_every_link():
    """CellBest: a colocated deployment's rate to beat is the link family's lowest best over the
    links, once every link has one; a link-using one's the higher of its link's best and the
    colocated best. A capacity counts only where its probe was steady and judged 100 requests."""
    from testbed.experiments.decision_brackets import CellBest
    from testbed.experiments.decision_search import MIN_JUDGED_TO_SKIP
    sarathi = Deployment("sarathi-512", "colocated", "colocated", "sarathi", 512, uses_link=False)
    pd = Deployment("disagg-1P1D", "disaggregated", "disagg", "vllm_v0")
    row = lambda cap, steady=True: {"capacity_per_gpu": cap, "steady": steady, "tbt_slo_ms": 100, "slo": "p99_tbt"}
    judged = lambda n: {(100, "p99_tbt"): Search(1.0, "bracketed", "ttft", True, 2, 1.1, judged=n)}
    best = CellBest(2)
    best.add(pd, 0, [row(5.0)], judged(MIN_JUDGED_TO_SKIP))
    assert best.ceilings(sarathi, 0) == {}                       # the second link has none yet
    best.add(pd, 1, [row(3.0)], judged(MIN_JUDGED_TO_SKIP - 1))  # too short a probe to rule out by
    best.add(pd, 1, [row(9.0, steady=False)], judged(500))       # an unsteady capacity is no bound
    assert best.ceilings(sarathi, 0) == {}
    best.add(pd, 1, [row(3.0)], judged(MIN_JUDGED_TO_SKIP))
    assert best.ceilings(sarathi, 0) == {(100, "p99_tbt"): 3.0}
    assert best.ceilings(pd, 1) == {(100, "p99_tbt"): 3.0} and best.link_family_leads()
    best.add(sarathi, 0, [row(4.0)] * 2, judged(MIN_JUDGED_TO_SKIP))     # its row under each link
    assert best.ceilings(pd, 0) == {(100, "p99_tbt"): 5.0} and best.ceilings(pd, 1) == {(100, "p99_tbt"): 4.0}
    assert best.ceilings(sarathi, 0) == {(100, "p99_tbt"): 4.0}
    assert not best.link_family_leads()                         # one link each: a tie


def test_a_search_passing_the_ceiling_probes_one_tolerance_above_it_next():
    from testbed.experiments.decision_search import search
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    smooth, targets = get_smoothness("p99_tbt"), SLOTargets(1000.0, 100.0)
    prober = ScriptedProber(8.0, lambda rate: 200, smooth, targets)
    res = search(prober, ("k",), tiny_on_cpu(True), smooth, targets, 4.0, 1.0, 0.1, 10, None, ceiling=7.5)
    # not doubling from the ceiling: two rates (the Prober replays a rate it ran: one run each)
    assert list(dict.fromkeys(prober.rates)) == [7.5, 7.5 * 1.1]
    assert (res.capacity, res.first_failing, res.probes) == (7.5, 7.5 * 1.1, 2)


def test_a_failure_another_search_measured_below_the_ceiling_rules_it_out_with_no_new_run():
    """Another TBT target's or SLO definition's search on the same runs failed at 10 req/s over
    200 judged requests (or overloaded there, judging none): a search whose ceiling lies above
    that rate is ruled out by that run (above a failing rate every rate fails), `dominated` at
    10 req/s with no new run; over 50 judged requests, or without reuse, it probes the ceiling."""
    from testbed.experiments.decision_search import search
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    smooth, targets = get_smoothness("p99_tbt"), SLOTargets(1000.0, 100.0)
    cfg = tiny_on_cpu(True)
    cases = ((lambda rate: 200, lambda rate: False, True, True), (lambda rate: 0, lambda rate: True, True, True),
             (lambda rate: 50, lambda rate: False, True, False), (lambda rate: 200, lambda rate: False, False, False))
    for judged, overloaded, reuse, ruled_out in cases:
        prober = ScriptedProber(8.0, judged, smooth, targets, overloaded=overloaded)
        prober.probe(("k",), cfg, 10.0, 1.0, None, "other", None)    # the other search's failing run
        res = search(prober, ("k",), cfg, smooth, targets, 4.0, 1.0, 0.1, 10, (11.0, 12.1), ceiling=12.0,
                     reuse=reuse)
        if ruled_out:
            assert list(prober.made) == [10.0] and prober.rates[-1] == 10.0
            assert (res.capacity, res.limited_by, res.probes, res.first_failing) == (None, DOMINATED, 1, 10.0)
        else:
            assert 12.0 in prober.made and (res.limited_by, res.first_failing) != (DOMINATED, 10.0)


def test_a_search_on_runs_another_search_made_starts_from_their_bracket_where_it_is_narrow():
    """Another SLO definition's or TBT target's search on the same runs: where those runs, judged
    by this search, hold a steady pass and a failure above it within two bisections of rel_tol,
    the search starts there (reuse=True) rather than at its own guess, and ends on those runs;
    their failure below a ceiling over 100 judged requests rules it out with no new run; an
    unsteady pass or a bracket too wide for two probes is no start."""
    from testbed.experiments.decision_search import MIN_JUDGED_TO_SKIP, search
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    smooth, targets = get_smoothness("p99_tbt"), SLOTargets(1000.0, 100.0)
    cfg = tiny_on_cpu(True)

    def first_search(**prober_args) -> ScriptedProber:
        prober = ScriptedProber(8.0, lambda rate: 200, smooth, targets, **prober_args)
        search(prober, ("k",), cfg, smooth, targets, 4.0, 1.0, 0.1, 10)     # 4, 8, 16, then bisects to 8.72
        assert sorted(prober.made)[:2] == [4.0, 8.0] and 8.0 < min(r for r in prober.made if r > 8) < 8.8
        return prober

    prober = first_search()
    ran = set(prober.made)
    res = search(prober, ("k",), cfg, smooth, targets, 4.0, 1.0, 0.1, 10, (6.0, 6.6), reuse=True)
    assert set(prober.made) == ran and res.capacity == 8.0 and res.probes == 2     # no new run
    # without reuse, its own guess: new runs, the same capacity within rel_tol
    res = search(prober, ("k",), cfg, smooth, targets, 4.0, 1.0, 0.1, 10, (6.0, 6.6))
    assert set(prober.made) > ran and 8.0 / 1.1 <= res.capacity <= 8.0
    # known runs fail below the ceiling over enough judged requests: dominated, no new run
    prober = first_search()
    ran = set(prober.made)
    res = search(prober, ("k",), cfg, smooth, targets, 4.0, 1.0, 0.1, 10, (6.0, 6.6), ceiling=9.0, reuse=True)
    assert set(prober.made) == ran and res.limited_by == DOMINATED and res.probes == 1
    assert res.first_failing == min(r for r in ran if r > 8.0)
    # a known pass above the ceiling: nothing to rule out, and no probe at the ceiling
    res = search(prober, ("k",), cfg, smooth, targets, 4.0, 1.0, 0.1, 10, (6.0, 6.6), ceiling=7.5, reuse=True)
    assert set(prober.made) == ran and res.capacity == 8.0 and 7.5 not in prober.rates
    # 8 req/s passed unsteadily: the steady pass below it (4) is more than two bisections away
    prober = first_search(steady=lambda rate: rate != 8.0)
    ran = set(prober.made)
    search(prober, ("k",), cfg, smooth, targets, 4.0, 1.0, 0.1, 10, (6.0, 6.6), reuse=True)
    assert {6.0, 6.6} <= set(prober.made) - ran
    assert MIN_JUDGED_TO_SKIP <= 200
