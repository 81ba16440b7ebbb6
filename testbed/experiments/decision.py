"""`experiment=decision`: which deployment serves more requests per GPU within
the SLOs as the context length L grows, and where the answer flips (the
system crossover L*), per model, hardware, interconnect and GPU count N, on
the simulator.

For each L of the grid the workload is Poisson arrivals of prompts of ~L
tokens (lognormal, median L, shape prompt_sigma) with a fixed output
length (optionally multi-turn with prefix reuse). The SLOs (decision_slo.py):
TTFT <= k x one GPU's whole-prefill time of an L-token prompt, and smoothness
by p99 TBT or by the fluidity index, at each TBT target. Every deployment of
deployments.py on N GPUs gets its capacity (decision_search.py: testbed/
capacity.py's search_rate) from probes that reach a steady state
(testbed/steady_state.py); a probe run is shared by every SLO that judges
it. Colocated deployments do not touch the link, so they run once per
(model, hardware, N) and their rows repeat per link.

With experiment.real=true the real engine's rows join them
(decision_real.py): the same search and rule, each probe a real run on this
machine (source=real beside source=sim).

Writes decision.csv (one row per model, hardware, link, N, SLO, L,
deployment and source), decision_summary.json (L* and the best deployment of
each family per L from the simulator's rows, and the measured rows beside
their simulated twins, decision_summary.py), decision_probes.csv, and the
figures of decision_figures.py: a phase diagram per model/hardware/N/SLO (the
winning family per L and link, L* drawn) and capacity per GPU against L per
link (measured points as squares)."""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path

from testbed.config import RunConfig
from testbed.experiments.decision_figures import capacity_series, decision_figures
from testbed.experiments.decision_search import (COLUMNS, Prober, ProbeRun, Search, Smoothness,  # noqa: F401 (re-exported)
                                                 isolated_s, length_rows, point_cfg, verdict)
from testbed.experiments.decision_slo import get_smoothness
from testbed.experiments.decision_summary import crossovers, definition_changes, sim_vs_real
from testbed.experiments.deployments import Deployment, deployments, replace_run
from testbed.experiments.probe_cache import ProbeCache
from testbed.sim.config import load_link_preset
from testbed.steady_state import SteadyRule

def run_decision(cfg: RunConfig, out: Path, log=print) -> dict:
    e = cfg.experiment
    if e.real:
        from testbed.experiments.decision_real import check_real
        check_real(e)
    started = time.monotonic()
    # each search caps its probes at max_requests_per_gpu x its N; the rule's cap is the largest
    rule = SteadyRule(e.span_factor, e.min_judged,
                      e.max_requests_per_gpu * max(e.num_gpus))
    cache = ProbeCache(e.probe_cache, log) if e.probe_cache else None
    prober = Prober(rule, log, cache=cache)
    smooths = [get_smoothness(name) for name in e.smoothness]
    links = [load_link_preset(name) for name in e.links]
    try:
        rows = _grid(prober, cfg, links, smooths, log)
    finally:
        if cache is not None:
            cache.close()
    probe_rows, num_runs = prober.rows, prober.num_runs
    real_summary = None
    if e.real:
        from testbed.experiments.decision_real import real_rows
        measured, real_prober, real_summary = real_rows(cfg, rows, prober.service_s, smooths, links, rule, log,
                                                        out / "real_probes")
        rows += measured
        probe_rows, num_runs = probe_rows + real_prober.rows, num_runs + real_prober.num_runs
    summary = _summary(cfg, rows, rule)
    if real_summary is not None:
        summary["assumptions"]["real"] = real_summary
    elapsed = time.monotonic() - started
    summary["elapsed_s"] = elapsed
    summary["num_probe_runs"] = num_runs
    summary["num_replayed_probes"] = prober.num_replayed
    # the simulated probes' own compute, each once however often the grid was resumed (replayed
    # ones keep the figure from when they ran); elapsed_s is this run's alone (a resumed grid's replay
    # takes seconds), and probe_wall_s, their wall clocks, also counts the machine's other work
    summary["probe_cpu_s"] = round(sum(r["cpu_s"] for r in prober.rows if r["cpu_s"] is not None), 1)
    summary["probe_wall_s"] = round(sum(r["wall_s"] for r in prober.rows), 1)
    _write_csv(out / "decision.csv", rows, COLUMNS)
    if probe_rows:
        _write_csv(out / "decision_probes.csv", probe_rows, tuple(probe_rows[0]))
    (out / "decision_summary.json").write_text(json.dumps(summary, indent=2))
    figures = decision_figures(rows, summary["crossovers"], out)
    replayed = f" (and {prober.num_replayed} replayed from the probe cache)" if prober.num_replayed else ""
    log(f"decision: {len(rows)} rows from {num_runs} probe runs{replayed} in {elapsed:.0f} s "
        f"({summary['probe_cpu_s']:.0f} CPU s of simulated probes) -> {out}/decision.csv")
    for c in summary["crossovers"]:
        log(f"  L* {c['model']}/{c['hardware']}/{c['link']}/N{c['num_gpus']} {c['slo']}@{c['tbt_slo_ms']}ms: "
            f"{c['l_star']}")
    return {"experiment": "decision", "elapsed_s": elapsed, "num_probe_runs": num_runs,
            "crossovers": [{k: c[k] for k in ("model", "hardware", "link", "num_gpus", "slo", "tbt_slo_ms",
                                               "l_star")} for c in summary["crossovers"]],
            "definition_changes_winner": bool(summary["definition_changes"]),
            "figures": [p.name for p in figures], "series": capacity_series(rows),
            "tables": {"lstar": [{k: c[k] for k in ("model", "hardware", "link", "link_gbps", "num_gpus", "slo",
                                                     "tbt_slo_ms", "l_star")} for c in summary["crossovers"]]},
            "rows": rows}


