"""`testbed report DIR...`: run, sweep and experiment directories -> a
side-by-side table, a CSV, a TBT-over-time plot per run, and self-contained
HTML pages.

The end of the data flow (README.md, "Architecture"): each run directory holds
summary.json, requests.jsonl, iterations.jsonl (metrics.py) and Hydra's
.hydra/ folder. The table has one row per metric and one column per run; the
plot shows every inter-token gap at the time its token arrived, above the
iterations' prefill and decode tokens, which is where a prefill stall shows.

A sweep directory (`testbed run -m`: multirun/DATE/TIME) stands for its
numbered point directories; a point that failed (failed.json) is listed with
its error; a sweep over two or more workload.prompt_len values also gets
capacity_vs_length.png, goodput per GPU against L per deployment
(testbed/report_sweep.py). An experiment directory (experiment.json) gets its own HTML page:
its summary, figures and CSV tables, and the runs below it. The runs given
together get one page: the table, the failed points and their TBT plots.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from testbed.experiments import html as H
from testbed.metrics import IterationRecord, RequestRecord, read_iterations, read_requests
from testbed.report_tbt import plot_tbt

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


def _headers(runs: list[Run], max_len: int | None = _MAX_HEADER) -> list[str]:
    """Column headers: each label without the words every run shares (so
    'scheduler=sarathi workload=stall' vs '... vllm_v0 ...' reads 'scheduler=sarathi'),
    or [i] when that is still longer than max_len (None: no limit)."""
    common = set.intersection(*(set(r.label.split()) for r in runs)) if len(runs) > 1 else set()
    headers = []
    for i, r in enumerate(runs, start=1):
        short = " ".join(w for w in r.label.split() if w not in common) or r.label
        headers.append(short if max_len is None or len(short) <= max_len else f"[{i}]")
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


def _plot_name(run: Run, index: int, shared_out: bool) -> str:
    if not shared_out:
        return "tbt.png"
    safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", run.label)[:80]
    return f"{index}_{safe}_tbt.png"


@dataclass
class Inputs:
    """The directories named on the command line, sorted by kind."""
    runs: list[Path]
    failed: list[tuple[Path, str]]          # sweep points that failed, with their error
    experiments: list[Path]
    runs_home: Path | None = None           # the first run or sweep directory: where the runs' page goes
    sweeps: list[tuple[Path, list[Path]]] = field(default_factory=list)   # each sweep and its finished points


def _sweep_points(sweep_dir: Path) -> list[Path]:
    """A sweep's point directories in job order (Hydra names them NUM-overrides)."""
    points = [d for d in sweep_dir.iterdir() if d.is_dir() and ((d / "summary.json").is_file()
                                                               or (d / "failed.json").is_file())]
    return sorted(points, key=lambda d: (int(d.name.split("-", 1)[0]) if d.name.split("-", 1)[0].isdigit()
                                         else 1 << 30, d.name))


def classify(dirs: list[Path]) -> Inputs:
    inputs = Inputs([], [], [])
    for d in dirs:
        if (d / "experiment.json").is_file():
            inputs.experiments.append(d)
            continue
        inputs.runs_home = inputs.runs_home or d
        if (d / "summary.json").is_file():
            inputs.runs.append(d)
        elif d.is_dir() and _sweep_points(d):
            inputs.sweeps.append((d, []))
            for point in _sweep_points(d):
                if (point / "summary.json").is_file():
                    inputs.runs.append(point)
                    inputs.sweeps[-1][1].append(point)
                else:
                    error = json.loads((point / "failed.json").read_text()).get("error", "?")
                    inputs.failed.append((point, error))
        else:
            raise ValueError(f"{d}: no summary.json here; is this a run directory?")
    return inputs


def experiment_page(exp_dir: Path) -> str:
    """One experiment's page: summary, figures, tables, and its runs side by side."""
    summary = json.loads((exp_dir / "experiment.json").read_text())
    name = summary.get("experiment", exp_dir.name)
    sections = [H.note(f"directory: {exp_dir}")]
    overrides = exp_dir / ".hydra" / "overrides.yaml"
    if overrides.is_file():
        items = OmegaConf.to_container(OmegaConf.load(overrides)) or []
        sections.append(H.note("command: testbed run " + " ".join(str(x) for x in items)))
    sections.append(H.section("Summary", *H.summary_parts(summary)))
    figures = sorted(exp_dir.glob("*.png"))
    if figures:
        sections.append(H.section("Figures", *[H.image(p) for p in figures]))
    tables = [p for p in sorted(exp_dir.glob("*.csv")) if p.name != "report.csv"]
    if tables:
        sections.append(H.section("Tables", *[f"<h3>{p.name}</h3>" + H.csv_table(p) for p in tables]))
    # in the order they ran
    sub_runs = [load_run(d) for d in sorted((d for d in exp_dir.iterdir() if (d / "summary.json").is_file()),
                                            key=lambda d: (d / "summary.json").stat().st_mtime)]
    if sub_runs:
        sections.append(H.section("Runs", _runs_table(sub_runs)))
    return H.page(f"experiment: {name}", sections)


