"""Where a run's late TBT gaps came from, read from its records (a run
directory, or a decision-real probe's real_probes/NNN): each gap between two
tokens of a request longer than the TBT target, matched with the iteration
that produced its second token (the last iteration, on the request's worker,
that ended before the token reached the frontend), and sorted into

- planned over: that iteration was predicted longer than the target (the
  policy chose it: a prefill chunk with nobody to protect, or a budget floor);
- overran: predicted within the target, measured beyond it (the predictor
  was wrong);
- between iterations: the iteration itself was within the target; the gap
  spans more than it (the request sat out an iteration, or time passed
  outside the steps: messages, the frontend).

    python -m testbed.analysis.late_gaps RUN_DIR --tbt-ms 100

A request's worker is the one whose iteration ends best match its token
times (records name no worker per request)."""
from __future__ import annotations

import argparse
import bisect
from collections import defaultdict
from pathlib import Path

import numpy as np

from testbed.metrics import read_iterations, read_requests


def _producer(ends: list[float], t: float) -> int:
    """The index of the last iteration end at or before t (-1: none)."""
    return bisect.bisect_right(ends, t) - 1


def late_gaps(run_dir: Path, tbt_s: float, judged: set[str] | None = None) -> dict:
    """The late gaps of `run_dir`'s requests (those in `judged`, when given) by cause, with the
    producing iterations' planned and measured durations."""
    iterations = read_iterations(run_dir / "iterations.jsonl")
    requests = [r for r in read_requests(run_dir / "requests.jsonl") if judged is None or r.request_id in judged]
    by_worker = defaultdict(list)
    for it in iterations:
        by_worker[it.worker].append(it)
    ends = {}
    for w, its in by_worker.items():
        its.sort(key=lambda it: it.start_s + it.duration_s)
        ends[w] = [it.start_s + it.duration_s for it in its]
    out = {"gaps": 0, "late": 0, "planned_over": [], "overran": [], "between": []}
    for r in requests:
        times = r.token_times_s
        if len(times) < 2:
            continue

        def lag(w):     # how far the token times trail the worker's iteration ends
            return sum(t - ends[w][k] if (k := _producer(ends[w], t)) >= 0 else 1e9 for t in times)
        worker = min(ends, key=lag)
        its, e = by_worker[worker], ends[worker]
        for a, b in zip(times, times[1:]):
            out["gaps"] += 1
            if b - a <= tbt_s:
                continue
            out["late"] += 1
            it = its[_producer(e, b)]
            row = {"request": r.request_id, "worker": worker, "gap_s": b - a, "duration_s": it.duration_s,
                   "predicted_s": it.predicted_s, "budget": it.token_budget,
                   "prefill_tokens": it.num_prefill_tokens, "decode_tokens": it.num_decode_tokens,
                   "iterations_in_gap": _producer(e, b) - _producer(e, a)}
            if it.duration_s <= tbt_s:
                out["between"].append(row)
            elif it.predicted_s is not None and it.predicted_s > tbt_s:
                out["planned_over"].append(row)
            else:
                out["overran"].append(row)
    ratios = [it.duration_s / it.predicted_s for it in iterations if it.predicted_s]
    out["measured_over_predicted"] = {q: float(np.percentile(ratios, p)) for q, p in
                                      (("p10", 10), ("p50", 50), ("p90", 90), ("p99", 99))} if ratios else {}
    out["iterations"] = len(iterations)
    out["iterations_over_target"] = sum(it.duration_s > tbt_s for it in iterations)
    return out


def late_gaps_report(run_dir: Path, tbt_s: float, judged: set[str] | None = None) -> str:
    g = late_gaps(run_dir, tbt_s, judged)
    lines = [f"late gaps (> {tbt_s * 1e3:g} ms): {g['late']} of {g['gaps']}"
             f"{' (judged requests)' if judged is not None else ''}; iterations over the target: "
             f"{g['iterations_over_target']} of {g['iterations']}; measured/predicted per iteration "
             + " ".join(f"{k} {v:.2f}" for k, v in g["measured_over_predicted"].items())]
    for cause in ("planned_over", "overran", "between"):
        rows = g[cause]
        lines.append(f"  {cause}: {len(rows)}")
        for row in sorted(rows, key=lambda x: -x["gap_s"])[:8]:
            predicted = "-" if row["predicted_s"] is None else f"{row['predicted_s'] * 1e3:.0f}"
            lines.append(f"    {row['request']} on {row['worker']}: gap {row['gap_s'] * 1e3:.0f} ms, its iteration "
                         f"{row['duration_s'] * 1e3:.0f} ms (predicted {predicted}), {row['prefill_tokens']} prefill "
                         f"+ {row['decode_tokens']} decode tokens, budget {row['budget']}, "
                         f"{row['iterations_in_gap']} iteration(s) in the gap")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--tbt-ms", type=float, default=100.0)
    args = p.parse_args()
    print(late_gaps_report(args.run_dir, args.tbt_ms / 1e3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
