"""The capacity search of the `decision` study (decision.py runs the grid,
decision_real.py the real engine's rows): one deployment's capacity per GPU
at one context length L, per TBT target and smoothness definition, found by
testbed/capacity.py's search_rate over probes that reach a steady state
(testbed/steady_state.py). A probe is a run of Poisson arrivals of prompts
of ~L tokens on a runner: the simulator (SimProbes) or the real engine
(decision_real.py's RealProbes); the Prober sizes, lengthens and remembers
them so that every SLO definition judging the same run shares it."""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from testbed.capacity import search_rate
from testbed.config import RunConfig, validate
from testbed.sim.engine_config import resolve_engine
from testbed.experiments.decision_slo import SLOTargets, Smoothness
from testbed.experiments.decision_summary import DOMINATED
from testbed.experiments.deployments import Deployment, replace_run
from testbed.experiments.probe_cache import ProbeCache, entry_of, same_counts
from testbed.metrics import RequestRecord
from testbed.model.config import load_model_preset
from testbed.sim.config import ParallelConfig, load_hardware_preset
from testbed.steady_state import SteadyRule, Window
from testbed.workloads.config import WorkloadConfig

COLUMNS = ("model", "hardware", "link", "link_gbps", "num_gpus", "slo", "tbt_slo_ms", "ttft_slo_ms", "context_len",
           "deployment", "family", "capacity_per_gpu", "bound", "limited_by", "steady", "probes", "source",
           "first_failing_per_gpu")


