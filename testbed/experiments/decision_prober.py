"""The probes of the `decision` study's capacity searches (decision_search.py):
a probe is a run of Poisson arrivals of prompts of ~L tokens on a runner,
the simulator (SimProbes) or the real engine (decision_real.py's
RealProbes). The Prober sizes each by the steady-state rule, lengthens it
while it comes out too short, and remembers it so that every SLO definition
judging the same run shares it; with a probe cache (probe_cache.py) a
simulated probe this code already ran is replayed."""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from testbed.config import RunConfig
from testbed.experiments.decision_slo import SLOTargets, Smoothness
from testbed.experiments.deployments import replace_run
from testbed.experiments.probe_cache import ProbeCache, entry_of, same_counts
from testbed.metrics import RequestRecord
from testbed.steady_state import SteadyRule, Window


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
    # unjudged, and lengthened its service time grew with it: a queue growing with the run (SettledFailure)
    overloaded: bool = False

    def __post_init__(self) -> None:
        if self.num_judged < 0:
            self.num_judged = len(self.window.judged)

    @property
    def unjudged(self) -> bool:
        """Every request finished and none in the judged window: too short to say anything."""
        return self.num_finished == self.num_requests and not self.num_judged

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


@dataclass(frozen=True)
class SettledFailure:
    """A failing probe the Prober does not lengthen: one of `limits` missed
    over at least `judged` judged requests, a percentile over enough requests
    not to be one long prompt's. The limit must be one every SLO definition
    sharing the run judges alike (the decision study's TTFT: the cell's target,
    whichever definition asks), or a lengthening that another definition
    would have judged is lost. With `growing_queue`, also an unjudged run
    whose longest service time grew from the run before it (the same rate,
    shorter) at least as the square root of its length: a steady system's
    service time does not grow with the run, an overloaded one's grows as
    its queue, in proportion; no length gives that run a steady state."""
    limits: tuple[str, ...]
    judged: int
    growing_queue: bool = False

    def __call__(self, missed: str, run: ProbeRun, previous: ProbeRun | None = None) -> bool:
        return missed in self.limits and run.num_judged >= self.judged or self.queue_grew(run, previous)

    def queue_grew(self, run: ProbeRun, previous: ProbeRun | None) -> bool:
        """With growing_queue: `run` is unjudged and its service time grew from `previous`'s (the
        same rate, shorter) at least as the square root of their lengths' ratio."""
        return (self.growing_queue and run.unjudged and previous is not None and previous.window.service_s > 0
                and run.window.service_s / previous.window.service_s
                >= (run.num_requests / previous.num_requests) ** 0.5)


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
    none in the window: it says nothing), lengthened as a passing one; nor is
    one `settled` names (SettledFailure). Remembers every run by
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
    every probe (the study's progress). `rule_out` in probe(): a probe at
    a rival's capacity, to rule the deployment out (decision_search's
    ceiling): sized for at least that many judged requests, and lengthened
    while it passes; failing over fewer judged requests than that, once, at
    most 3x longer (an overloaded run has no steady state to reach:
    lengthened, its service time grows with it, up to max_requests); judging
    none, where `settled` tells an overload by its growing queue (the run's
    `overloaded`), once twice as long, and once more, as long as the rule
    asks, where the queue did not grow."""

    def __init__(self, rule: SteadyRule, log, runner: ProbeRunner | None = None, max_span_s: float | None = None,
                 max_lengthenings: int = 2,    # a service time still growing after two is the rate's
                 deadline: float | None = None, cache: ProbeCache | None = None,
                 on_probe: Callable[[], None] | None = None, settled: SettledFailure | None = None):
        self.rule, self.log, self.on_probe, self.settled = rule, log, on_probe, settled
        self.runner, self.max_span_s, self.max_lengthenings = runner or SimProbes(), max_span_s, max_lengthenings
        self.deadline = deadline
        if cache is not None and self.runner.source != "sim":
            raise ValueError("experiment.probe_cache: only simulated probes can be replayed (a real run is "
                             "not deterministic)")
        self.cache = cache
        self.runs: dict[tuple, dict[float, ProbeRun]] = {}     # key -> rate -> its run
        self.service_s: dict[tuple, float] = {}        # the latest measured longest service time
        self.rows: list[dict] = []                     # decision_probes.csv
        self.num_runs = 0                              # runs made (not replayed)
        self.num_replayed = 0

    def probe(self, key: tuple, cfg: RunConfig, rate: float, first_service_s: float,
              limit: Callable[[ProbeRun], str], asker: str = "", max_requests: int | None = None,
              rule_out: int = 0) -> ProbeRun:
        # a rate reached two ways (a rival's capacity per GPU times this deployment's GPUs) may differ in
        # its last bits: the same probe
        same = next((r for r in self.runs.get(key, {}) if math.isclose(r, rate, rel_tol=1e-9)), None)
        if same is not None:
            return self.runs[key][same]
        service = self.service_s.get(key, first_service_s)
        n = self._size(rate, service, max_requests, rule_out)
        run = self._run(cfg, rate, n)
        runs, wall_s, cpu_s = 1, run.wall_s, run.cpu_s     # a lengthened probe's row counts every run it took
        missed, previous = limit(run), None
        for _ in range(self.max_lengthenings):
            needed = self._size(rate, run.window.service_s, max_requests, rule_out)
            if not self._lengthens(run, needed, missed, previous, rule_out):
                break
            if rule_out and run.unjudged and previous is None:
                # telling an overload takes only a longer run, not one as long as the rule asks: twice as
                # long first (an overloaded run's service time doubles), as long as it asks only where
                # the queue did not grow (_lengthens)
                needed = min(needed, 2 * run.num_requests)
            previous, run = run, self._run(cfg, rate, needed)
            runs, wall_s = runs + 1, wall_s + run.wall_s
            cpu_s = None if cpu_s is None or run.cpu_s is None else cpu_s + run.cpu_s
            missed = limit(run)
        run.overloaded = self.settled is not None and self.settled.queue_grew(run, previous)
        if not missed and run.window.service_s > 0:
            self.service_s[key] = run.window.service_s
        self.runs.setdefault(key, {})[rate] = run
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

    def _lengthens(self, run: ProbeRun, needed: int, missed: str, previous: ProbeRun | None, rule_out: int) -> bool:
        """Whether a probe that came out as `run` (missing `missed`, "" for none; `previous`: its
        shorter run at the same rate, if any) runs again, `needed` requests long."""
        if not run.num_finished or needed <= run.num_requests:
            return False
        # an unjudged run is too short to say anything, not a failure (failing such a probe sent
        # dsv2's sarathi-2048 search at 2K below half its capacity)
        if rule_out and missed:
            # judged too few to rule the deployment out: once more, at most 3x longer (an overloaded
            # run's service time grows with it: it is not chased), or judging none, twice as long to
            # tell an overload (SettledFailure.queue_grew) from too short a guess, then, its queue not
            # grown, as long as it asks
            watching = self.settled is not None and self.settled.growing_queue
            if previous is not None:
                # the doubled run that still judged none and whose queue did not grow: as long as it asks
                return watching and run.unjudged and previous.unjudged and not self.settled.queue_grew(run, previous)
            return 0 < run.num_judged < rule_out and needed <= 3 * run.num_requests or run.unjudged and watching
        if run.window.steady:
            return False
        if not missed:
            return True
        settled = self.settled is not None and self.settled(missed, run, previous)
        return (run.unjudged or needed <= 3 * run.num_requests) and not rule_out and not settled

    def known(self, key: tuple) -> dict[float, ProbeRun]:
        """The runs made so far for `key`, by rate (another search's on the same runs)."""
        return self.runs.get(key, {})

    def _size(self, rate: float, service_s: float, max_requests: int | None, min_judged: int = 0) -> int:
        n = self.rule.num_requests(rate, service_s, max_requests, min_judged)
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


class OutOfTime(Exception):
    """The Prober's deadline passed before a probe could start."""
