"""The decision study's grid cut into sweeps, its independent units of work:
deployments of one model, hardware and N, searched at every L, SLO
definition and link. By family (experiment.sweep_by=family, the most
sweeps): a colocated deployment is a sweep of its own, or one per group of
SLO definitions whose runs differ (adaptive's); the deployments of a family
that use the link (every xPyD split) share one. By cell (the fewest
probes): every deployment of a model, hardware and N shares one. Within a
sweep each L searches its likely winner first and the rest against it
(decision_brackets.py). A sweep's searches lean on each other (each L
starts from the previous L's capacity, each link from the previous link's
bracket, each deployment from the best in the cell), so a sweep runs in
order in one process; different sweeps share nothing (a probe's key names
its deployment), so they run in any order, on any process
(decision_ray.py), and their rows merge in the grid's order into the same
files as a serial run.

A sweep's probes run on a Prober of its own; the results (rows, probe rows,
counts, measured service times) travel back as a SweepResult. A sweep whose
process died twice comes back as rows flagged limited_by=worker_died."""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.config import RunConfig
from testbed.experiments.decision_brackets import (CellBest, Known, below_dominated, best_first, neighbour_brackets,
                                                     seed_of, work_s)
from testbed.experiments.decision_prober import Prober, SettledFailure
from testbed.experiments.decision_search import MIN_JUDGED_TO_SKIP, isolated_s, judged_run, length_rows, point_cfg
from testbed.experiments.decision_slo import get_smoothness
from testbed.experiments.deployments import Deployment, deployments, replace_run
from testbed.experiments.probe_cache import ProbeCache
from testbed.progress import progress
from testbed.schedulers import scheduler_class
from testbed.sim.config import load_link_preset
from testbed.steady_state import SteadyRule

WORKER_DIED = "worker_died"


@dataclass(frozen=True)
class Sweep:
    index: int                 # its place in the grid's order: results merge by it
    model: str
    hardware: str
    num_gpus: int
    deployments: tuple[Deployment, ...]    # rows in this order
    smoothness: tuple[str, ...] = ()       # the SLO definitions it searches (): every one of the study's

    def definitions(self, e) -> tuple[str, ...]:
        return self.smoothness or tuple(e.smoothness)


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
    """Every sweep of the grid, in the order its rows are written. By family
    (experiment.sweep_by=family): a colocated deployment alone (three of them
    gain little from sharing, and split they keep the default grid's cores
    busy), split further by _run_groups, the deployments of a family that
    use the link together. By cell: every deployment of a model, hardware
    and N together, so that either family's best rules the other's out."""
    e, out = cfg.experiment, []
    for model_name in e.models:
        for hardware_name in e.hardware:
            point = point_cfg(cfg, model_name, hardware_name)
            for num_gpus in e.num_gpus:
                deps = deployments(e, num_gpus, point.parallel.tp * point.parallel.pp, e.reuse > 0)
                if e.sweep_by == "cell":
                    out.append(Sweep(len(out), model_name, hardware_name, num_gpus, tuple(deps)))
                    continue
                groups: dict[str, list[Deployment]] = {}
                for dep in deps:
                    if dep.uses_link:
                        groups.setdefault(dep.family, []).append(dep)
                    else:
                        groups[dep.label] = [dep]
                for g in groups.values():
                    out += [Sweep(len(out) + i, model_name, hardware_name, num_gpus, tuple(g), defs)
                            for i, defs in enumerate(_run_groups(e, point, g))]
    return out


def _run_groups(e, point: RunConfig, deps: list[Deployment]) -> list[tuple[str, ...]]:
    """The study's SLO definitions grouped by the runs they judge: definitions under which every
    deployment runs alike share their probes and stay in one sweep (()); adaptive, which runs
    without its fluidity slack under p99_tbt, shares none between the two, so each group is a
    sweep of its own, and the two halves of the grid's costliest sweep run on two cores."""
    bases = [d.apply(point) for d in deps]
    groups: dict[tuple, list[str]] = {}
    for name in e.smoothness:
        variant = tuple(judged_run(base, get_smoothness(name)) is not base for base in bases)
        groups.setdefault(variant, []).append(name)
    return [()] if len(groups) == 1 else [tuple(names) for names in groups.values()]


def runs_per_rate(cfg: RunConfig, sweep: Sweep) -> tuple[int, int]:
    """How many separate probe runs a sweep makes at one L and rate, those planned by a step-time
    predictor first: per deployment one per distinct run its definitions judge (adaptive without
    its fluidity slack under p99_tbt is a second), times the TBT targets where it reads the SLO,
    times the links where it uses the link (it searches on each). A predictor-planned run prices
    several candidate batches every iteration (on the default grid each of adaptive's sweeps takes
    2-5x the CPU of a sarathi one), so the study's Ray tasks start in this order, largest first."""
    e = cfg.experiment
    point = point_cfg(cfg, sweep.model, sweep.hardware)
    planned = total = 0
    for dep in sweep.deployments:
        base = dep.apply(point)
        variants = len({judged_run(base, get_smoothness(name)) is base for name in sweep.definitions(e)})
        runs = variants * (len(e.tbt_slos_ms) if dep.reads_slo else 1) * (len(e.links) if dep.uses_link else 1)
        total += runs
        planned += runs if scheduler_class(dep.scheduler).needs_predictor else 0
    return planned, total


def cells_of(cfg: RunConfig, sweep: Sweep) -> list[tuple]:
    """The cells (model, hardware, link, N, SLO definition, TBT target, L: as its rows name them)
    a sweep gives a row in, once per row (per deployment)."""
    e = cfg.experiment
    hardware = point_cfg(cfg, sweep.model, sweep.hardware).hardware.name
    links = [load_link_preset(name).name for name in e.links]
    return [(sweep.model, hardware, link, sweep.num_gpus, slo, tbt, L) for _ in sweep.deployments
            for link in links for L in sorted(e.context_lens) for tbt in e.tbt_slos_ms for slo in sweep.definitions(e)]