@dataclass
class ProbeRun:
    window: Window
    num_requests: int
    num_finished: int
    wall_s: float = 0.0
    load_1m: float | None = None      # the 1-minute load average when it ended
    records: str = ""                 # where the runner kept its records ("": not kept)
    # the simulating process's CPU seconds: unlike wall_s, not inflated by the machine's other work
    # (None for a real probe, whose work is in its worker processes, and for a replayed one from before)
    cpu_s: float | None = None
    num_judged: int = -1              # len(window.judged); a replayed run's window comes without its records
    cached: bool = False              # replayed from the probe cache (probe_cache.py)
    # the arrival index (request id rN) of the first request that never finished, None: none
    first_stuck: int | None = None
    verdicts: dict[str, str] = field(default_factory=dict)    # SLO definition and targets -> the limit missed
    # a replayed run's records, by running it again (for a definition that never judged it)
    rerun: Callable[[], ProbeRun] | None = field(default=None, repr=False, compare=False)
    on_verdict: Callable[[ProbeRun], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_judged < 0:
            self.num_judged = len(self.window.judged)

    def judge(self, smooth: Smoothness, targets: SLOTargets) -> str:
        """smooth.judge of the judged window, once per definition and targets."""
        key = f"{smooth.name} {targets.ttft_ms!r} {targets.tbt_ms!r} {targets.fluidity_min!r}"
        if key not in self.verdicts:
            if self.rerun is not None:
                self.window, self.rerun = self.rerun().window, None
            self.verdicts[key] = smooth.judge(self.window.judged, targets)
            if self.on_verdict is not None:
                self.on_verdict(self)
        return self.verdicts[key]


class ProbeRunner(Protocol):
    """What runs a probe's requests: SimProbes, or decision_real.py's RealProbes."""
    source: str                        # decision_probes.csv's `source`: sim | real
    none_finished_is_memory: bool      # no request finishing means the prompt never fits
    last_dir: str                      # where the last run's records were kept ("": not kept)

    def records(self, cfg: RunConfig, requests: list) -> list[RequestRecord]: ...


class SimProbes:
    """A probe run on the simulator, in this process. A simulated probe where
    no request finishes is a verdict on memory (the prompt does not fit)."""
    source = "sim"
    none_finished_is_memory = True
    last_dir = ""                     # a simulated probe's records are not kept

    def records(self, cfg: RunConfig, requests: list) -> list[RequestRecord]:
        from testbed.runtime.sim import SimRuntime
        return SimRuntime(cfg, log=lambda *_: None).run(requests).records


class Prober:
    """Runs probes (on `runner`: SimProbes, or decision_real.py's RealProbes), each sized by the steady-state rule from
    the longest service time of the last passing probe; a probe that passed
    but came out too short is re-run as long as the rule asks, at most twice
    (a short burst that passes is the false answer to guard against; a longer
    probe sees a longer service-time tail, so the target moves). A failing one
    is lengthened only when at most 3x longer would do: an overloaded probe has no
    steady state to reach (its service times grow with the queue), and stays
    flagged when too short; except an unjudged one (every request finished,
    none in the window: it says nothing), lengthened as a passing one. Remembers every run by
    (deployment, link, L, SLO the run reads, rate) so SLO definitions share them.
    `limit(run)` is the SLO limit a run misses for the search asking ("" when
    it meets them: a pass); its row in decision_probes.csv records that verdict
    and the definition (`asker`) that gave it: a later definition reusing the
    run may judge it otherwise (its rows in decision.csv say how).
    With `max_span_s` no probe's arrivals span longer than that (the real
    engine's probes run on the wall clock): one that needs more runs that
    long and stays flagged; `max_lengthenings` bounds the re-runs. Past
    `deadline` (time.monotonic()) no probe starts: OutOfTime. With `cache`
    (simulated probes only: they are deterministic) a probe this code already
    ran is replayed from it (probe_cache.py). `on_probe()` is called after
    every probe (the study's progress)."""

    def __init__(self, rule: SteadyRule, log, runner: ProbeRunner | None = None, max_span_s: float | None = None,
                 max_lengthenings: int = 2,    # a service time still growing after two is the rate's
                 deadline: float | None = None, cache: ProbeCache | None = None,
                 on_probe: Callable[[], None] | None = None):
        self.rule, self.log, self.on_probe = rule, log, on_probe
        self.runner, self.max_span_s, self.max_lengthenings = runner or SimProbes(), max_span_s, max_lengthenings
        self.deadline = deadline
        if cache is not None and self.runner.source != "sim":
            raise ValueError("experiment.probe_cache: only simulated probes can be replayed (a real run is "
                             "not deterministic)")
        self.cache = cache
        self.runs: dict[tuple, ProbeRun] = {}
        self.service_s: dict[tuple, float] = {}        # the latest measured longest service time
        self.rows: list[dict] = []                     # decision_probes.csv
        self.num_runs = 0                              # runs made (not replayed)
        self.num_replayed = 0

    def probe(self, key: tuple, cfg: RunConfig, rate: float, first_service_s: float,
              limit: Callable[[ProbeRun], str], asker: str = "", max_requests: int | None = None) -> ProbeRun:
        if (*key, rate) in self.runs:
            return self.runs[(*key, rate)]
        service = self.service_s.get(key, first_service_s)
        n = self._size(rate, service, max_requests)
        run = self._run(cfg, rate, n)
        runs, wall_s, cpu_s = 1, run.wall_s, run.cpu_s     # a lengthened probe's row counts every run it took
        missed = limit(run)
        passed = not missed
        for _ in range(self.max_lengthenings):
            needed = self._size(rate, run.window.service_s, max_requests)
            # every request finished and none in the window: too short to say anything, not a failure
            # (failing such a probe sent dsv2's sarathi-2048 search at 2K below half its capacity)
            unjudged = run.num_finished == run.num_requests and not run.num_judged
            if run.window.steady or not run.num_finished or needed <= run.num_requests \
                    or not (passed or unjudged or needed <= 3 * run.num_requests):
                break
            run = self._run(cfg, rate, needed)
            runs, wall_s = runs + 1, wall_s + run.wall_s
            cpu_s = None if cpu_s is None or run.cpu_s is None else cpu_s + run.cpu_s
            missed = limit(run)
            passed = not missed
        if passed and run.window.service_s > 0:
            self.service_s[key] = run.window.service_s
        self.runs[(*key, rate)] = run
        self.rows.append({"key": "/".join(map(str, key)), "rate": rate, "num_requests": run.num_requests,
                          "num_finished": run.num_finished, "judged": run.num_judged,
                          "span_s": run.window.span_s, "service_s": run.window.service_s,
                          "steady": run.window.steady, "steady_reason": run.window.reason,
                          "verdict": missed or "pass", "judged_by": asker, "source": self.runner.source, "runs": runs,
                          "wall_s": round(wall_s, 2), "cpu_s": None if cpu_s is None else round(cpu_s, 2),
                          "load_1m": run.load_1m, "records": run.records,
                          "cached": run.cached})
        if self.on_probe is not None:
            self.on_probe()
        return run

    def _size(self, rate: float, service_s: float, max_requests: int | None) -> int:
        n = self.rule.num_requests(rate, service_s, max_requests)
        return n if self.max_span_s is None else min(n, max(2, int(rate * self.max_span_s) + 1))

    def _run(self, cfg: RunConfig, rate: float, n: int) -> ProbeRun:
        w = cfg.workload
        turns = max(1, w.conversation_turns)         # multi-turn: rate counts conversations
        run_cfg = replace_run(cfg, workload=dataclasses.replace(w, rate=rate / turns, num_requests=n))
        if self.cache is None:
            return self._execute(run_cfg)
        cache, key = self.cache, self.cache.key(run_cfg)
        entry = cache.get(key)
        if entry is None:
            run = self._execute(run_cfg)
            cache.put(key, entry_of(run))
        else:
            self.num_replayed += 1
            run = ProbeRun(Window([], entry["steady"], entry["reason"], entry["span_s"], entry["service_s"]),
                           entry["num_requests"], entry["num_finished"], entry["wall_s"], entry["load_1m"],
                           cpu_s=entry.get("cpu_s"), num_judged=entry["num_judged"], cached=True,
                           first_stuck=entry.get("first_stuck"),
                           verdicts=dict(entry["verdicts"]),
                           rerun=lambda: self._rerun(run_cfg, entry))
        run.on_verdict = lambda r: cache.put(key, entry_of(r))
        return run

    def _rerun(self, run_cfg: RunConfig, entry: dict) -> ProbeRun:
        """A replayed probe run again for its records: it must give the cached figures."""
        run = self._execute(run_cfg)
        if not same_counts(entry, run):
            raise RuntimeError(f"experiment.probe_cache: probe {entry['key'][:12]}, run again, gave other figures "
                               f"than the cache at {self.cache.dir} holds for this code; delete that directory")
        return run

    def _execute(self, run_cfg: RunConfig) -> ProbeRun:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise OutOfTime
        from testbed.runtime.build import apply_sampling
        from testbed.workloads.build import build_workload
        requests = build_workload(run_cfg.workload, run_cfg.model.vocab_size, run_cfg.seed)
        apply_sampling(run_cfg, requests)
        t0, c0 = time.monotonic(), time.process_time()
        records = self.runner.records(run_cfg, requests)
        wall_s, cpu_s = time.monotonic() - t0, time.process_time() - c0
        self.num_runs += 1
        finished = sum(r.finished for r in records)
        stuck = [int(r.request_id[1:]) for r in records if not r.finished and r.request_id[1:].isdigit()]
        # the load the probe ran under: a real probe's capacity is the machine's share it got
        return ProbeRun(self.rule.window(records), len(records), finished, wall_s, round(os.getloadavg()[0], 2),
                        self.runner.last_dir, cpu_s=cpu_s if self.runner.source == "sim" else None,
                        first_stuck=min(stuck, default=None))


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


class OutOfTime(Exception):
    """The Prober's deadline passed before a probe could start."""


@dataclass
class Search:
    capacity: float | None           # requests/s of the deployment
    bound: str                       # bracketed | lower | none
    limited_by: str
    steady: bool
    probes: int
    first_failing: float | None = None   # the lowest probed rate above capacity (it failed); None: none did
    service_s: float | None = None       # the longest service time its passing probes measured last (sizes probes)


def search(prober: Prober, key: tuple, cfg: RunConfig, smooth: Smoothness, targets: SLOTargets, start: float,
           first_service_s: float, rel_tol: float, max_probes: int,
           bracket: tuple[float, float] | None = None, max_requests: int | None = None,
           ceiling: float | None = None) -> Search:
    """The highest steady-judged rate meeting the SLOs (bisection to rel_tol).
    On the simulator a rate where no request finishes (the prompt does not
    fit the KV memory), or where one of the first prompts every probe shares
    never finishes (the run ends when nothing is left to happen, every other
    request done and its blocks free: that one fits no empty worker), fails
    for every rate: the search stops there. A search
    cut by the Prober's deadline keeps what it measured, flagged
    (limited_by=budget, steady=false). `bracket`: search_rate's, probed first
    instead of searching from `start` (decision_brackets.py). `ceiling`: a
    rate another deployment passed in this cell, probed first: failing there
    (not `unjudged`, over at least MIN_JUDGED_TO_SKIP judged requests) the
    search ends, limited_by=dominated, no capacity, the ceiling its first
    failing rate; otherwise it goes on as usual (up from the ceiling when it
    passed)."""
    verdicts: dict[float, tuple[str, bool]] = {}       # rate -> (failed limit or "", steady)

    class NeverFits(Exception):
        pass

    def limit_of(run: ProbeRun) -> str:
        return verdict(run, smooth, targets)

    # every probe has at least this many requests, and (one turn each) the same first prompts: a request
    # among them that the simulator left unfinished fits no empty worker and fails every rate
    fewest = prober.rule.num_requests(0.0, 1.0, max_requests)
    one_turn = not cfg.workload.conversation_turns

    judged: dict[float, int] = {}

    def probe(rate: float) -> bool:
        run = prober.probe(key, cfg, rate, first_service_s, limit_of, smooth.name, max_requests)
        limit = limit_of(run)
        verdicts[rate] = (limit, run.window.steady)
        judged[rate] = run.num_judged
        if prober.runner.none_finished_is_memory and (
                run.num_finished == 0 or one_turn and run.first_stuck is not None and run.first_stuck < fewest):
            raise NeverFits
        return limit == ""

    never_fits = out_of_time = False
    try:
        if ceiling is not None and not probe(ceiling) and verdicts[ceiling][0] != "unjudged" \
                and judged[ceiling] >= MIN_JUDGED_TO_SKIP:
            return Search(None, "none", DOMINATED, verdicts[ceiling][1], 1, ceiling, prober.service_s.get(key))
        if ceiling is not None and not verdicts[ceiling][0]:
            start, bracket = ceiling, None
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
    if out_of_time:
        return Search(cap, bound, "budget", False, len(verdicts), fail, service)
    return Search(cap, bound, verdicts[fail][0] if fail is not None else "", steady, len(verdicts), fail, service)


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
                searches: dict[tuple, Search] | None = None) -> tuple[list[dict], Search | None]:
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
    SLO definition) -> the family's best capacity per GPU so far in the cell:
    a search not expected above it probes it first (search's `ceiling`).
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
            res = Search(None, "none", skip, False, 0) if skip else search(
                prober, key, run_cfg, smooth, targets, start, service_s, rel_tol or e.rel_tol,
                max_probes or e.max_probes, here, e.max_requests_per_gpu * num_gpus,
                None if ceiling is None else ceiling * gpus)
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
