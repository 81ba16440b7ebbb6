"""`experiment=decision`: which deployment serves more requests per GPU within
the SLOs as the context length L grows, and where the answer flips (the
system crossover L*), per model, hardware, interconnect and GPU count N, on
the simulator.

For each L of the grid the workload is Poisson arrivals of prompts of ~L
tokens (lognormal, median L, shape decision_prompt_sigma) with a fixed output
length (optionally multi-turn with prefix reuse). The SLOs (decision_slo.py):
TTFT <= k x one GPU's whole-prefill time of an L-token prompt, and smoothness
by p99 TBT or by the fluidity index, at each TBT target. Every deployment of
deployments.py on N GPUs gets its capacity (testbed/capacity.py's
search_rate) from probes that reach a steady state (testbed/steady_state.py);
a probe run is shared by every SLO that judges it. Colocated deployments do
not touch the link, so they run once per (model, hardware, N) and their rows
repeat per link.

Writes decision.csv (one row per model, hardware, link, N, SLO, L and
deployment), decision_summary.json (L* and the best deployment of each family
per L, decision_summary.py), decision_probes.csv, and the figures of
decision_figures.py: a phase diagram per model/hardware/N/SLO (the winning
family per L and link, L* drawn) and capacity per GPU against L per link."""
from __future__ import annotations

import csv
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from testbed.capacity import search_rate
from testbed.config import RunConfig, validate
from testbed.experiments.decision_figures import capacity_series, decision_figures
from testbed.experiments.decision_slo import SLOTargets, Smoothness, get_smoothness
from testbed.experiments.decision_summary import crossovers, definition_changes
from testbed.experiments.deployments import Deployment, deployments, replace_run
from testbed.model.config import load_model_preset
from testbed.sim.config import ParallelConfig, load_hardware_preset, load_link_preset
from testbed.steady_state import SteadyRule, Window
from testbed.workloads.config import WorkloadConfig

COLUMNS = ("model", "hardware", "link", "link_gbps", "num_gpus", "slo", "tbt_slo_ms", "ttft_slo_ms", "context_len",
           "deployment", "family", "capacity_per_gpu", "bound", "limited_by", "steady", "probes", "source")


@dataclass
class ProbeRun:
    window: Window
    num_requests: int
    num_finished: int


class Prober:
    """Runs probes on the simulator, each sized by the steady-state rule from
    the longest service time of the last passing probe; a probe that passed
    but came out too short is re-run as long as the rule asks, at most twice
    (a short burst that passes is the false answer to guard against; a longer
    probe sees a longer service-time tail, so the target moves). A failing one
    is lengthened only when at most 3x longer would do: an overloaded probe has no
    steady state to reach (its service times grow with the queue), and stays
    flagged when too short. Remembers every run by
    (deployment, link, L, SLO the run reads, rate) so SLO definitions share them.
    `passes(run)` says whether a run meets the SLOs of the search asking."""

    MAX_LENGTHENINGS = 2    # a service time that still grows after two is the rate's, not the probe's

    def __init__(self, rule: SteadyRule, log):
        self.rule, self.log = rule, log
        self.runs: dict[tuple, ProbeRun] = {}
        self.service_s: dict[tuple, float] = {}        # the latest measured longest service time
        self.rows: list[dict] = []                     # decision_probes.csv
        self.num_runs = 0

    def probe(self, key: tuple, cfg: RunConfig, rate: float, first_service_s: float,
              passes: Callable[[ProbeRun], bool]) -> ProbeRun:
        if (*key, rate) in self.runs:
            return self.runs[(*key, rate)]
        service = self.service_s.get(key, first_service_s)
        n = self.rule.num_requests(rate, service)
        run = self._run(cfg, rate, n)
        passed = passes(run)
        for _ in range(self.MAX_LENGTHENINGS):
            needed = self.rule.num_requests(rate, run.window.service_s)
            if run.window.steady or not run.num_finished or needed <= run.num_requests \
                    or not (passed or needed <= 3 * run.num_requests):
                break
            run = self._run(cfg, rate, needed)
            passed = passes(run)
        if passed and run.window.service_s > 0:
            self.service_s[key] = run.window.service_s
        self.runs[(*key, rate)] = run
        self.rows.append({"key": "/".join(map(str, key)), "rate": rate, "num_requests": run.num_requests,
                          "num_finished": run.num_finished, "judged": len(run.window.judged),
                          "span_s": run.window.span_s, "service_s": run.window.service_s,
                          "steady": run.window.steady, "steady_reason": run.window.reason})
        return run

    def _run(self, cfg: RunConfig, rate: float, n: int) -> ProbeRun:
        from testbed.runtime.build import apply_sampling
        from testbed.runtime.sim import SimRuntime
        from testbed.workloads.build import build_workload
        w = cfg.workload
        turns = max(1, w.conversation_turns)         # multi-turn: rate counts conversations
        run_cfg = replace_run(cfg, workload=dataclasses.replace(w, rate=rate / turns, num_requests=n))
        requests = build_workload(run_cfg.workload, cfg.model.vocab_size, cfg.seed)
        apply_sampling(run_cfg, requests)
        result = SimRuntime(run_cfg, log=lambda *_: None).run(requests)
        self.num_runs += 1
        finished = sum(r.finished for r in result.records)
        return ProbeRun(self.rule.window(result.records), len(result.records), finished)


