"""Why adaptive's TTFT on chat below capacity is where it is against
sarathi-512, in the simulator (bench_adaptive_capacity's set-up): TTFT p50
and mean of sarathi-512, adaptive without the TTFT rollout
(`adaptive.ttft_rollout=false`: always the largest budget the deadlines
allow), adaptive without deferring the decodes for fresh prompts
(`adaptive.prefill_first=false`, the policy without prefill_first), adaptive, and
adaptive with the rollout pricing the prompts that arrive meanwhile
(`adaptive.rollout_arrivals=true`), over workload seeds;
each one's TTFT quantiles against sarathi-512's, paired by seed (mean and
standard error over the seeds); and, per iteration, the batches over
512 tokens (a GEMM tile step on h100-sxm's tables that sarathi-512's budget,
decodes included, never crosses) and the TTFT of the requests that waited
through one against the same requests under sarathi-512.

    python experiments/benchmarks/bench_adaptive_chat_ttft.py [--rate 177] [--slo-tbt-ms 50] [--seeds 5] [--first-seed 0]
        [--fixed 256,384,640,1024]

~2 min here (--seeds 20: ~6 min). Figures and their reading: experiments/README.md, "adaptive"."""
from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import io
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_adaptive_capacity import run_config  # noqa: E402

POLICIES = [("sarathi-512", 512), ("adaptive-largest", "largest"), ("adaptive-nopf", "no_prefill_first"),
            ("adaptive", None), ("adaptive-arrivals", "arrivals")]
QUANTILES = (10, 25, 50, 75, 90, 99)
TILE = 512


def run(label: str, budget, rate: float, tbt_ms: float, seed: int, out: Path):
    from testbed.metrics import read_iterations, read_requests
    from testbed.run import execute
    cfg = dataclasses.replace(run_config("chat", tbt_ms, budget, rate), seed=seed)
    d = out / f"{label}-s{seed}"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        execute(cfg, d)
    return {r.request_id: r for r in read_requests(d / "requests.jsonl")}, read_iterations(d / "iterations.jsonl")


def over_tile(reqs: dict, its: list) -> tuple[int, set[str]]:
    """The iterations over TILE tokens, and the requests that waited through one (arrival to first token)."""
    ends = [it.start_s + it.duration_s for it in its]
    big = {k for k, it in enumerate(its) if it.num_prefill_tokens + it.num_decode_tokens > TILE}
    hit = {rid for rid, r in reqs.items()
           if any(k in big for k in range(bisect.bisect_right(ends, r.arrival_s),
                                          bisect.bisect_left(ends, r.arrival_s + r.ttft_s - 1e-12) + 1))}
    return len(big), hit


def prompt_only(its: list) -> int:
    """Iterations with prompt tokens and no decode token: under sarathi only where nothing decodes (the
    run's start), under adaptive also prefill_first's, which deferred the decodes."""
    return sum(1 for it in its if it.num_prefill_tokens and not it.num_decode_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=177.0)
    parser.add_argument("--slo-tbt-ms", type=float, default=50.0)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0, help="the workload seeds are first-seed, first-seed + 1, ...")
    parser.add_argument("--fixed", default="", help="more sarathi budgets to compare, e.g. 256,384,640,1024")
    parser.add_argument("--out", default="outputs/bench_adaptive_chat_ttft")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    out = Path(args.out)
    policies = POLICIES + [(f"sarathi-{b}", int(b)) for b in args.fixed.split(",") if b]
    ttft = {label: [] for label, _ in policies}
    quantiles = {label: [] for label, _ in policies}      # per seed: TTFT at QUANTILES, then the mean
    print(f"chat at {args.rate:g} req/s, p99 TBT SLO {args.slo_tbt_ms:g} ms (llama3-8b on h100-sxm, simulator)")
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        runs = {label: run(label, b, args.rate, args.slo_tbt_ms, seed, out) for label, b in policies}
        base = runs["sarathi-512"][0]
        for label, (reqs, its) in runs.items():
            t = np.array([r.ttft_s for r in reqs.values()]) * 1e3
            gaps = np.concatenate([np.diff(r.token_times_s) for r in reqs.values()]) * 1e3
            ttft[label].append((np.median(t), t.mean(), np.percentile(gaps, 99), prompt_only(its)))
            quantiles[label].append(np.r_[np.percentile(t, QUANTILES), t.mean()])
            n_big, hit = over_tile(reqs, its)
            delta = [1e3 * (reqs[k].ttft_s - base[k].ttft_s) for k in hit]
            rest = [1e3 * (reqs[k].ttft_s - base[k].ttft_s) for k in reqs if k not in hit]
            print(f"  seed {seed} {label:<17} TTFT p50 {np.median(t):6.2f} mean {t.mean():6.2f} ms, "
                  f"p99 TBT {ttft[label][-1][2]:5.1f} ms, {ttft[label][-1][3]:3d} prompt-only iterations; "
                  f"{n_big:3d} iterations over {TILE} tokens, {len(hit):3d} requests waited through one"
                  + (f" ({np.mean(delta):+.2f} ms against sarathi-512; the other {len(rest)}: "
                     f"{np.mean(rest):+.2f} ms)" if hit and label != "sarathi-512" else ""))
    print(f"over {args.seeds} seeds:")
    for label, v in ttft.items():
        v = np.array(v)
        wins = "" if label == "sarathi-512" else \
            f"; p50 below sarathi-512's on {(v[:, 0] < np.array(ttft['sarathi-512'])[:, 0]).sum()} of {len(v)}"
        print(f"  {label:<17} TTFT p50 mean {v[:, 0].mean():.2f} ms, TTFT mean {v[:, 1].mean():.2f} ms, "
              f"p99 TBT at most {v[:, 2].max():.1f} ms, prompt-only iterations {v[:, 3].mean():.0f} a run{wins}")
    if args.seeds > 1:
        print("TTFT against sarathi-512, paired by seed (ms; mean +- standard error over the seeds):")
        base = np.array(quantiles["sarathi-512"])
        names = [f"p{q}" for q in QUANTILES] + ["mean"]
        for label in (label for label, _ in policies if label != "sarathi-512"):
            d = np.array(quantiles[label]) - base
            se = d.std(axis=0, ddof=1) / np.sqrt(len(d))
            print(f"  {label:<17} " + "  ".join(f"{n} {m:+.2f}+-{e:.2f}" for n, m, e in zip(names, d.mean(axis=0), se)))


if __name__ == "__main__":
    main()
