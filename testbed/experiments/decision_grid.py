"""The decision study's grid cut into sweeps, its independent units of work:
one deployment of one model, hardware and N, searched at every L, SLO
definition and link. A sweep's searches lean on each other (each L starts
from the previous L's capacity, each link from the previous link's bracket),
so a sweep runs in order in one process; different sweeps share nothing (a
probe's key names its deployment), so they run in any order, on any process
(decision_ray.py), and their rows merge in the grid's order into the same
files as a serial run.

A sweep's probes run on a Prober of its own; the results (rows, probe rows,
counts, measured service times) travel back as a SweepResult. A sweep whose
process died twice comes back as rows flagged limited_by=worker_died."""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.config import RunConfig
from testbed.experiments.decision_search import (Prober, Search, Smoothness, isolated_s, judged_run, length_rows,
                                                 point_cfg)
from testbed.experiments.decision_slo import get_smoothness
from testbed.experiments.deployments import Deployment, deployments, replace_run
from testbed.experiments.probe_cache import ProbeCache
from testbed.progress import progress
from testbed.sim.config import load_link_preset
from testbed.steady_state import SteadyRule

WORKER_DIED = "worker_died"


@dataclass(frozen=True)
class Sweep:
    index: int                 # its place in the grid's order: results merge by it
    model: str
    hardware: str
    num_gpus: int
    deployment: Deployment


@dataclass
class SweepResult:
    rows: list[dict]                           # decision.csv
    probe_rows: list[dict]                     # decision_probes.csv
    num_runs: int = 0
    num_replayed: int = 0
    service_s: dict[tuple, float] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)      # its lines, when it ran away from the driver


def study_rule(e) -> SteadyRule:
    # each search caps its probes at max_requests_per_gpu x its N; the rule's cap is the largest
    return SteadyRule(e.span_factor, e.min_judged, e.max_requests_per_gpu * max(e.num_gpus))


def sweeps(cfg: RunConfig) -> list[Sweep]:
    """Every sweep of the grid, in the order its rows are written."""
    e, out = cfg.experiment, []
    for model_name in e.models:
        for hardware_name in e.hardware:
            point = point_cfg(cfg, model_name, hardware_name)
            for num_gpus in e.num_gpus:
                for dep in deployments(e, num_gpus, point.parallel.tp * point.parallel.pp, e.reuse > 0):
                    out.append(Sweep(len(out), model_name, hardware_name, num_gpus, dep))
    return out


def runs_per_rate(cfg: RunConfig, sweep: Sweep) -> int:
    """How many separate probe runs a sweep makes at one L and rate: one shared by every SLO,
    unless its deployment reads the TBT target (one per target) or a definition changes its run
    (adaptive without slack under p99_tbt). The longest sweeps go to Ray first by it."""
    e = cfg.experiment
    base = sweep.deployment.apply(point_cfg(cfg, sweep.model, sweep.hardware))
    variants = 1 + any(judged_run(base, get_smoothness(name)) is not base for name in e.smoothness)
    return variants * (len(e.tbt_slos_ms) if sweep.deployment.reads_slo else 1)


def cells_of(cfg: RunConfig, sweep: Sweep) -> list[tuple]:
    """The cells (model, hardware, link, N, SLO definition, TBT target, L: as its rows name them)
    a sweep gives a row in."""
    e = cfg.experiment
    hardware = point_cfg(cfg, sweep.model, sweep.hardware).hardware.name
    links = [load_link_preset(name).name for name in e.links]
    return [(sweep.model, hardware, link, sweep.num_gpus, slo, tbt, L)
            for link in links for L in sorted(e.context_lens) for tbt in e.tbt_slos_ms for slo in e.smoothness]


def cell_of(row: dict) -> tuple:
    return (row["model"], row["hardware"], row["link"], row["num_gpus"], row["slo"], row["tbt_slo_ms"],
            row["context_len"])


def run_sweep(cfg: RunConfig, sweep: Sweep, log, cache: ProbeCache | None = None,
              on_progress=None) -> SweepResult:
    """One sweep's rows on a Prober of its own. on_progress(probes, cells): after every probe and
    every L, the probes made so far and the cells given rows."""
    e = cfg.experiment
    rows: list[dict] = []
    report = (lambda: on_progress(len(prober.rows), [cell_of(r) for r in rows])) if on_progress else None
    prober = Prober(study_rule(e), log, cache=cache, on_probe=report)
    smooths = [get_smoothness(name) for name in e.smoothness]
    links = [load_link_preset(name) for name in e.links]
    point = point_cfg(cfg, sweep.model, sweep.hardware)
    dep = sweep.deployment
    # a deployment that never touches the link: one sweep, its rows under every link
    found: dict[int, Search] = {}
    for link in (links if dep.uses_link else links[:1]):
        row_links = [link] if dep.uses_link else links
        found = _lengths(prober, e, replace_run(point, link=link), dep, sweep.num_gpus, row_links, smooths, log,
                         found, rows, report)
    return SweepResult(rows, prober.rows, prober.num_runs, prober.num_replayed, dict(prober.service_s))


