"""The capacity search of the `decision` study (decision.py runs the grid,
decision_real.py the real engine's rows): one deployment's capacity per GPU
at one context length L, per TBT target and smoothness definition, found by
testbed/capacity.py's search_rate over probes that reach a steady state
(testbed/steady_state.py), each run by decision_prober.py's Prober."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

from testbed.capacity import search_rate
from testbed.config import RunConfig, validate
from testbed.sim.engine_config import resolve_engine
from testbed.experiments.decision_slo import SLOTargets, Smoothness
from testbed.experiments.decision_summary import DOMINATED
from testbed.experiments.deployments import Deployment, replace_run
from testbed.experiments.decision_prober import OutOfTime, Prober, ProbeRun
from testbed.model.config import load_model_preset
from testbed.sim.config import ParallelConfig, load_hardware_preset
from testbed.workloads.config import WorkloadConfig

COLUMNS = ("model", "hardware", "link", "link_gbps", "num_gpus", "slo", "tbt_slo_ms", "ttft_slo_ms", "context_len",
           "deployment", "family", "capacity_per_gpu", "bound", "limited_by", "steady", "probes", "source",
           "first_failing_per_gpu")


def verdict(run: ProbeRun, smooth: Smoothness, targets: SLOTargets) -> str:
    """The limit a probe failed ("" when it meets the SLOs). A probe whose
    judged window is empty (every arrival inside the warm-up or the drain)
    says nothing and fails as `unjudged`: passing it, every probe past some
    rate would pass and the search would double without end."""
    if run.num_finished < run.num_requests:
        return "unfinished"
    if not run.num_judged:
        return "unjudged"
    return run.judge(smooth, targets)


# a p99 over fewer judged requests is the worst one's: one long prompt decides the verdict, and a
# longer probe at a higher rate may pass (llama3-8b, N = 8, 1P1D at tp 4, L = 512K: failed at 0.0032
# req/s/GPU over 64 judged, passed at 0.0041): such a failure does not rule a deployment out
MIN_JUDGED_TO_SKIP = 100


@dataclass
class Search:
    capacity: float | None           # requests/s of the deployment
    bound: str                       # bracketed | lower | none
    limited_by: str
    steady: bool
    probes: int
    first_failing: float | None = None   # the lowest probed rate above capacity (it failed); None: none did
    service_s: float | None = None       # the longest service time its passing probes measured last (sizes probes)
    judged: int | None = None            # the requests the probe at its capacity judged


def search(prober: Prober, key: tuple, cfg: RunConfig, smooth: Smoothness, targets: SLOTargets, start: float,
           first_service_s: float, rel_tol: float, max_probes: int,
           bracket: tuple[float, float] | None = None, max_requests: int | None = None,
           ceiling: float | None = None, reuse: bool = False) -> Search:
    """The highest steady-judged rate meeting the SLOs (bisection to rel_tol).
    On the simulator a rate where no request finishes (the prompt does not
    fit the KV memory), or where one of the first prompts every probe shares
    never finishes (the run ends when nothing is left to happen, every other
    request done and its blocks free: that one fits no empty worker), fails
    for every rate: the search stops there. A search
    cut by the Prober's deadline keeps what it measured, flagged
    (limited_by=budget, steady=false). `bracket`: search_rate's, probed first
    instead of searching from `start` (decision_brackets.py). `ceiling`: a
    rate another deployment passed in this cell; the search first probes it,
    or its bracket's top where that lies below (the Prober's `rule_out`:
    sized for MIN_JUDGED_TO_SKIP judged requests). Failing there over at
    least MIN_JUDGED_TO_SKIP judged requests, or overloaded
    (ProbeRun.overloaded: a queue growing with the run), the search ends,
    limited_by=dominated, no capacity, that rate its first failing one;
    otherwise it goes on as usual (when it passed, from the bracket of
    rel_tol above that rate). `reuse`: the
    runs other searches made on the same key, judged by this one, give the
    bracket where it is narrow (known_bracket), and rule it out where one
    failed at or below the ceiling (ruled_out_at)."""
    verdicts: dict[float, tuple[str, bool]] = {}       # rate -> (failed limit or "", steady)

    class NeverFits(Exception):
        pass

    def limit_of(run: ProbeRun) -> str:
        return verdict(run, smooth, targets)

    # every probe has at least this many requests, and (one turn each) the same first prompts: a request
    # among them that the simulator left unfinished fits no empty worker and fails every rate
    fewest = prober.rule.num_requests(0.0, 1.0, max_requests)
    one_turn = not cfg.workload.conversation_turns

    ran: dict[float, ProbeRun] = {}

    def probe(rate: float, rule_out: int = 0) -> bool:
        run = prober.probe(key, cfg, rate, first_service_s, limit_of, smooth.name, max_requests, rule_out)
        limit = limit_of(run)
        verdicts[rate] = (limit, run.window.steady)
        ran[rate] = run
        if prober.runner.none_finished_is_memory and (
                run.num_finished == 0 or one_turn and run.first_stuck is not None and run.first_stuck < fewest):
            raise NeverFits
        return limit == ""

    never_fits = out_of_time = False
    try:
        known = known_bracket(prober.known(key), limit_of, rel_tol) if reuse else None
        if known is not None:
            bracket = known
            if ceiling is not None and known[0] >= ceiling:
                ceiling = None             # it already passed above the rate to beat
        if ceiling is not None:
            # the top of its own bracket where that lies below the ceiling (a probe near its capacity, not
            # an overloaded one), else the ceiling; long enough to rule it out: MIN_JUDGED_TO_SKIP judged
            top = bracket[1] if bracket is not None and bracket[1] < ceiling else ceiling
            if reuse:
                top = ruled_out_at(prober.known(key), limit_of, ceiling) or top
            if not probe(top, MIN_JUDGED_TO_SKIP) and (ran[top].num_judged >= MIN_JUDGED_TO_SKIP
                                                        or ran[top].overloaded):
                return Search(None, "none", DOMINATED, verdicts[top][1], 1, top, prober.service_s.get(key))
            if not verdicts[top][0]:
                # passing: most likely just above, one tolerance step first
                start, bracket = top, (top, top * (1 + rel_tol))
        search_rate(probe, start, rel_tol, max_probes, bracket)
    except NeverFits:           # a verdict on memory, not on load: no probe length changes it
        never_fits = True
    except OutOfTime:
        out_of_time = True
    passing = [r for r, (limit, _) in verdicts.items() if not limit]
    cap = max(passing, default=None)
    failing = [r for r, (limit, _) in verdicts.items() if limit and (cap is None or r > cap)]
    fail = min(failing, default=None)
    bound = "none" if cap is None else "lower" if fail is None else "bracketed"
    # the capacity stands on its own probe: a steady window that met the SLOs at `cap` shows the deployment
    # sustains it. The first failing probe only bounds it from above; above capacity the queue, and with it
    # the service time, grows with the probe, so that probe is seldom steady (requiring it left such rows
    # uncounted: N = 8's adaptive at 1K passed 197 req/s steadily and failed 215 at a 9.3 s service time)
    steady = never_fits or (verdicts[cap][1] if cap is not None else fail is None or verdicts[fail][1])
    service = prober.service_s.get(key)
    at_cap = ran[cap].num_judged if cap is not None else None
    if out_of_time:
        return Search(cap, bound, "budget", False, len(verdicts), fail, service, at_cap)
    return Search(cap, bound, verdicts[fail][0] if fail is not None else "", steady, len(verdicts), fail, service,
                  at_cap)


def known_bracket(runs: dict[float, ProbeRun], limit_of: Callable[[ProbeRun], str],
                  rel_tol: float) -> tuple[float, float] | None:
    """From runs already made on a search's key (by rate: another SLO
    definition's or TBT target's search on the same runs), judged by this
    search: its highest steady pass and the lowest failing rate above it,
    where bisecting that bracket to rel_tol takes at most two probes (a
    guessed bracket takes two where it holds). None: no such pair."""
    verdicts = {rate: limit_of(run) for rate, run in sorted(runs.items())}
    passes = [rate for rate, limit in verdicts.items() if not limit and runs[rate].window.steady]
    if not passes:
        return None
    lo = max(passes)
    hi = min((rate for rate, limit in verdicts.items() if limit and rate > lo), default=None)
    return (lo, hi) if hi is not None and hi <= lo * (1 + rel_tol) ** 4 else None


def ruled_out_at(runs: dict[float, ProbeRun], limit_of: Callable[[ProbeRun], str], ceiling: float) -> float | None:
    """The lowest rate at or below `ceiling` among runs already made on a
    search's key (another SLO definition's or TBT target's) that, judged by
    this search, failed over at least MIN_JUDGED_TO_SKIP judged requests or
    overloaded, with no steady pass above it: the rate that rules the
    deployment out with no new run (above a failing rate every rate fails).
    None: no such run."""
    verdicts = {rate: limit_of(run) for rate, run in sorted(runs.items())}
    top_pass = max((rate for rate, limit in verdicts.items() if not limit and runs[rate].window.steady), default=0.0)
    return next((rate for rate, limit in verdicts.items()
                 if top_pass < rate <= ceiling and limit
                 and (runs[rate].num_judged >= MIN_JUDGED_TO_SKIP or runs[rate].overloaded)), None)


def point_cfg(cfg: RunConfig, model_name: str, hardware_name: str) -> RunConfig:
    """The run on the simulator with this model and hardware, its tp from
    experiment.tp, num_kv_blocks from experiment.kv_blocks or else auto (the KV
    memory one GPU of each pool's split has after weights and activations),
    and prefix caching only where the workload reuses prefixes."""
    e = cfg.experiment
    model, hardware = load_model_preset(model_name), load_hardware_preset(hardware_name)
    parallel = dataclasses.replace(cfg.parallel, tp=e.tp.get(model_name, cfg.parallel.tp))
    # without shared prefixes the prefix cache never hits, and its block hashing was ~2/3 of a
    # long-context probe's time (131K tokens, sarathi-512: 3.96 s -> 1.34 s, the same service times)
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, name="sim"), model=model,
                               hardware=hardware, parallel=parallel,
                               num_kv_blocks=e.kv_blocks.get(hardware_name, "auto"),
                               token_budget=resolve_engine(cfg.engine, hardware).token_budget, progress=False,
                               enable_prefix_caching=e.reuse > 0)


def _workload(e, L: int) -> WorkloadConfig:
    reuse = e.reuse > 0
    return WorkloadConfig(
        name=f"decision-L{L}", arrival="poisson", prompt_dist="lognormal", prompt_len=L,
        prompt_sigma=e.prompt_sigma, prompt_min=max(1, L // 2), prompt_max=2 * L,
        output_dist="fixed", output_len=e.output_len,
        conversation_turns=e.turns if reuse else 0,
        reuse_fraction=e.reuse if reuse else WorkloadConfig.reuse_fraction)


def isolated_s(cost, L: int, output_len: int) -> float:
    """One request alone on one worker: a whole prefill of L, then output_len decodes at context L
    (the first guess of the longest service time, before a probe measured one)."""
    return cost.iteration_time_s([(L, L)]) + output_len * cost.iteration_time_s([(1, L)])


def never_fit_share(e, L: int, num_kv_blocks: int, block_size: int) -> float:
    """The share of the decision workload's requests at L (prompts lognormal with median L, clipped
    to [L/2, 2L]) whose KV, prompt and answer, needs more blocks than one worker holds: they can
    never be scheduled, and a probe of them fails `unfinished` at any rate (tiny on cpu-2w at
    L = 32K: 2,048 blocks, half the prompts)."""
    longest = num_kv_blocks * block_size - e.output_len + 1      # the last token's KV is never written
    if longest >= 2 * L:
        return 0.0
    if longest < max(1, L // 2):
        return 1.0
    if e.prompt_sigma == 0:
        return float(longest < L)
    return 0.5 * math.erfc(math.log(longest / L) / e.prompt_sigma / math.sqrt(2))


def length_point(e, base: RunConfig, one_gpu, L: int, tbt: float) -> tuple[RunConfig, SLOTargets]:
    """A deployment's probe config at L (rate and size still to set) and the
    SLO targets it is judged by: TTFT k x one GPU's (`one_gpu`, a CostModel)
    whole prefill of L, the TBT target `tbt` ms."""
    targets = SLOTargets(e.ttft_k * one_gpu.iteration_time_s([(L, L)]) * 1e3, float(tbt),
                         e.fluidity_min)
    return replace_run(base, workload=_workload(e, L), slo=dataclasses.replace(
        base.slo, ttft_ms=targets.ttft_ms, tpot_ms=float(tbt))), targets


def judged_run(run_cfg: RunConfig, smooth: Smoothness) -> RunConfig:
    """The run a deployment makes when judged by `smooth`: adaptive spends
    banked fluidity slack (an iteration past the TBT target while the decodes
    are ahead of their token deadlines) only where the definition credits it.
    Under p99_tbt each such gap is late: at 16K on the real engine they were
    40 of 46 late gaps (experiments/README.md, "decision")."""
    if run_cfg.scheduler != "adaptive" or smooth.credits_slack or not run_cfg.adaptive.max_slack_tbt:
        return run_cfg
    return replace_run(run_cfg, adaptive=dataclasses.replace(run_cfg.adaptive, max_slack_tbt=0.0))


def length_rows(prober: Prober, e, point: RunConfig, dep: Deployment, num_gpus: int, row_links: list,
                smooths: list[Smoothness], L: int, start: float, log, rel_tol: float | None = None,
                max_probes: int | None = None, skip: str | None = None,
                seed: Search | None = None, guesses: dict[tuple, tuple[float, float]] | None = None,
                ceilings: dict[tuple, float] | None = None,
                searches: dict[tuple, Search] | None = None,
                bounds: dict[tuple, tuple[float, float]] | None = None) -> tuple[list[dict], Search | None]:
    """One deployment's rows at one L: a search from `start` (req/s of the
    deployment) per TBT target and smoothness definition, each row repeated
    under every link of row_links; and the first search that found a
    capacity (else the first search).
    With `skip` nothing is probed: the rows are flagged (no capacity,
    steady=false, limited_by=skip). `seed`: this deployment's first search
    at L on another link: each search probes its bracket first (req/s of the
    deployment), the first probe sized from the service time it measured;
    else `guesses`' bracket for its (TBT target, SLO definition) (the
    neighbouring length's, decision_brackets.py). `ceilings`: (TBT target,
    SLO definition) -> the best capacity per GPU so far in the cell: a search
    not expected above it probes it first (search's `ceiling`). `bounds`: a
    bracket for a search with no other, once the ceiling said nothing.
    `searches`, when given, gets each search by (TBT target, SLO definition)."""
    from testbed.sim.cost_model import CostModel
    one_gpu = CostModel(point.model, point.hardware, ParallelConfig(), point.engine)
    worker = CostModel(point.model, point.hardware, point.parallel, point.engine)
    base = dep.apply(point)
    validate(base)
    gpus = dep.num_gpus(base)
    service_s = isolated_s(worker, L, e.output_len)
    bracket = None
    if seed is not None:
        bracket, service_s = (seed.capacity, seed.first_failing), seed.service_s or service_s
    rows, first = [], None
    if not skip and isinstance(base.num_kv_blocks, int):
        share = never_fit_share(e, L, base.num_kv_blocks, base.block_size)
        if share > 0.01:
            log(f"decision: {dep.label} at L={L}: {share:.0%} of the requests need more KV than a worker's "
                f"{base.num_kv_blocks} blocks ({base.num_kv_blocks * base.block_size} tokens) and never finish; "
                f"raise it with +experiment.kv_blocks.{point.hardware.name}=N")
    for tbt in e.tbt_slos_ms:
        slo_cfg, targets = length_point(e, base, one_gpu, L, tbt)
        for smooth in smooths:
            run_cfg = judged_run(slo_cfg, smooth)
            # runs are shared across smoothness definitions unless they differ (adaptive's slack)
            key = (point.model.name, point.hardware.name, num_gpus, dep.label,
                   point.link.name if dep.uses_link else "-", L, tbt if dep.reads_slo else "-",
                   *(("no-slack",) if run_cfg is not slo_cfg else ()))
            t0 = time.monotonic()
            here = bracket if seed is not None else (guesses or {}).get((tbt, smooth.name))
            ceiling = (ceilings or {}).get((tbt, smooth.name))
            if ceiling is not None and here is not None and here[0] >= ceiling * gpus:
                ceiling = None             # expected to beat it: searched as usual
            here = here or (bounds or {}).get((tbt, smooth.name))
            res = Search(None, "none", skip, False, 0) if skip else search(
                prober, key, run_cfg, smooth, targets, start, service_s, rel_tol or e.rel_tol,
                max_probes or e.max_probes, here, e.max_requests_per_gpu * num_gpus,
                None if ceiling is None else ceiling * gpus, reuse=e.prior_brackets)
            if searches is not None:
                searches[(tbt, smooth.name)] = res
            if first is None or (first.capacity is None and res.capacity is not None):
                first = res
            rows += [_row(point, link, num_gpus, smooth.name, tbt, targets, L, dep, gpus, res, prober.runner.source)
                     for link in row_links]
            per_gpu = "-" if res.capacity is None else f"{res.capacity / gpus:.4g}"
            where = point.link.name if dep.uses_link else "any link"
            log(f"decision {prober.runner.source} {key[0]}/{key[1]}/N{num_gpus} {dep.label} {where} "
                f"{smooth.name}@{tbt}ms L={L}: {per_gpu} req/s/GPU ({res.bound}"
                f"{', ' + res.limited_by if res.limited_by else ''}{'' if res.steady else ', NOT steady'}; "
                f"{res.probes} probes, {time.monotonic() - t0:.1f} s)")
    return rows, first


def _row(point: RunConfig, link, num_gpus: int, slo: str, tbt, targets: SLOTargets, L: int, dep: Deployment,
         gpus: int, res: Search, source: str = "sim") -> dict:
    return {"model": point.model.name, "hardware": point.hardware.name, "link": link.name,
            "link_gbps": link.bandwidth_gbps, "num_gpus": num_gpus, "slo": slo, "tbt_slo_ms": tbt,
            "ttft_slo_ms": round(targets.ttft_ms, 3), "context_len": L, "deployment": dep.label,
            "family": dep.family, "capacity_per_gpu": None if res.capacity is None else res.capacity / gpus,
            "bound": res.bound, "limited_by": res.limited_by, "steady": res.steady, "probes": res.probes,
            "source": source,
            # the capacity lies in [capacity_per_gpu, first_failing_per_gpu): the search's bracket
            "first_failing_per_gpu": None if res.first_failing is None else res.first_failing / gpus}