def verdict(run: ProbeRun, smooth: Smoothness, targets: SLOTargets) -> str:
    """The limit a probe failed ("" when it meets the SLOs). A probe whose
    judged window is empty (every arrival inside the warm-up or the drain)
    says nothing and fails as `unjudged`: passing it, every probe past some
    rate would pass and the search would double without end."""
    if run.num_finished < run.num_requests:
        return "unfinished"
    if not run.window.judged:
        return "unjudged"
    return smooth.judge(run.window.judged, targets)


@dataclass
class Search:
    capacity: float | None           # requests/s of the deployment
    bound: str                       # bracketed | lower | none
    limited_by: str
    steady: bool
    probes: int


def search(prober: Prober, key: tuple, cfg: RunConfig, smooth: Smoothness, targets: SLOTargets, start: float,
           first_service_s: float, rel_tol: float, max_probes: int) -> Search:
    """The highest steady-judged rate meeting the SLOs (bisection to rel_tol).
    A rate where no request finishes (the prompt does not fit the KV memory)
    fails for every rate: the search stops there."""
    verdicts: dict[float, tuple[str, bool]] = {}       # rate -> (failed limit or "", steady)

    class NeverFits(Exception):
        pass

    def limit_of(run: ProbeRun) -> str:
        return verdict(run, smooth, targets)

    def probe(rate: float) -> bool:
        run = prober.probe(key, cfg, rate, first_service_s, lambda r: limit_of(r) == "")
        limit = limit_of(run)
        verdicts[rate] = (limit, run.window.steady)
        if run.num_finished == 0:
            raise NeverFits
        return limit == ""

    never_fits = False
    try:
        search_rate(probe, start, rel_tol, max_probes)
    except NeverFits:           # a verdict on memory, not on load: no probe length changes it
        never_fits = True
    passing = [r for r, (limit, _) in verdicts.items() if not limit]
    cap = max(passing, default=None)
    failing = [r for r, (limit, _) in verdicts.items() if limit and (cap is None or r > cap)]
    fail = min(failing, default=None)
    bound = "none" if cap is None else "lower" if fail is None else "bracketed"
    steady = never_fits or all(verdicts[r][1] for r in (cap, fail) if r is not None)
    return Search(cap, bound, verdicts[fail][0] if fail is not None else "", steady, len(verdicts))


def _point_cfg(cfg: RunConfig, model_name: str, hardware_name: str) -> RunConfig:
    """The run on the simulator with this model and hardware, its tp from
    decision_tp, num_kv_blocks=auto (the KV memory one GPU of each pool's split
    has after weights and activations), and prefix caching only where the
    workload reuses prefixes."""
    e = cfg.experiment
    model, hardware = load_model_preset(model_name), load_hardware_preset(hardware_name)
    parallel = dataclasses.replace(cfg.parallel, tp=e.decision_tp.get(model_name, cfg.parallel.tp))
    # without shared prefixes the prefix cache never hits, and its block hashing was ~2/3 of a
    # long-context probe's time (131K tokens, sarathi-512: 3.96 s -> 1.34 s, the same service times)
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, name="sim"), model=model,
                               hardware=hardware, parallel=parallel, num_kv_blocks="auto",
                               token_budget=hardware.token_budget_default, progress=False,
                               enable_prefix_caching=e.decision_reuse > 0)


