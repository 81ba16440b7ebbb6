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

The grid's sweeps (one deployment of one model, hardware and N at every L,
SLO and link: decision_grid.py) run as Ray tasks on every core
(experiment.parallel=auto, decision_ray.py), on a running cluster
(ray.address), or one after another in this process (parallel=1); the files
are the same byte for byte but for the timing fields (decision_probes.csv's
wall_s, cpu_s and load_1m; decision_summary.json's elapsed_s, probe_cpu_s and
probe_wall_s; experiment.json's elapsed_s).

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
from testbed.experiments.decision_grid import WORKER_DIED, SweepResult, run_serial, study_rule, sweeps
from testbed.experiments.decision_ray import num_workers, run_ray
from testbed.experiments.decision_search import COLUMNS, MIN_JUDGED_TO_SKIP
from testbed.experiments.decision_slo import get_smoothness
from testbed.experiments.decision_summary import DOMINATED, crossovers, definition_changes, sim_vs_real
from testbed.experiments.probe_cache import ProbeCache
from testbed.sim.config import load_link_preset
from testbed.steady_state import SteadyRule

def run_decision(cfg: RunConfig, out: Path, log=print) -> dict:
    e = cfg.experiment
    if e.real:
        from testbed.experiments.decision_real import check_real
        check_real(e)
    started = time.monotonic()
    rule = study_rule(e)
    cache = ProbeCache(e.probe_cache, log) if e.probe_cache else None
    smooths = [get_smoothness(name) for name in e.smoothness]
    links = [load_link_preset(name) for name in e.links]
    try:
        grid = _grid(cfg, cache, log)
    finally:
        if cache is not None:
            cache.close()
    rows, probe_rows, num_runs = grid.rows, grid.probe_rows, grid.num_runs
    real_summary = None
    if e.real:
        from testbed.experiments.decision_real import real_rows
        measured, real_prober, real_summary = real_rows(cfg, rows, grid.service_s, smooths, links, rule, log,
                                                        out / "real_probes")
        rows += measured
        probe_rows, num_runs = probe_rows + real_prober.rows, num_runs + real_prober.num_runs
    summary = _summary(cfg, rows, rule)
    if real_summary is not None:
        summary["assumptions"]["real"] = real_summary
    elapsed = time.monotonic() - started
    summary["elapsed_s"] = elapsed
    summary["num_probe_runs"] = num_runs
    summary["num_replayed_probes"] = grid.num_replayed
    # the simulated probes' own compute, each once however often the grid was resumed (replayed
    # ones keep the figure from when they ran); elapsed_s is this run's alone (a resumed grid's replay
    # takes seconds), and probe_wall_s, their wall clocks, also counts the machine's other work
    summary["probe_cpu_s"] = round(sum(r["cpu_s"] for r in grid.probe_rows if r["cpu_s"] is not None), 1)
    summary["probe_wall_s"] = round(sum(r["wall_s"] for r in grid.probe_rows), 1)
    _write_csv(out / "decision.csv", rows, COLUMNS)
    if probe_rows:
        _write_csv(out / "decision_probes.csv", probe_rows, tuple(probe_rows[0]))
    (out / "decision_summary.json").write_text(json.dumps(summary, indent=2))
    figures = decision_figures(rows, summary["crossovers"], out)
    replayed = f" (and {grid.num_replayed} replayed from the probe cache)" if grid.num_replayed else ""
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


def _grid(cfg: RunConfig, cache: ProbeCache | None, log) -> SweepResult:
    """The simulator's rows: every sweep of the grid (decision_grid.py), in this process
    (experiment.parallel=1) or as Ray tasks (decision_ray.py), merged in the grid's order."""
    grid = sweeps(cfg)
    parallel = cfg.experiment.parallel
    workers = 1 if parallel == "1" else num_workers(parallel)
    if parallel != "1" and (cfg.ray.address is not None or workers > 1 and len(grid) > 1):
        results = run_ray(cfg, grid, workers, log)
    else:
        results = run_serial(cfg, grid, cache, log)
    merged = SweepResult([], [])
    for r in results:
        merged.rows += r.rows
        merged.probe_rows += r.probe_rows
        merged.num_runs += r.num_runs
        merged.num_replayed += r.num_replayed
        merged.service_s.update(r.service_s)
    return merged


def _summary(cfg: RunConfig, rows: list[dict], rule: SteadyRule) -> dict:
    """L* and the definitions' winners from the simulator's rows; the measured
    rows only beside their simulated twins (`sim_vs_real`)."""
    e = cfg.experiment
    sim = [r for r in rows if r["source"] == "sim"]
    changes = definition_changes(sim)
    rival = "its family's" if e.sweep_by == "family" else "either family's (experiment.sweep_by=cell)"
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
            "dominated": f"a deployment that failed, over {MIN_JUDGED_TO_SKIP} judged requests, at or below {rival} "
                         "best capacity in the cell (one judged over as many), probed there first: no capacity, "
                         "that rate its first_failing_per_gpu (experiment.prior_brackets)",
            "ties": "the L's where the other family's search bracket [capacity, first failing rate) reaches above "
                    "the winner's capacity: the winner there is within the search's resolution",
        },
        "crossovers": crossovers(sim),
        "definition_changes": changes,
        "winner_changes_with_definition": bool(changes),
        # a dominated row's one probe failed above its capacity, seldom steady: counted apart
        "unsteady_rows": sum(not r["steady"] and r["limited_by"] != DOMINATED for r in sim),
        "dominated_rows": sum(r["limited_by"] == DOMINATED for r in sim),
        # rows of sweeps whose Ray worker died on both tries (decision_grid.py): no capacity, not probed
        "worker_died_rows": sum(r["limited_by"] == WORKER_DIED for r in sim),
        **({"sim_vs_real": sim_vs_real(rows), "unsteady_real_rows": sum(not r["steady"] for r in rows
                                                                         if r["source"] == "real")}
           if len(sim) < len(rows) else {}),
    }


def _write_csv(path: Path, rows: list[dict], columns) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)
