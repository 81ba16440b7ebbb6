"""`testbed report RUN_DIR...`: run directories -> a side-by-side table, a CSV
and a TBT-over-time plot per run.

The end of the data flow (DESIGN.md "Outputs"): each run directory holds
summary.json, requests.jsonl, iterations.jsonl (metrics.py) and Hydra's
.hydra/ folder. The table has one row per metric and one column per run; the
plot shows every inter-token gap at the time its token arrived, above the
iterations' prefill and decode tokens, which is where a prefill stall shows.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from testbed.metrics import IterationRecord, RequestRecord, read_iterations, read_requests

# (row label, path into summary.json)
ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("requests", ("num_requests",)),
    ("finished", ("num_finished",)),
    ("failed", ("num_failed",)),
    ("aborted", ("num_aborted",)),
    ("preemptions", ("num_preemptions",)),
    ("duration s", ("duration_s",)),
    ("TTFT mean ms", ("ttft_ms", "mean")),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("TTFT max ms", ("ttft_ms", "max")),
    ("TBT p50 ms", ("tbt_ms", "p50")),
    ("TBT p99 ms", ("tbt_ms", "p99")),
    ("TBT p99.9 ms", ("tbt_ms", "p999")),
    ("TBT max ms", ("tbt_ms", "max")),
    ("TPOT mean ms", ("tpot_ms", "mean")),
    ("TPOT p99 ms", ("tpot_ms", "p99")),
    ("E2E p50 ms", ("e2e_ms", "p50")),
    ("E2E p99 ms", ("e2e_ms", "p99")),
    ("queue p99 ms", ("queue_ms", "p99")),
    ("throughput req/s", ("throughput", "requests_per_s")),
    ("output tok/s", ("throughput", "output_tokens_per_s")),
    ("total tok/s", ("throughput", "total_tokens_per_s")),
    ("goodput req/s", ("goodput",)),
    ("SLO attainment", ("slo_attainment",)),
    ("fluidity index", ("fluidity_index",)),
    ("iterations", ("iterations", "num_iterations")),
    ("max tokens/iter", ("iterations", "max_tokens_per_iteration")),
    ("KV bytes read", ("iterations", "kv_bytes_read")),
]
TRANSFER_ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("KV transfers", ("kv_transfer", "num_transfers")),
    ("KV bytes sent", ("kv_transfer", "bytes")),
    ("transfer p50 ms", ("kv_transfer", "transfer_ms", "p50")),
    ("transfer p99 ms", ("kv_transfer", "transfer_ms", "p99")),
    ("exposed p99 ms", ("kv_transfer", "exposed_ms", "p99")),
    ("achieved GB/s", ("kv_transfer", "achieved_gb_per_s")),
]
_MAX_HEADER = 28


@dataclass
class Run:
    path: Path
    label: str
    summary: dict
    requests: list[RequestRecord] | None
    iterations: list[IterationRecord] | None


def _label(run_dir: Path) -> str:
    """The run's Hydra overrides ('scheduler=sarathi workload=stall'), else the
    names of its config groups, else the directory name."""
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if overrides.is_file():
        items = OmegaConf.to_container(OmegaConf.load(overrides)) or []
        items = [str(x) for x in items if not str(x).startswith("hydra.")]
        if items:
            return " ".join(items)
    config = run_dir / ".hydra" / "config.yaml"
    if config.is_file():
        cfg = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
        names = [f"{group}={cfg[group]['name']}" for group in ("mode", "scheduler", "workload", "model")
                 if isinstance(cfg.get(group), dict) and "name" in cfg[group]]
        if names:
            return " ".join(names)
    return run_dir.name


def load_run(run_dir: Path) -> Run:
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise ValueError(f"{run_dir}: no summary.json here; is this a run directory?")
    summary = json.loads(summary_path.read_text())
    requests = read_requests(run_dir / "requests.jsonl") if (run_dir / "requests.jsonl").is_file() else None
    iterations = read_iterations(run_dir / "iterations.jsonl") if (run_dir / "iterations.jsonl").is_file() else None
    return Run(run_dir, _label(run_dir), summary, requests, iterations)


def _lookup(summary: dict, keys: tuple[str, ...]):
    value = summary
    for k in keys:
        if not isinstance(value, dict) or k not in value:
            return None
        value = value[k]
    return value


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def table_rows(runs: list[Run]) -> list[tuple[str, list]]:
    rows = list(ROWS)
    if any("kv_transfer" in r.summary for r in runs):
        rows += TRANSFER_ROWS
    return [(label, [_lookup(r.summary, keys) for r in runs]) for label, keys in rows]


def _headers(runs: list[Run]) -> list[str]:
    """Column headers: each label without the words every run shares (so
    'scheduler=sarathi workload=stall' vs '... vllm_v0 ...' reads 'scheduler=sarathi'),
    or [i] when that is still too long for a column."""
    common = set.intersection(*(set(r.label.split()) for r in runs)) if len(runs) > 1 else set()
    headers = []
    for i, r in enumerate(runs, start=1):
        short = " ".join(w for w in r.label.split() if w not in common) or r.label
        headers.append(short if len(short) <= _MAX_HEADER else f"[{i}]")
    return headers


def format_table(runs: list[Run]) -> str:
    headers = _headers(runs)
    body = [[label] + [_fmt(v) for v in values] for label, values in table_rows(runs)]
    widths = [max(len(row[c]) for row in [["metric", *headers], *body]) for c in range(len(headers) + 1)]
    lines = [f"[{i}] {r.label}  ({r.path})" for i, r in enumerate(runs, start=1)]

    def line(cells: list[str]) -> str:
        return "  ".join([cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])])
    lines += [line(["metric", *headers]), line(["-" * w for w in widths])]
    lines += [line(row) for row in body]
    return "\n".join(lines)


def write_csv(path: Path, runs: list[Run]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["metric", *[r.label for r in runs]])
        w.writerow(["run_dir", *[str(r.path) for r in runs]])
        for label, values in table_rows(runs):
            w.writerow([label, *["" if v is None else v for v in values]])


def plot_tbt(run: Run, path: Path) -> None:
    """Every inter-token gap (ms) at its token's time, TTFTs marked; below, the
    tokens of each iteration split into prefill and decode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = [r for r in run.requests if r.token_times_s]
    iterations = run.iterations or []
    t0 = min([r.arrival_s for r in run.requests] + [it.start_s for it in iterations], default=0.0)
    fig, (ax_tbt, ax_it) = plt.subplots(2, 1, sharex=True, figsize=(10, 6), height_ratios=[3, 1])
    gap_t = [t - t0 for r in requests for t in r.token_times_s[1:]]
    # gaps of 0 (tokens delivered in one message) would vanish on a log axis
    gap_ms = [max(g * 1000, 1e-3) for r in requests for g in r.tbt_s]
    ax_tbt.scatter(gap_t, gap_ms, s=4, alpha=0.5, label="TBT (every inter-token gap)")
    ax_tbt.scatter([r.token_times_s[0] - t0 for r in requests], [r.ttft_s * 1000 for r in requests],
                   s=16, marker="x", color="tab:red", label="TTFT (at first token)")
    ax_tbt.set_ylabel("ms")
    ax_tbt.set_yscale("log")
    fig.suptitle(run.label)
    # legends sit above the axes: a stall's few points are often in a corner
    ax_tbt.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, fontsize="small", frameon=False)
    if iterations:
        starts = [it.start_s - t0 for it in iterations]
        decode = [it.num_decode_tokens for it in iterations]
        ax_it.bar(starts, decode, width=[it.duration_s for it in iterations], align="edge",
                  color="tab:green", edgecolor="black", linewidth=0.3, label="decode tokens")
        ax_it.bar(starts, [it.num_prefill_tokens for it in iterations], bottom=decode,
                  width=[it.duration_s for it in iterations], align="edge", color="tab:orange",
                  edgecolor="black", linewidth=0.3, label="prefill tokens")
        ax_it.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, fontsize="small", frameon=False)
    ax_it.set_ylabel("tokens/iter")
    ax_it.set_xlabel("time since first arrival (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_name(run: Run, index: int, shared_out: bool) -> str:
    if not shared_out:
        return "tbt.png"
    safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", run.label)[:80]
    return f"{index}_{safe}_tbt.png"


def report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="testbed report",
                                     description="Compare run directories side by side; write report.csv "
                                                 "and a TBT-over-time plot per run.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None,
                        help="write report.csv and the plots here instead of into each run directory")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(d) for d in args.run_dirs]
    except (OSError, ValueError) as e:
        print(f"testbed report: {e}", file=sys.stderr)
        return 2
    print(format_table(runs))

    out_dirs = [args.out] * len(runs) if args.out else [r.path for r in runs]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    for out in dict.fromkeys(out_dirs):
        write_csv(out / "report.csv", runs)
        print(f"wrote {out / 'report.csv'}")
    for i, (run, out) in enumerate(zip(runs, out_dirs), start=1):
        if run.requests is None:
            print(f"{run.path}: no requests.jsonl, so no TBT plot", file=sys.stderr)
            continue
        path = out / _plot_name(run, i, args.out is not None)
        plot_tbt(run, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(report_main(sys.argv[1:]))
