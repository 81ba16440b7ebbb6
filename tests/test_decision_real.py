"""The decision study's real-engine rows (testbed/experiments/decision_real.py):
with experiment.real=true, every (deployment, L) of real_context_lens gets
rows with source=real and decision.csv's columns, each matched with the
simulator's row of the same (model, hardware, link, N, SLO, deployment, L)
in decision_summary.json's `sim_vs_real`, and drawn as squares in the
capacity figure. One test runs real worker processes (slow: a few probes of
a few seconds each); the others need none."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402

from testbed.config import from_dict  # noqa: E402
from testbed.experiments.decision import COLUMNS, run_decision  # noqa: E402
from testbed.experiments.decision_summary import MATCH_KEYS, sim_vs_real  # noqa: E402
from figure_capture import capture_figures  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def small(**experiment):
    """tiny on the cpu profile, L = 256, 8-token answers, sarathi-512 and disagg 1P1D on 2 workers;
    probes of at most 12 requests (each real probe runs once: never longer than its first size),
    their arrivals over at most 2 s."""
    e = dict(name="decision", models=["tiny"], hardware=["cpu"], links=["tcp-25"], context_lens=[256],
             token_budgets=[512], colocated=[], ttft_k=50.0, tbt_slos_ms=[500],
             smoothness=["p99_tbt"], output_len=8, prompt_sigma=0.001,
             num_gpus=[2], rate_start=4.0, rel_tol=0.5, max_probes=3,
             span_factor=3.0, min_judged=3, max_requests_per_gpu=6,
             real=True, real_models=["tiny"], real_context_lens=[256], real_probe_s=2.0,
             real_max_probes=2, real_rel_tol=0.5, parallel="1")
    e.update(experiment)
    return from_dict({"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "wandb": {"mode": "disabled"},
                      "progress": False, "experiment": e})


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _measured_lines(figs) -> dict:
    return {line.get_label(): line for fig in figs for ax in fig.axes for line in ax.get_lines()
            if line.get_label().endswith("(measured)")}


@pytest.mark.slow
def test_real_rows_are_measured_on_worker_processes_beside_their_sim_twins(tmp_path, monkeypatch):
    figs = capture_figures(monkeypatch, dpi=40)
    run_decision(small(), tmp_path, print)
    rows = read_rows(tmp_path / "decision.csv")
    assert list(rows[0]) == list(COLUMNS)
    real = [r for r in rows if r["source"] == "real"]
    sim = [r for r in rows if r["source"] == "sim"]
    assert {r["deployment"] for r in real} == {r["deployment"] for r in sim} == {"sarathi-512", "disagg-1P1D"}
    for r in real:
        assert (r["model"], r["hardware"], r["num_gpus"], r["context_len"]) == ("tiny", "cpu", "2", "256")
        assert int(r["probes"]) >= 1 and r["bound"] in ("bracketed", "lower", "none")
        assert r["steady"] in ("True", "False")
        assert r["bound"] == "none" or float(r["capacity_per_gpu"]) > 0
    # every measured row has its twin, matched by MATCH_KEYS
    summary = json.loads((tmp_path / "decision_summary.json").read_text())
    pairs = summary["sim_vs_real"]
    assert len(pairs) == len(real) and all(p["has_sim"] for p in pairs)
    by_key = {tuple(r[k] for k in MATCH_KEYS): r for r in sim}
    for p in pairs:
        twin = by_key[tuple(str(p[k]) for k in MATCH_KEYS)]
        assert str(p["sim_capacity_per_gpu"] or "") == twin["capacity_per_gpu"]
    assert summary["assumptions"]["real"]["num_probe_runs"] >= 2
    # the probes really ran: requests served on the wall clock, the load recorded
    probes = [p for p in read_rows(tmp_path / "decision_probes.csv") if p["source"] == "real"]
    assert probes and all(int(p["num_finished"]) > 0 and float(p["wall_s"]) > 0 for p in probes)
    assert all(float(p["load_1m"]) >= 0 for p in probes)
    # each probe row names its kept records: the requests it judged and the iterations that served them
    assert not any(p["records"] for p in read_rows(tmp_path / "decision_probes.csv") if p["source"] == "sim")
    for p in probes:
        kept = tmp_path / "real_probes" / p["records"]
        point = json.loads((kept / "probe.json").read_text())
        assert point["rate"] == pytest.approx(float(p["rate"])) and point["num_requests"] == int(p["num_requests"])
        assert point["mode"] == ("disagg" if p["key"].split("/")[3].startswith("disagg") else "colocated")
        requests = [json.loads(line) for line in (kept / "requests.jsonl").read_text().splitlines()]
        assert len(requests) == int(p["num_requests"])
        assert sum(r["status"] == "finished" for r in requests) == int(p["num_finished"])
        iterations = [json.loads(line) for line in (kept / "iterations.jsonl").read_text().splitlines()]
        assert iterations and all(it["duration_s"] > 0 for it in iterations)
    # the figure holds them, as squares on a dashed line of their own
    path = tmp_path / "capacity_tiny_cpu_2gpu_p99_tbt_500ms_tcp-25.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    lines = _measured_lines(figs)
    assert set(lines) == {"sarathi-512 (measured)", "disagg-1P1D (measured)"}
    assert all(list(line.get_xdata()) == [256] and line.get_linestyle() == "--" for line in lines.values())


def test_real_rows_past_the_budget_are_flagged_not_measured(tmp_path, monkeypatch):
    """A budget already spent: no real probe runs; every real row is there,
    flagged (no capacity, steady=false, limited_by=budget), beside its twin,
    and the simulator's rows are those of a run without real rows."""
    figs = capture_figures(monkeypatch, dpi=40)
    run_decision(small(real_budget_s=1e-9, context_lens=[256, 512], real_context_lens=[256, 512]),
                 tmp_path, lambda *_: None)
    rows = read_rows(tmp_path / "decision.csv")
    real = [r for r in rows if r["source"] == "real"]
    assert len(real) == 4
    assert {(r["capacity_per_gpu"], r["bound"], r["limited_by"], r["steady"], r["probes"]) for r in real} == {
        ("", "none", "budget", "False", "0")}
    lines = _measured_lines(figs)            # drawn, with nothing to draw at a flagged point
    assert set(lines) == {"sarathi-512 (measured)", "disagg-1P1D (measured)"}
    pairs = json.loads((tmp_path / "decision_summary.json").read_text())["sim_vs_real"]
    assert all(p["has_sim"] and p["real_over_sim"] is None for p in pairs)
    assert not [p for p in read_rows(tmp_path / "decision_probes.csv") if p["source"] == "real"]
    alone = tmp_path / "sim_only"
    alone.mkdir()
    run_decision(small(real=False, context_lens=[256, 512]), alone, lambda *_: None)
    assert [r for r in rows if r["source"] == "sim"] == read_rows(alone / "decision.csv")