def _workload(e, L: int) -> WorkloadConfig:
    reuse = e.decision_reuse > 0
    return WorkloadConfig(
        name=f"decision-L{L}", arrival="poisson", prompt_dist="lognormal", prompt_len=L,
        prompt_sigma=e.decision_prompt_sigma, prompt_min=max(1, L // 2), prompt_max=2 * L,
        output_dist="fixed", output_len=e.decision_output_len,
        conversation_turns=e.decision_turns if reuse else 0,
        reuse_fraction=e.decision_reuse if reuse else WorkloadConfig.reuse_fraction)


def _isolated_s(cost, L: int, output_len: int) -> float:
    """One request alone on one worker: a whole prefill of L, then output_len decodes at context L
    (the first guess of the longest service time, before a probe measured one)."""
    return cost.iteration_time_s([(L, L)]) + output_len * cost.iteration_time_s([(1, L)])


def run_decision(cfg: RunConfig, out: Path, log=print) -> dict:
    e = cfg.experiment
    started = time.monotonic()
    rule = SteadyRule(e.decision_span_factor, e.decision_min_judged, e.decision_max_requests)
    prober = Prober(rule, log)
    smooths = [get_smoothness(name) for name in e.decision_smoothness]
    links = [load_link_preset(name) for name in e.links]
    rows = []
    for model_name in e.models:
        for hardware_name in e.hardware:
            point = _point_cfg(cfg, model_name, hardware_name)
            for num_gpus in e.decision_num_gpus:
                for dep in deployments(e, num_gpus, point.parallel.tp * point.parallel.pp, e.decision_reuse > 0):
                    # a deployment that never touches the link: one sweep, its rows under every link
                    for link in (links if dep.uses_link else links[:1]):
                        row_links = [link] if dep.uses_link else links
                        rows += _sweep(prober, e, replace_run(point, link=link), dep, num_gpus, row_links,
                                       smooths, log)
    summary = _summary(cfg, rows, rule)
    elapsed = time.monotonic() - started
    summary["elapsed_s"] = elapsed
    summary["num_probe_runs"] = prober.num_runs
    _write_csv(out / "decision.csv", rows, COLUMNS)
    if prober.rows:
        _write_csv(out / "decision_probes.csv", prober.rows, tuple(prober.rows[0]))
    (out / "decision_summary.json").write_text(json.dumps(summary, indent=2))
    figures = decision_figures(rows, summary["crossovers"], out)
    log(f"decision: {len(rows)} rows from {prober.num_runs} probe runs in {elapsed:.0f} s -> {out}/decision.csv")
    for c in summary["crossovers"]:
        log(f"  L* {c['model']}/{c['hardware']}/{c['link']}/N{c['num_gpus']} {c['slo']}@{c['tbt_slo_ms']}ms: "
            f"{c['l_star']}")
    return {"experiment": "decision", "elapsed_s": elapsed, "num_probe_runs": prober.num_runs,
            "crossovers": [{k: c[k] for k in ("model", "hardware", "link", "num_gpus", "slo", "tbt_slo_ms",
                                               "l_star")} for c in summary["crossovers"]],
            "definition_changes_winner": bool(summary["definition_changes"]),
            "figures": [p.name for p in figures], "series": capacity_series(rows),
            "tables": {"lstar": [{k: c[k] for k in ("model", "hardware", "link", "link_gbps", "num_gpus", "slo",
                                                     "tbt_slo_ms", "l_star")} for c in summary["crossovers"]]},
            "rows": rows}


def _sweep(prober: Prober, e, point: RunConfig, dep: Deployment, num_gpus: int, row_links: list,
           smooths: list[Smoothness], log) -> list[dict]:
    """One deployment's capacity at every L, TBT target and smoothness
    definition. Every search at an L starts from the previous L's first
    capacity, so searches whose verdicts agree probe the same rates and share
    the runs."""
    from testbed.sim.cost_model import CostModel
    one_gpu = CostModel(point.model, point.hardware, ParallelConfig())
    worker = CostModel(point.model, point.hardware, point.parallel)
    base = dep.apply(point)
    validate(base)
    gpus = dep.num_gpus(base)
    rows, prev = [], None
    lengths = sorted(e.context_lens)
    for L in lengths:
        service_s = _isolated_s(worker, L, e.decision_output_len)
        start = (prev * 0.6 if prev else e.capacity_rate_start * gpus if L == lengths[0] else gpus / (2 * service_s))
        first = None
        for tbt in e.decision_tbt_slos_ms:
            targets = SLOTargets(e.decision_ttft_k * one_gpu.iteration_time_s([(L, L)]) * 1e3, float(tbt),
                                 e.decision_fluidity_min)
            run_cfg = replace_run(base, workload=_workload(e, L), slo=dataclasses.replace(
                base.slo, ttft_ms=targets.ttft_ms, tpot_ms=float(tbt)))
            key = (point.model.name, point.hardware.name, num_gpus, dep.label,
                   point.link.name if dep.uses_link else "-", L, tbt if dep.reads_slo else "-")
            for smooth in smooths:
                t0 = time.monotonic()
                res = search(prober, key, run_cfg, smooth, targets, start, service_s, e.capacity_rel_tol,
                             e.capacity_max_probes)
                first = res.capacity if first is None else first
                rows += [_row(point, link, num_gpus, smooth.name, tbt, targets, L, dep, gpus, res)
                         for link in row_links]
                per_gpu = "-" if res.capacity is None else f"{res.capacity / gpus:.4g}"
                where = point.link.name if dep.uses_link else "any link"
                log(f"decision {key[0]}/{key[1]}/N{num_gpus} {dep.label} {where} {smooth.name}@{tbt}ms L={L}: "
                    f"{per_gpu} req/s/GPU ({res.bound}{', ' + res.limited_by if res.limited_by else ''}"
                    f"{'' if res.steady else ', NOT steady'}; {res.probes} probes, {time.monotonic() - t0:.1f} s)")
        prev = first
    return rows


def _row(point: RunConfig, link, num_gpus: int, slo: str, tbt, targets: SLOTargets, L: int, dep: Deployment,
         gpus: int, res: Search) -> dict:
    return {"model": point.model.name, "hardware": point.hardware.name, "link": link.name,
            "link_gbps": link.bandwidth_gbps, "num_gpus": num_gpus, "slo": slo, "tbt_slo_ms": tbt,
            "ttft_slo_ms": round(targets.ttft_ms, 3), "context_len": L, "deployment": dep.label,
            "family": dep.family, "capacity_per_gpu": None if res.capacity is None else res.capacity / gpus,
            "bound": res.bound, "limited_by": res.limited_by, "steady": res.steady, "probes": res.probes,
            "source": "sim"}


def _summary(cfg: RunConfig, rows: list[dict], rule: SteadyRule) -> dict:
    e = cfg.experiment
    changes = definition_changes(rows)
    return {
        "assumptions": {
            "ttft_k": e.decision_ttft_k,
            "ttft_slo": "ttft_k x one GPU's (tp=1) whole-prefill time of an L-token prompt, from the cost model",
            "tbt_slos_ms": list(e.decision_tbt_slos_ms), "fluidity_min": e.decision_fluidity_min,
            "smoothness": list(e.decision_smoothness),
            "prompt": f"lognormal, median L, sigma {e.decision_prompt_sigma}, clipped to [L/2, 2L]",
            "output_len": e.decision_output_len, "arrivals": "poisson", "reuse_fraction": e.decision_reuse,
            "steady_state": {"span_factor": rule.span_factor, "min_judged": rule.min_judged,
                             "max_requests": rule.max_requests,
                             "window": "arrivals in [first + S, last - S], S the longest service time"},
            "capacity_rel_tol": e.capacity_rel_tol, "max_probes": e.capacity_max_probes,
            "tp": {m: e.decision_tp.get(m, cfg.parallel.tp) for m in e.models},
            "kv_memory": "what one worker's GPUs hold after the weights (gpu_memory_utilization)",
            "transfer_layerwise": cfg.transfer.layerwise, "disagg_scheduler": e.disagg_scheduler,
            "l_star": "smallest L from which on the best steady disaggregated capacity per GPU exceeds the best "
                      "colocated one at every larger L; a family without a steady capacity at an L counts 0 there",
        },
        "crossovers": crossovers(rows),
        "definition_changes": changes,
        "winner_changes_with_definition": bool(changes),
        "unsteady_rows": sum(not r["steady"] for r in rows),
    }


def _write_csv(path: Path, rows: list[dict], columns) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)
