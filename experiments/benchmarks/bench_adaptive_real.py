"""`scheduler=adaptive` on the real engine (tiny, this CPU), planning with a
fresh `testbed profile`:

1. stall: the `stall` workload (two 1,800-token prompts landing among eight
   decodes) under a p99 TBT SLO; adaptive (planning the bound: the corrected
   prediction times the tbt_quantile of its recent residuals) and
   adaptive-mean (`adaptive.tbt_quantile=null`: the mean at tbt_headroom 0.9,
   the planner before the bound) against sarathi with a too-large budget
   (misses the SLO) and a too-small one (slow long prompts). Each policy
   --repeats times, alternated; the spread between repeats is the noise. Late
   gaps (over the SLO) are split by the worker's iteration they came from:
   decode-only iterations over the SLO (nothing a budget can fix) and
   iterations carrying prefill over it (the planner's misses).
2. self-correction: the stall workload with longer answers (>= 400
   iterations), adaptive planning with the fresh profile deliberately 2x off
   (every term of the cost model doubled), and with it as measured (the noise
   floor). Prediction error |predicted / measured - 1| per iteration; the
   first crossing is the first window of 20 iterations whose median error is
   under 15%, the lasting crossing the first from which every window stays
   under. Plotted to selfcorrect.png.

    python experiments/benchmarks/bench_adaptive_real.py [--out DIR] [--repeats 3] [--quick-profile]
        [--runs-per-repeat K]

With ~100 judged iterations (iterations carrying decodes) a stall run, one
run's p99 TBT is decided by one iteration; --runs-per-repeat K pools K runs
of each policy into each repeat, so its p99 is the ~K-th worst iteration's;
--min-judged N stops adding runs once every policy holds N judged iterations.

Figures and their reading: experiments/README.md, "adaptive"."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import time
from pathlib import Path

import numpy as np

SLO_TBT_MS = 50.0
# (label, scheduler, token_budget, adaptive overrides); adaptive-nopf (adaptive.prefill_first=false, the
# policy without prefill_first) runs only when --policies names it
POLICIES = [("adaptive", "adaptive", None, {}), ("adaptive-mean", "adaptive", None, {"tbt_quantile": None}),
            ("sarathi-1024", "sarathi", 1024, {}), ("sarathi-32", "sarathi", 32, {})]
EXTRA = [("adaptive-nopf", "adaptive", None, {"prefill_first": False})]
WINDOW, THRESHOLD = 20, 0.15


def base_config(hardware_path: Path, tbt_ms: float, max_slack_tbt: float):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs
    from testbed.model.config import CONF_DIR
    from testbed.sim.config import load_hardware_preset
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("config", ["runtime=real", "scheduler=adaptive", "model=tiny",
                                                     "workload=stall", "progress=false", "wandb.mode=disabled",
                                                     f"slo.tpot_ms={tbt_ms}",
                                                     "adaptive.min_budget=16", "adaptive.budget_multiple=16",
                                                     f"adaptive.max_slack_tbt={max_slack_tbt}"]))
    return dataclasses.replace(cfg, hardware=load_hardware_preset(str(hardware_path)))


def run(cfg, out: Path) -> dict:
    from testbed.run import execute
    with contextlib.redirect_stdout(io.StringIO()):
        return execute(cfg, out)


def late_gaps(out: Path, slo_tbt_ms: float, min_budget: int) -> dict:
    """The decode tokens of the worker's iterations that ended more than one
    SLO after the previous one: decode-only ones (no budget can help),
    adaptive's at min_budget (nothing fit: the starvation guard), adaptive's
    whose mean prediction alone was past the SLO (planned so: banked slack
    spent, max_slack_tbt > 0), and the other ones carrying prefill (adaptive:
    the planner's misses; sarathi: its fixed budget). Also the iterations
    carrying decodes (the judged ones: each gives every running decode its
    gap) and the mixed iterations' mean predictions."""
    from testbed.metrics import read_iterations
    slo_s, prev_end, planned, judged = slo_tbt_ms * 1e-3, None, [], 0
    late = {"decode_only": 0, "min_budget": 0, "slack": 0, "with_prefill": 0}
    for it in read_iterations(out / "iterations.jsonl"):
        end = it.start_s + it.duration_s
        judged += bool(it.num_decode_tokens)
        if prev_end is not None and it.num_decode_tokens and end - prev_end > slo_s:
            kind = "with_prefill" if it.num_prefill_tokens else "decode_only"
            if it.num_prefill_tokens and it.predicted_s is not None:
                kind = ("min_budget" if it.token_budget - it.num_decode_tokens <= min_budget
                        else "slack" if it.predicted_s > slo_s else kind)
            late[kind] += it.num_decode_tokens
        if it.num_prefill_tokens and it.num_decode_tokens and it.predicted_s is not None:
            planned.append(it.predicted_s)
        prev_end = end
    return {"judged_iterations": judged, **late, "planned": planned}


def pooled(dirs: list[Path], slo_tbt_ms: float, min_budget: int, long_min_len: int) -> dict:
    """One repeat's figures over the gaps and requests of its runs together:
    p99 TBT over every token gap of every run (numpy's linear-interpolated
    percentile, as the run summaries), so with K runs a p99 is decided by
    ~K times as many iterations."""
    from testbed.metrics import read_requests
    recs = [r for d in dirs for r in read_requests(d / "requests.jsonl")]
    gaps = np.concatenate([np.diff(r.token_times_s) for r in recs if len(r.token_times_s) > 1])
    ttfts = np.array([r.ttft_s for r in recs])
    parts = [late_gaps(d, slo_tbt_ms, min_budget) for d in dirs]
    late = {k: sum(p[k] for p in parts) for k in ("judged_iterations", "decode_only", "min_budget", "slack",
                                                  "with_prefill")}
    planned = [x for p in parts for x in p["planned"]]
    return {"runs": len(dirs), "tbt_p99_ms": 1e3 * float(np.percentile(gaps, 99)), "tbt_max_ms": 1e3 * float(gaps.max()),
            "ttft_p50_ms": 1e3 * float(np.percentile(ttfts, 50)),
            "long_ttft_ms": 1e3 * float(np.mean([r.ttft_s for r in recs if r.prompt_len >= long_min_len])),
            "num_gaps": len(gaps), "late_gaps": int((gaps > slo_tbt_ms * 1e-3).sum()), **late,
            "mixed_predicted_p50_ms": 1e3 * float(np.median(planned)) if planned else None}


def judged_iterations(out: Path) -> int:
    from testbed.metrics import read_iterations
    return sum(bool(it.num_decode_tokens) for it in read_iterations(out / "iterations.jsonl"))


def stall(cfg, out: Path, repeats: int, runs_per_repeat: int = 1, policies=POLICIES, min_judged: int = 0) -> list[dict]:
    """Each repeat runs every policy runs_per_repeat times (with min_judged:
    until each policy's runs hold that many judged iterations, at most
    runs_per_repeat), the policies alternated run by run (so they see the
    same machine state), and pools each policy's runs."""
    rows = []
    for rep in range(repeats):
        dirs: dict[str, list[Path]] = {label: [] for label, *_ in policies}
        budgets: dict[str, float | None] = {}
        judged = dict.fromkeys(dirs, 0)
        for k in range(runs_per_repeat):
            if min_judged and k and min(judged.values()) >= min_judged:
                break
            for label, scheduler, budget, changes in policies:
                acfg = dataclasses.replace(cfg.adaptive, **changes)
                pcfg = dataclasses.replace(cfg, scheduler=scheduler, token_budget=budget or cfg.token_budget,
                                           adaptive=acfg)
                d = out / "stall" / (f"{label}-{rep}" if runs_per_repeat == 1 else f"{label}-{rep}-{k}")
                s = run(pcfg, d)
                dirs[label].append(d)
                judged[label] += judged_iterations(d)
                budgets.setdefault(label, s["iterations"].get("prefill_budget", {}).get("p50"))
        for label, *_ in policies:
            rows.append({"policy": label, "repeat": rep, "prefill_budget_p50": budgets[label],
                         **pooled(dirs[label], cfg.slo.tpot_ms, cfg.adaptive.min_budget,
                                  min(cfg.workload.inject_prompt_len))})
    return rows


def doubled(cfg):
    """Every term of the cost model twice as long: a profile 2x off (the hardware's and its engine's)."""
    hw, engine = cfg.hardware, cfg.run_engine()
    return (dataclasses.replace(hw, calibration_scale=2 * hw.calibration_scale),
            dataclasses.replace(engine, overhead_ms=2 * engine.overhead_ms,
                                overhead_per_seq_ms=2 * engine.overhead_per_seq_ms,
                                overhead_per_token_ms=2 * engine.overhead_per_token_ms))


def errors(out: Path) -> np.ndarray:
    from testbed.metrics import read_iterations
    its = read_iterations(out / "iterations.jsonl")
    return np.array([abs(it.predicted_s / it.duration_s - 1) for it in its if it.predicted_s is not None])


def rolling_median(err: np.ndarray) -> np.ndarray:
    return np.array([np.median(err[i:i + WINDOW]) for i in range(len(err) - WINDOW + 1)])


def first_crossing(err: np.ndarray) -> int | None:
    """The first window start whose median error is under THRESHOLD."""
    under = np.nonzero(rolling_median(err) < THRESHOLD)[0]
    return int(under[0]) if len(under) else None


def crossing(err: np.ndarray) -> int | None:
    """The first iteration from which the rolling median of the error stays under THRESHOLD."""
    med = rolling_median(err)
    above = np.nonzero(med >= THRESHOLD)[0]
    if len(above) == 0:
        return 0
    return None if above[-1] + 1 >= len(med) else int(above[-1] + 1)


def selfcorrect(cfg, out: Path) -> dict:
    wl = dataclasses.replace(cfg.workload, output_len=400)
    result = {}
    for label, (hw, engine) in (("2x_off", doubled(cfg)), ("as_profiled", (cfg.hardware, cfg.run_engine()))):
        d = out / "selfcorrect" / label
        run(dataclasses.replace(cfg, scheduler="adaptive", hardware=hw, engine=engine, workload=wl), d)
        err = errors(d)
        result[label] = {"num_iterations": len(err), "crossing": crossing(err), "first_crossing": first_crossing(err),
                         "first_error": float(err[0]), "median_first_20": float(np.median(err[:WINDOW])),
                         "median_after_200": float(np.median(err[200:])) if len(err) > 200 else None,
                         "p90_after_200": float(np.percentile(err[200:], 90)) if len(err) > 200 else None,
                         "errors": err.tolist()}
    plot(result, out / "selfcorrect.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    for (label, r), color in zip(result.items(), ("tab:red", "tab:blue")):
        err = np.array(r["errors"])
        ax.scatter(np.arange(len(err)), err * 100, s=3, color=color, alpha=0.3)
        med = rolling_median(err) * 100
        ax.plot(np.arange(len(med)), med, color=color, label=f"{label}: rolling median ({WINDOW}); first under "
                f"{THRESHOLD:.0%} at iteration {r['first_crossing']}, stays under from {r['crossing']}")
    ax.axhline(THRESHOLD * 100, color="black", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("|predicted / measured - 1|, %")
    ax.set_title("adaptive's step-time prediction on the real engine (tiny, this CPU), self-corrected per batch kind",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/bench_adaptive_real")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick-profile", action="store_true", help="testbed profile --quick (seconds)")
    parser.add_argument("--profile", default=None, help="use this profile YAML instead of measuring a fresh one")
    parser.add_argument("--slo-tbt-ms", type=float, default=SLO_TBT_MS, help="the p99 TBT SLO (slo.tpot_ms)")
    parser.add_argument("--max-slack-tbt", type=float, default=1.0, help="adaptive.max_slack_tbt")
    parser.add_argument("--stall-only", action="store_true", help="skip the self-correction runs")
    parser.add_argument("--policies", default=",".join(label for label, *_ in POLICIES),
                        help="comma-separated stall policies, of " + ", ".join(label for label, *_ in POLICIES + EXTRA))
    parser.add_argument("--runs-per-repeat", type=int, default=1,
                        help="stall runs pooled into each repeat's figures (~100 judged iterations each); "
                             "with --min-judged, the most")
    parser.add_argument("--min-judged", type=int, default=0,
                        help="add runs to each repeat until every policy's pooled runs hold this many judged "
                             "iterations (iterations carrying decodes), at most --runs-per-repeat")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = Path(args.profile) if args.profile else out / "cpu-fresh.yaml"
    if not args.profile:
        from testbed.profiling.profile import profile_main
        assert profile_main(["--out", str(profile)] + (["--quick"] if args.quick_profile else [])) == 0
    cfg = base_config(profile, args.slo_tbt_ms, args.max_slack_tbt)
    load_before = os.getloadavg()
    if args.runs_per_repeat < 1:
        parser.error(f"--runs-per-repeat: must be >= 1, got {args.runs_per_repeat}")
    known = {p[0]: p for p in POLICIES + EXTRA}
    if unknown := [label for label in args.policies.split(",") if label not in known]:
        parser.error(f"--policies: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    policies = [known[label] for label in args.policies.split(",")]
    start = time.monotonic()
    rows = stall(cfg, out, args.repeats, args.runs_per_repeat, policies, args.min_judged)
    stall_s = time.monotonic() - start
    sc = {} if args.stall_only else selfcorrect(cfg, out)
    (out / "report.json").write_text(json.dumps({"stall": rows, "selfcorrect": sc, "stall_s": stall_s,
                                                 "runs_per_repeat": args.runs_per_repeat,
                                                 "load_average": [load_before, os.getloadavg()]}, indent=1))
    print(f"\nstall workload, real engine (tiny, this CPU), p99 TBT SLO {args.slo_tbt_ms:g} ms, "
          f"adaptive.max_slack_tbt={args.max_slack_tbt:g}, adaptive.tbt_quantile={cfg.adaptive.tbt_quantile}; "
          f"load average (1, 5, 15 min) {' '.join(f'{x:.1f}' for x in load_before)} before, "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} after; "
          f"median [min, max] of {args.repeats} repeats of {'/'.join(str(r['runs']) for r in rows)} "
          f"run(s) pooled; "
          f"{stall_s:.0f} s of stall runs")
    for label, *_ in policies:
        sel = [r for r in rows if r["policy"] == label]

        def m(key):
            v = sorted(r[key] for r in sel)
            return f"{np.median(v):7.1f} [{v[0]:.1f}, {v[-1]:.1f}]"
        late = " ".join(f"{r['late_gaps']}/{r['num_gaps']} in {r['judged_iterations']} iterations "
                        f"({r['decode_only']}+{r['min_budget']}+{r['slack']}+{r['with_prefill']})" for r in sel)
        planned = [r["mixed_predicted_p50_ms"] for r in sel if r["mixed_predicted_p50_ms"] is not None]
        print(f"  {label:<13} TBT p99 {m('tbt_p99_ms')}  max {m('tbt_max_ms')}  TTFT p50 {m('ttft_p50_ms')}  "
              f"long prompts' TTFT {m('long_ttft_ms')} ms  prefill budget p50 {sel[0]['prefill_budget_p50']}")
        print(f"  {'':<13} late gaps per repeat {late}: over the SLO / all (at the worker: decode-only + "
              f"at min_budget + slack + other with prefill)" + (f"; mixed steps' mean prediction p50 "
                                  f"{' '.join(f'{p:.1f}' for p in planned)} ms" if planned else ""))
    if sc:
        print(f"\nself-correction (error = |predicted / measured - 1| per iteration, crossing: rolling median of "
              f"{WINDOW} stays < {THRESHOLD:.0%})")
    for label, r in sc.items():
        print(f"  {label:<12} {r['num_iterations']} iterations, first error {r['first_error']:.0%}, median of the "
              f"first {WINDOW} {r['median_first_20']:.0%}, after 200: median {r['median_after_200']:.1%} "
              f"p90 {r['p90_after_200']:.1%}; first under at iteration {r['first_crossing']}, "
              f"stays under from {r['crossing']}")
    print(f"-> {out}/report.json" + (f", {out}/selfcorrect.png" if sc else ""))


if __name__ == "__main__":
    main()