def test_sim_vs_real_matches_rows_by_every_key():
    def row(source, dep="disagg-1P1D", L=1024, cap=2.0, link="tcp-25", steady=True, fail=None):
        return {"model": "tiny", "hardware": "cpu", "link": link, "num_gpus": 2, "slo": "p99_tbt", "tbt_slo_ms": 100,
                "deployment": dep, "context_len": L, "capacity_per_gpu": cap, "steady": steady,
                "limited_by": "ttft", "source": source, "first_failing_per_gpu": fail}
    rows = [row("sim", cap=4.0), row("sim", L=2048, cap=1.0), row("sim", dep="adaptive", cap=8.0),
            row("real", cap=2.0, fail="2.83"), row("real", L=2048, cap=1.5, steady=False), row("real", link="rdma-100")]
    pairs = sim_vs_real(rows)
    assert [(p["context_len"], p["deployment"], p["has_sim"]) for p in pairs] == [
        (1024, "disagg-1P1D", True), (2048, "disagg-1P1D", True), (1024, "disagg-1P1D", False)]
    assert pairs[0]["real_over_sim"] == 0.5 and pairs[0]["sim_capacity_per_gpu"] == 4.0
    assert pairs[0]["real_over_sim_upper"] == 2.83 / 4.0           # the real bracket [2.0, 2.83) over 4.0
    assert pairs[1]["real_over_sim_upper"] is None and pairs[2]["real_over_sim_upper"] is None
    assert pairs[1]["real_over_sim"] is None and pairs[1]["real_steady"] is False   # unsteady: no ratio
    assert pairs[2]["sim_capacity_per_gpu"] is None