def cell_of(row: dict) -> tuple:
    return (row["model"], row["hardware"], row["link"], row["num_gpus"], row["slo"], row["tbt_slo_ms"],
            row["context_len"])


def run_sweep(cfg: RunConfig, sweep: Sweep, log, cache: ProbeCache | None = None,
              on_progress=None) -> SweepResult:
    """One sweep's rows on a Prober of its own, L by L, and at each L family
    by family (the one that won more of L/2's cells first), link by link,
    its deployments best first (decision_brackets.py). A deployment that
    never touches the link is searched on the first and its rows repeat
    under every link. on_progress(probes, cells): after every probe and
    every L, the probes made so far and the cells given rows."""
    e = cfg.experiment
    deps = list(sweep.deployments)
    links = [load_link_preset(name) for name in e.links]
    link_range = {d.label: range(len(links) if d.uses_link else 1) for d in deps}
    lengths = sorted(e.context_lens)
    rows: dict[tuple, list[dict]] = {}         # (deployment, link index, L) -> its rows
    report = (lambda: on_progress(len(prober.rows), [cell_of(r) for part in rows.values() for r in part])) \
        if on_progress else None
    # a TTFT miss over as many judged requests as rule a rival out is a verdict under every definition, and
    # an unjudged run whose queue grew with it is overloaded (prior_brackets=false: the former searches,
    # probe for probe)
    settled = SettledFailure(("ttft",), MIN_JUDGED_TO_SKIP, growing_queue=True) if e.prior_brackets else None
    prober = Prober(study_rule(e), log, cache=cache, on_probe=report, settled=settled)
    smooths = [get_smoothness(name) for name in sweep.definitions(e)]
    point = point_cfg(cfg, sweep.model, sweep.hardware)
    from testbed.sim.cost_model import CostModel
    worker = CostModel(point.model, point.hardware, point.parallel, point.engine)
    work = {L: work_s(worker, L, e.output_len) for L in lengths}
    known = {(d.label, k): Known() for d in deps for k in link_range[d.label]}
    families = [f for f in ([d for d in deps if not d.uses_link], [d for d in deps if d.uses_link]) if f]
    link_first = False
    for i, L in enumerate(lengths):
        previous = lengths[i - 1] if i else None
        best = CellBest(len(links))
        for family, k in _passes(families[::-1] if link_first else families, len(links)):
            at_link = replace_run(point, link=links[k])
            on_link = {d.label: known[(d.label, k)] for d in family}
            for dep in best_first(family, on_link, previous) if e.prior_brackets else family:
                here = on_link[dep.label]
                # no bracket to start from: the grid's first L from rate_start, a later one from a
                # guess of half the deployment's isolated service rate (without prior brackets: from
                # 0.6x the previous L's capacity, doubling or halving)
                prev = here.capacity(previous) if previous is not None else None
                start = (prev * 0.6 if prev and not e.prior_brackets else e.rate_start * dep.num_gpus(at_link)
                         if not i else dep.num_gpus(at_link) / (2 * isolated_s(worker, L, e.output_len)))
                guesses = neighbour_brackets(here, L, previous, work, e.rel_tol) if e.prior_brackets else None
                bounds = below_dominated(here, L, previous, work, e.rel_tol) if e.prior_brackets else None
                seed = seed_of(known[(dep.label, k - 1)].found.get(L)) if k else None
                new, first = length_rows(prober, e, at_link, dep, sweep.num_gpus,
                                         [links[k]] if dep.uses_link else links, smooths, L, start, log,
                                         seed=seed, guesses=guesses, bounds=bounds,
                                         ceilings=best.ceilings(dep, k) if e.prior_brackets else None,
                                         searches=here.searches.setdefault(L, {}))
                rows[(dep.label, k, L)] = new
                best.add(dep, k, new, here.searches[L])
                if first is not None:
                    here.found[L] = first
        link_first = best.link_family_leads()
        if report is not None:
            report()
    return SweepResult([r for d in deps for k in link_range[d.label] for L in lengths for r in rows[(d.label, k, L)]],
                       prober.rows, prober.num_runs, prober.num_replayed, dict(prober.service_s))


def _passes(families: list[list[Deployment]], num_links: int) -> list[tuple[list[Deployment], int]]:
    """(family, link index) in search order: a link-using family on every link, a colocated one on
    the first (its rows stand under every link)."""
    return [(f, k) for f in families for k in range(num_links if f[0].uses_link else 1)]


def died_rows(cfg: RunConfig, sweep: Sweep, log) -> SweepResult:
    """A sweep whose process died on both tries: its rows, unprobed, flagged limited_by=worker_died."""
    e = cfg.experiment
    smooths = [get_smoothness(name) for name in sweep.definitions(e)]
    links = [load_link_preset(name) for name in e.links]
    prober = Prober(study_rule(e), log)
    point, rows = point_cfg(cfg, sweep.model, sweep.hardware), []
    for dep in sweep.deployments:
        for link in (links if dep.uses_link else links[:1]):
            for L in sorted(e.context_lens):
                rows += length_rows(prober, e, replace_run(point, link=link), dep, sweep.num_gpus,
                                    [link] if dep.uses_link else links, smooths, L, 0.0, lambda *_: None,
                                    skip=WORKER_DIED)[0]
    labels = ", ".join(d.label for d in sweep.deployments)
    log(f"decision: sweep {sweep.model}/{point.hardware.name}/N{sweep.num_gpus} {labels}: its worker died "
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