def _lengths(prober: Prober, e, point: RunConfig, dep: Deployment, num_gpus: int, row_links: list,
             smooths: list[Smoothness], log, found: dict[int, Search], rows: list[dict],
             report=None) -> dict[int, Search]:
    """One deployment's capacity at every L, TBT target and smoothness
    definition on one link (its rows appended to `rows`), and the first
    search per L that found a bracket. A search probes `found[L]`'s bracket
    first (this deployment's at that L on the previous link, its first probe
    sized from the service time measured there: the link rarely moves it,
    and then the rows are those of the previous link in two probes), else
    starts from the previous L's first capacity, doubling. Searches whose
    verdicts agree probe the same rates and share the runs."""
    from testbed.sim.cost_model import CostModel
    worker = CostModel(point.model, point.hardware, point.parallel, point.engine)
    gpus = dep.num_gpus(point)
    prev, seeds = None, {}
    lengths = sorted(e.context_lens)
    for L in lengths:
        service_s = isolated_s(worker, L, e.output_len)
        start = (prev * 0.6 if prev else e.rate_start * gpus if L == lengths[0] else gpus / (2 * service_s))
        new, first = length_rows(prober, e, point, dep, num_gpus, row_links, smooths, L, start, log,
                                 seed=found.get(L))
        rows += new
        if report is not None:
            report()
        prev = first.capacity if first else None
        if first and first.capacity and first.first_failing and first.first_failing <= 2 * first.capacity:
            seeds[L] = first
    return seeds


def died_rows(cfg: RunConfig, sweep: Sweep, log) -> SweepResult:
    """A sweep whose process died on both tries: its rows, unprobed, flagged limited_by=worker_died."""
    e = cfg.experiment
    smooths = [get_smoothness(name) for name in e.smoothness]
    links = [load_link_preset(name) for name in e.links]
    prober = Prober(study_rule(e), log)
    point, dep, rows = point_cfg(cfg, sweep.model, sweep.hardware), sweep.deployment, []
    for link in (links if dep.uses_link else links[:1]):
        for L in sorted(e.context_lens):
            rows += length_rows(prober, e, replace_run(point, link=link), dep, sweep.num_gpus,
                                [link] if dep.uses_link else links, smooths, L, 0.0, lambda *_: None,
                                skip=WORKER_DIED)[0]
    log(f"decision: sweep {sweep.model}/{point.hardware.name}/N{sweep.num_gpus} {dep.label}: its worker died "
        f"twice; its {len(rows)} rows are flagged {WORKER_DIED}")
    return SweepResult(rows, [])


class GridProgress:
    """Probes done, cells decided (every deployment of the cell has its row)
    and an ETA by rows, on testbed/progress.py's bar (quiet unless stderr is
    a terminal). `update(sweep, probes, cells)` takes a sweep's totals so
    far: a sweep run again (its worker died) starts its count over."""

    def __init__(self, cfg: RunConfig, grid: list[Sweep]):
        self.needed: dict[tuple, int] = {}
        for s in grid:
            for cell in cells_of(cfg, s):
                self.needed[cell] = self.needed.get(cell, 0) + 1
        self.probes: dict[int, int] = {}
        self.cells: dict[int, list[tuple]] = {}
        self.have: dict[tuple, int] = {}          # rows given per cell
        self.decided = 0
        self.bar = progress(total=sum(self.needed.values()), desc="decision", unit="row",
                            enabled=cfg.progress, mininterval=1.0)

    def update(self, index: int, probes: int, cells: list[tuple]) -> None:
        for cell, step in [(c, -1) for c in self.cells.get(index, [])] + [(c, 1) for c in cells]:
            was = self.have.get(cell, 0) >= self.needed.get(cell, 0)
            self.have[cell] = self.have.get(cell, 0) + step
            self.decided += (self.have[cell] >= self.needed.get(cell, 0)) - was
        self.probes[index], self.cells[index] = probes, cells
        self.bar.set_postfix_str(f"{sum(self.probes.values())} probes, {self.decided}/{len(self.needed)} cells "
                                 f"decided", refresh=False)
        self.bar.update(sum(len(c) for c in self.cells.values()) - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def run_serial(cfg: RunConfig, grid: list[Sweep], cache: ProbeCache | None, log) -> list[SweepResult]:
    """experiment.parallel=1: every sweep in this process, one after another."""
    bar = GridProgress(cfg, grid)
    try:
        return [run_sweep(cfg, s, log, cache, lambda probes, cells, i=s.index: bar.update(i, probes, cells))
                for s in grid]
    finally:
        bar.close()
