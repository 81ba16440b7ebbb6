"""Capacity: the highest request rate (`workload.rate`) a configuration serves
within its SLOs, found by binary search over complete runs. Works for runtime=sim and runtime=real alike: every probe is one
`testbed.run.execute` into its own sub-directory, and reads its summary.

A probe meets the SLOs when every request finished, p99 TTFT <= slo.ttft_ms
and p99 TBT <= the summary's TBT SLO (slo.tpot_ms, as summarize applies it).
The search assumes that holds below some rate and fails above it: it doubles
or halves from the configured rate until it brackets the answer, then bisects
until the bracket is within `rel_tol` (`search_rate`, shared with the
`decision` study). `capacity.json` holds every probe and the answer.

With a `SteadyRule` (testbed/steady_state.py) every probe is sized from the
longest service time seen so far so that its arrivals span many of them, the
SLOs are judged on the requests of the steady window only (warm-up and drain
excluded), and a probe still too short is flagged `steady: false`; the
result's `steady` says whether the deciding probes (the answer and the first
failing rate) were steady.

    testbed capacity [--out DIR] [--rel-tol 0.05] [--max-probes 16] [hydra overrides]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import Callable

from testbed.config import RunConfig
from testbed.steady_state import SteadyRule

RATE_ARRIVALS = ("poisson", "gamma", "constant")


@dataclass
class Probe:
    rate: float
    meets_slo: bool
    reason: str                       # why not, or "ok"
    ttft_p99_ms: float | None
    tbt_p99_ms: float | None
    num_finished: int
    num_requests: int
    goodput: float
    out_dir: str
    steady: bool = True               # False: too short to say (steady_state.py); its verdict does not count
    steady_reason: str = "ok"


@dataclass
class CapacityResult:
    rate: float | None                # highest probed rate meeting the SLOs; None: even the lowest failed
    first_failing_rate: float | None  # lowest probed rate above it that failed; None: none failed
    slo_ttft_ms: float
    slo_tbt_ms: float
    runtime: str
    probes: list[Probe] = field(default_factory=list)
    steady: bool = True               # the probes at rate and first_failing_rate reached a steady state

    def deciding_steady(self) -> bool:
        return all(p.steady for p in self.probes if p.rate in (self.rate, self.first_failing_rate))


def judge(summary: dict, slo_ttft_ms: float, slo_tbt_ms: float) -> tuple[bool, str]:
    """Whether one run's summary meets the SLOs, and why not."""
    n, done = summary["num_requests"], summary["num_finished"]
    if done < n:
        return False, f"{n - done} of {n} requests did not finish"
    ttft, tbt = summary["ttft_ms"]["p99"], summary["tbt_ms"]["p99"]
    if ttft is not None and ttft > slo_ttft_ms:
        return False, f"p99 TTFT {ttft:.1f} ms > {slo_ttft_ms} ms"
    if tbt is not None and tbt > slo_tbt_ms:
        return False, f"p99 TBT {tbt:.1f} ms > {slo_tbt_ms} ms"
    return True, "ok"


def _check(cfg: RunConfig, rel_tol: float, max_probes: int) -> None:
    if cfg.workload.arrival not in RATE_ARRIVALS:
        raise ValueError(f"workload.arrival: capacity search varies workload.rate, which arrival="
                         f"'{cfg.workload.arrival}' ignores; use one of {', '.join(RATE_ARRIVALS)}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol: a fraction in (0, 1), got {rel_tol}")
    if max_probes < 2:
        raise ValueError(f"max_probes: need at least 2 probes to bracket a rate, got {max_probes}")


def search_rate(probe: Callable[[float], bool], start: float, rel_tol: float, max_probes: int,
                bracket: tuple[float, float] | None = None) -> None:
    """Moves up from `start` while rates pass, or down while they fail, until
    one rate passes and a higher one fails, then bisects geometrically (rates
    span orders of magnitude) until hi/lo - 1 <= rel_tol or max_probes probes
    ran. probe(rate) says whether the rate met the SLOs; the caller keeps the
    verdicts. Each move doubles (or halves). With `bracket` (lo, hi), found
    under nearly the same conditions (the same deployment on another link),
    the search probes lo, then hi, and moves on only where a verdict differs,
    first by hi/lo, each further move squaring that up to doubling: where the
    conditions did not matter it ends in those two probes, on the same rates."""
    step = 2.0
    if bracket is not None:
        lo, hi = bracket
        if not 0 < lo < hi <= 2 * lo:
            raise ValueError(f"search_rate: bracket must be (lo, hi) with 0 < lo < hi <= 2 lo, got {bracket}")
        start, step = lo, hi / lo
    lo = hi = None                     # highest passing, lowest failing
    rate, n = start, 0
    while n < max_probes and (lo is None or hi is None):
        n += 1
        if probe(rate):
            lo = rate
            # the bracket's own upper end, not lo * step: the very rate probed before
            rate = bracket[1] if bracket is not None and n == 1 else rate * step
        else:
            hi = rate
            rate /= step
        step = min(step * step, 2.0)
    # (a bracket of exactly 1 + rel_tol, as a given one can be, is done despite rounding)
    while n < max_probes and lo is not None and hi is not None and hi / lo - 1 > rel_tol * (1 + 1e-9):
        n += 1
        mid = (lo * hi) ** 0.5
        if probe(mid):
            lo = mid
        else:
            hi = mid