def _runs_table(runs: list[Run]) -> str:
    headers = _headers(runs, max_len=None)      # an HTML table wraps long headers
    return H.table(["metric", *headers], [[label, *values] for label, values in table_rows(runs)]) + \
        H.note("; ".join(f"[{i}] {r.label} ({r.path})" for i, r in enumerate(runs, start=1)))


def runs_page(runs: list[Run], failed: list[tuple[Path, str]], plots: list[Path]) -> str:
    sections = []
    if runs:
        sections.append(H.section("Runs side by side", _runs_table(runs)))
    if failed:
        sections.append(H.section("Failed points", H.table(["point", "error"], [[str(d), e] for d, e in failed])))
    if plots:
        sections.append(H.section("Figures: goodput per GPU against L (sweeps), TBT over time (runs)",
                                  *[H.image(p, str(p)) for p in plots]))
    return H.page("testbed report", sections)


def _write_pages(pages: list[tuple[str, str, Path]], out: Path | None) -> None:
    """pages: (slug, html, default dir). Without --out each page is report.html
    in its default directory; with --out they all go there, as report.html
    when there is one page, else report-SLUG.html."""
    for slug, text, default_dir in pages:
        if out is None:
            path = default_dir / "report.html"
        else:
            path = out / ("report.html" if len(pages) == 1 else f"report-{slug}.html")
        path.write_text(text)
        print(f"wrote {path}")


def _sweep_figures(sweeps: list[tuple[Path, list[Path]]], runs: dict[Path, Run], out: Path | None) -> list[Path]:
    """Each sweep over two or more workload.prompt_len values: goodput per GPU
    against L per deployment (testbed/report_sweep.py), capacity_vs_length.png."""
    from testbed.report_sweep import plot_sweep_capacity
    figures = []
    for i, (sweep, points) in enumerate(sweeps, start=1):
        name = "capacity_vs_length.png" if out is None or len(sweeps) == 1 else f"capacity_vs_length-{i}.png"
        path = plot_sweep_capacity([(p, runs[p].summary) for p in points], (out or sweep) / name)
        if path is not None:
            figures.append(path)
            print(f"wrote {path}")
    return figures


def report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="testbed report",
                                     description="Compare run directories side by side (sweep directories stand "
                                                 "for their points); write report.csv, a TBT-over-time plot per "
                                                 "run and report.html pages, one per experiment directory.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="DIR")
    parser.add_argument("--out", type=Path, default=None,
                        help="write report.csv, the plots and the pages here instead of into the directories")
    args = parser.parse_args(argv)
    try:
        inputs = classify(args.run_dirs)
        runs = [load_run(d) for d in inputs.runs]
    except (OSError, ValueError) as e:
        print(f"testbed report: {e}", file=sys.stderr)
        return 2
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    for point, error in inputs.failed:
        print(f"failed: {point}: {error}")
    pages: list[tuple[str, str, Path]] = []
    if runs:
        print(format_table(runs))
        out_dirs = [args.out] * len(runs) if args.out else [r.path for r in runs]
        for out in dict.fromkeys(out_dirs):
            write_csv(out / "report.csv", runs)
            print(f"wrote {out / 'report.csv'}")
        plots = []
        for i, (run, out) in enumerate(zip(runs, out_dirs), start=1):
            if run.requests is None:
                print(f"{run.path}: no requests.jsonl, so no TBT plot", file=sys.stderr)
                continue
            path = out / _plot_name(run, i, args.out is not None)
            plot_tbt(run, path)
            plots.append(path)
            print(f"wrote {path}")
        plots[:0] = _sweep_figures(inputs.sweeps, {r.path: r for r in runs}, args.out)
    if runs or inputs.failed:
        pages.append(("runs", runs_page(runs, inputs.failed, plots if runs else []), inputs.runs_home))
    for i, d in enumerate(inputs.experiments, start=1):
        pages.append((f"{i}-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", d.resolve().name), experiment_page(d), d))
    _write_pages(pages, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(report_main(sys.argv[1:]))