def _grid(prober: Prober, cfg: RunConfig, links: list, smooths: list[Smoothness], log) -> list[dict]:
    """The simulator's rows: every model, hardware, N and deployment of the grid."""
    e, rows = cfg.experiment, []
    for model_name in e.models:
        for hardware_name in e.hardware:
            point = point_cfg(cfg, model_name, hardware_name)
            for num_gpus in e.num_gpus:
                for dep in deployments(e, num_gpus, point.parallel.tp * point.parallel.pp, e.reuse > 0):
                    # a deployment that never touches the link: one sweep, its rows under every link
                    found: dict[int, Search] = {}
                    for link in (links if dep.uses_link else links[:1]):
                        row_links = [link] if dep.uses_link else links
                        new, found = _sweep(prober, e, replace_run(point, link=link), dep, num_gpus, row_links,
                                            smooths, log, found)
                        rows += new
    return rows


def _sweep(prober: Prober, e, point: RunConfig, dep: Deployment, num_gpus: int, row_links: list,
           smooths: list[Smoothness], log, found: dict[int, Search]) -> tuple[list[dict], dict[int, Search]]:
    """One deployment's capacity at every L, TBT target and smoothness
    definition, and the first search per L that found a bracket. A search
    probes `found[L]`'s bracket first (this deployment's at that L on the
    previous link, its first probe sized from the service time measured
    there: the link rarely moves it, and then the rows are those of the
    previous link in two probes), else starts from the previous L's first
    capacity, doubling. Searches whose verdicts agree probe the same rates
    and share the runs."""
    from testbed.sim.cost_model import CostModel
    worker = CostModel(point.model, point.hardware, point.parallel, point.engine)
    gpus = dep.num_gpus(point)
    rows, prev, seeds = [], None, {}
    lengths = sorted(e.context_lens)
    for L in lengths:
        service_s = isolated_s(worker, L, e.output_len)
        start = (prev * 0.6 if prev else e.rate_start * gpus if L == lengths[0] else gpus / (2 * service_s))
        new, first = length_rows(prober, e, point, dep, num_gpus, row_links, smooths, L, start, log,
                                 seed=found.get(L))
        rows += new
        prev = first.capacity if first else None
        if first and first.capacity and first.first_failing and first.first_failing <= 2 * first.capacity:
            seeds[L] = first
    return rows, seeds


def _summary(cfg: RunConfig, rows: list[dict], rule: SteadyRule) -> dict:
    """L* and the definitions' winners from the simulator's rows; the measured
    rows only beside their simulated twins (`sim_vs_real`)."""
    e = cfg.experiment
    sim = [r for r in rows if r["source"] == "sim"]
    changes = definition_changes(sim)
    return {
        "assumptions": {
            "ttft_k": e.ttft_k,
            "ttft_slo": "ttft_k x one GPU's (tp=1) whole-prefill time of an L-token prompt, from the cost model",
            "tbt_slos_ms": list(e.tbt_slos_ms), "fluidity_min": e.fluidity_min,
            "smoothness": list(e.smoothness),
            "prompt": f"lognormal, median L, sigma {e.prompt_sigma}, clipped to [L/2, 2L]",
            "output_len": e.output_len, "arrivals": "poisson", "reuse_fraction": e.reuse,
            "steady_state": {"span_factor": rule.span_factor, "min_judged": rule.min_judged,
                             "max_requests_per_gpu": e.max_requests_per_gpu,
                             "window": "arrivals in [first + S, last - S], S the longest service time"},
            "capacity_rel_tol": e.rel_tol, "max_probes": e.max_probes,
            "tp": {m: e.tp.get(m, cfg.parallel.tp) for m in e.models},
            "kv_memory": "what one worker's GPUs hold after the weights (gpu_memory_utilization)",
            "transfer_layerwise": cfg.transfer.layerwise, "disagg_scheduler": e.disagg_scheduler,
            "l_star": "smallest L from which on the best steady disaggregated capacity per GPU exceeds the best "
                      "colocated one at every larger L; a family without a steady capacity at an L counts 0 there",
            "ties": "the L's where the other family's search bracket [capacity, first failing rate) reaches above "
                    "the winner's capacity: the winner there is within the search's resolution",
        },
        "crossovers": crossovers(sim),
        "definition_changes": changes,
        "winner_changes_with_definition": bool(changes),
        "unsteady_rows": sum(not r["steady"] for r in sim),
        **({"sim_vs_real": sim_vs_real(rows), "unsteady_real_rows": sum(not r["steady"] for r in rows
                                                                         if r["source"] == "real")}
           if len(sim) < len(rows) else {}),
    }


def _write_csv(path: Path, rows: list[dict], columns) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)