@pytest.mark.parametrize("change,message", [
    ({"real_models": ["mid"]}, "experiment.real_models"),
    ({"hardware": ["h100-sxm"]}, "experiment.hardware"),
    ({"real_num_gpus": 4}, "experiment.real_num_gpus"),
    ({"real_context_lens": [256, 1024]}, "experiment.real_context_lens"),
])
def test_real_rows_without_sim_twins_are_refused_before_any_probe(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        run_decision(small(**change), tmp_path, lambda *_: None)
    assert not list(tmp_path.iterdir())


class _NothingFinishes:
    """A runner whose every request failed (as when a real probe's drain bound cuts them all)."""
    source = "real"
    last_dir = ""

    def __init__(self, none_finished_is_memory: bool):
        self.none_finished_is_memory = none_finished_is_memory
        self.runs = 0

    def records(self, cfg, requests):
        from testbed.metrics import RequestRecord
        self.runs += 1
        return [RequestRecord(r.request_id, "failed", r.prompt_len, [], r.arrival_s) for r in requests]


def _search(runner, deadline=None):
    import time as _time

    from testbed.experiments.decision_prober import Prober
    from testbed.experiments.decision_search import _workload, point_cfg, search
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    from testbed.experiments.deployments import deployments, replace_run
    from testbed.steady_state import SteadyRule
    cfg = small()
    dep = deployments(cfg.experiment, 2, 1, reuse=False)[0]
    run_cfg = replace_run(dep.apply(point_cfg(cfg, "tiny", "cpu")), workload=_workload(cfg.experiment, 256))
    prober = Prober(SteadyRule(3.0, 3, 12), lambda *_: None, runner, max_span_s=1.0, max_lengthenings=0,
                    deadline=None if deadline is None else _time.monotonic() + deadline)
    return search(prober, ("k",), run_cfg, get_smoothness("p99_tbt"), SLOTargets(500.0, 500.0), 8.0, 0.1, 0.1, 4)


class _Overloads:
    """A server that keeps every request at 100 ms up to 10 req/s and past
    that falls behind, request i taking 100 + 20 i ms: above capacity the
    service time grows with the probe, so no failing probe is ever steady."""
    source = "sim"
    last_dir = ""
    none_finished_is_memory = True

    def records(self, cfg, requests):
        from testbed.metrics import RequestRecord
        slow = cfg.workload.rate > 10.0
        out = []
        for i, r in enumerate(requests):
            done = r.arrival_s + 0.1 + (0.02 * i if slow else 0.0)
            out.append(RequestRecord(r.request_id, "finished", r.prompt_len, [1], r.arrival_s,
                                     first_scheduled_s=r.arrival_s, first_token_s=done, token_times_s=[done],
                                     finish_s=done))
        return out


def test_a_capacity_probe_steady_in_its_window_counts_though_the_failing_one_above_cannot_be():
    from testbed.experiments.decision_prober import Prober
    from testbed.experiments.decision_search import _workload, point_cfg, search
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    from testbed.experiments.deployments import deployments, replace_run
    from testbed.steady_state import SteadyRule
    cfg = small()
    dep = deployments(cfg.experiment, 2, 1, reuse=False)[0]
    run_cfg = replace_run(dep.apply(point_cfg(cfg, "tiny", "cpu")), workload=_workload(cfg.experiment, 256))
    prober = Prober(SteadyRule(10.0, 5, 400), lambda *_: None, _Overloads())
    res = search(prober, ("k",), run_cfg, get_smoothness("p99_tbt"), SLOTargets(500.0, 500.0), 8.0, 0.1, 0.1, 8)
    assert res.bound == "bracketed" and 8.0 <= res.capacity <= 10.0 < res.first_failing <= 11.0 * 1.1
    rows = {round(float(r["rate"]), 6): r for r in prober.rows}
    assert rows[round(res.capacity, 6)]["steady"] and not rows[round(res.first_failing, 6)]["steady"]
    assert res.steady and res.limited_by == "ttft"


def test_a_real_probe_where_nothing_finished_fails_its_rate_instead_of_ending_the_search():
    """On the simulator no request finishing means the prompt never fits: one
    probe settles it. On the real engine it means the rate overloaded the
    drain bound: the search halves on, to max_probes."""
    memory = _NothingFinishes(none_finished_is_memory=True)
    res = _search(memory)
    assert (res.capacity, res.bound, res.limited_by, res.probes, memory.runs) == (None, "none", "unfinished", 1, 1)
    overload = _NothingFinishes(none_finished_is_memory=False)
    res = _search(overload)
    assert (res.capacity, res.bound, res.limited_by, res.probes, overload.runs) == (None, "none", "unfinished", 4, 4)


def test_a_search_past_the_real_budget_starts_no_probe_and_is_flagged():
    runner = _NothingFinishes(none_finished_is_memory=False)
    res = _search(runner, deadline=-1.0)
    assert (res.capacity, res.limited_by, res.steady, res.probes, runner.runs) == (None, "budget", False, 0, 0)


def test_a_real_point_lets_a_worker_stay_silent_as_long_as_a_request_may_drain():
    # a whole prefill of a long prompt is one step with no message: at L = 32K on this CPU ~100 s,
    # which the default 60 s hang timeout took for a hung worker (1P1D's prefill worker killed)
    from testbed.experiments.decision_real import real_point
    from testbed.sim.config import load_link_preset
    cfg = from_dict({"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "wandb": {"mode": "disabled"}})
    link = load_link_preset("tcp-25")
    long = real_point(cfg, link, 178.0)
    assert long.runtime.name == "real" and long.timeout_s == 178.0
    assert long.runtime.hang_timeout_s == 178.0
    short = real_point(cfg, link, 20.0)
    assert short.runtime.hang_timeout_s == cfg.runtime.hang_timeout_s == 60.0