def find_capacity(cfg: RunConfig, out_dir: str | Path, rel_tol: float = 0.05, max_probes: int = 16,
                  log=print, steady: SteadyRule | None = None) -> CapacityResult:
    """Binary-search workload.rate for `cfg`, starting from cfg.workload.rate;
    writes out_dir/capacity.json and returns the result. With `steady`, the
    first probe has cfg.workload.num_requests requests and every later one as
    many as the rule asks for at its rate (a probe found too short is re-run
    once, longer)."""
    from testbed.run import execute
    _check(cfg, rel_tol, max_probes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slo_ttft = cfg.slo.ttft_ms
    slo_tbt = getattr(cfg.slo, "tbt_ms", None) or cfg.slo.tpot_ms
    result = CapacityResult(None, None, slo_ttft, slo_tbt, cfg.runtime.name)
    service_s: list[float] = []        # the longest service time seen so far

    def run(rate: float, num_requests: int) -> tuple[dict, Path]:
        workload = dataclasses.replace(cfg.workload, rate=rate, num_requests=num_requests)
        run_cfg = dataclasses.replace(cfg, workload=workload, progress=False)
        run_dir = out / f"probe{len(result.probes):02d}-rate{rate:.4g}"
        return execute(run_cfg, run_dir), run_dir

    def probe(rate: float) -> bool:
        n = cfg.workload.num_requests if steady is None or not service_s else steady.num_requests(rate, service_s[0])
        summary, run_dir = run(rate, n)
        steady_ok, steady_why = True, "ok"
        if steady is not None:
            summary, window = _steady_summary(summary, run_dir, steady, slo_ttft, slo_tbt)
            if not window.steady and window.service_s > 0 and steady.num_requests(rate, window.service_s) > n:
                summary, run_dir = run(rate, steady.num_requests(rate, window.service_s))
                summary, window = _steady_summary(summary, run_dir, steady, slo_ttft, slo_tbt)
            service_s[:] = [max([window.service_s, *service_s])]
            steady_ok, steady_why = window.steady, window.reason
        ok, why = judge(summary, slo_ttft, slo_tbt)
        result.probes.append(Probe(rate, ok, why, summary["ttft_ms"]["p99"], summary["tbt_ms"]["p99"],
                                   summary["num_finished"], summary["num_requests"], summary["goodput"],
                                   str(run_dir), steady_ok, steady_why))
        flag = "" if steady_ok else f" (not steady: {steady_why})"
        log(f"capacity probe {len(result.probes)}: rate {rate:.4g} req/s -> "
            f"{'meets the SLOs' if ok else why}{flag}")
        if ok and (result.rate is None or rate > result.rate):
            result.rate = rate
        if not ok and (result.first_failing_rate is None or rate < result.first_failing_rate):
            result.first_failing_rate = rate
        result.steady = result.deciding_steady()
        _write(out, result)
        return ok

    search_rate(probe, cfg.workload.rate, rel_tol, max_probes)
    _write(out, result)
    return result


def _steady_summary(summary: dict, run_dir: Path, rule: SteadyRule, slo_ttft: float, slo_tbt: float):
    """The run's summary with its latencies over the steady window only (the
    request counts stay the whole run's: an unfinished request fails the
    probe wherever it arrived), and the window."""
    from testbed.metrics import read_requests
    from testbed.run_stats import summarize
    window = rule.window(read_requests(run_dir / "requests.jsonl"))
    judged = summarize(window.judged, [], slo_ttft, slo_tbt)
    return {**summary, "ttft_ms": judged["ttft_ms"], "tbt_ms": judged["tbt_ms"]}, window


def _write(out: Path, result: CapacityResult) -> None:
    (out / "capacity.json").write_text(json.dumps(dataclasses.asdict(result), indent=2))


def capacity_main(argv: list[str]) -> int:
    """`testbed capacity [--out DIR] [--rel-tol F] [--max-probes N] [hydra overrides]`."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs
    from testbed.model.config import CONF_DIR

    parser = argparse.ArgumentParser(prog="testbed capacity", description=(
        "The highest workload.rate whose p99 TTFT and p99 TBT meet slo.* with every request finished "
        "(binary search; one run per probe). Hydra overrides as for `testbed run`."))
    parser.add_argument("--out", default=None, help="directory for capacity.json and one sub-directory per probe")
    parser.add_argument("--rel-tol", type=float, default=0.05, help="stop when the bracket is this narrow (0.05)")
    parser.add_argument("--max-probes", type=int, default=16, help="at most this many runs (16)")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}; Hydra overrides look like key=value")
    from testbed.cli_errors import override_error, refused_override
    from testbed.data.config import use_data_dir
    refused = refused_override(overrides)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            dcfg = compose("config", overrides)
            use_data_dir(dcfg.data.dir)
            cfg: RunConfig = OmegaConf.to_object(dcfg)
    except Exception as e:          # composing is all Hydra's: whatever it raises is a bad override
        print(f"error: {override_error(e, task_started=False)}", file=sys.stderr)
        return 2
    try:
        out = args.out or f"outputs/capacity/{time.strftime('%Y-%m-%d/%H-%M-%S')}-{cfg.mode}-{cfg.scheduler}"
        result = find_capacity(cfg, out, args.rel_tol, args.max_probes)
    except (ValueError, TimeoutError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result.rate is None:
        print(f"capacity: no probed rate met the SLOs (lowest tried {min(p.rate for p in result.probes):.4g} "
              f"req/s) -> {out}/capacity.json")
    else:
        above = "none failed" if result.first_failing_rate is None else f"{result.first_failing_rate:.4g} failed"
        print(f"capacity: {result.rate:.4g} req/s ({above}; SLOs p99 TTFT <= {result.slo_ttft_ms} ms, "
              f"p99 TBT <= {result.slo_tbt_ms} ms; {cfg.runtime.name}) -> {out}/capacity.json")
    return 0
