"""Redraw a finished decision study's figures from its files, without a probe:

    python -m testbed.experiments.decision_redraw experiments/results/decision/llama3_decision.csv \
        --out experiments/figures

reads X.csv (or X.csv.gz) and X_summary.json beside it (a study's own directory holds
decision.csv and decision_summary.json), recomputes each crossover from the
rows, refuses a summary whose L* the rows do not give, writes the summary's
`ties` (decision_summary.ties) where the crossover lacks them, and draws the
phase diagrams and capacity figures into --out (the CSV's directory by
default)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from testbed.experiments.decision_figures import decision_figures
from testbed.experiments.decision_summary import crossovers
from testbed.experiments.study_files import read_csv, siblings


def _cell(c: dict) -> tuple:
    return (c["model"], c["hardware"], c["link"], int(c["num_gpus"]), c["slo"], float(c["tbt_slo_ms"]))


def redraw(csv_path: Path, out: Path) -> list[Path]:
    summary_path, _ = siblings(csv_path)
    _, rows = read_csv(csv_path)
    summary = json.loads(summary_path.read_text())
    fresh = {_cell(c): c for c in crossovers([r for r in rows if (r.get("source") or "sim") == "sim"])}
    for c in summary["crossovers"]:
        again = fresh.get(_cell(c))
        if again is None or again["l_star"] != c["l_star"]:
            raise ValueError(f"{summary_path}: the crossover {_cell(c)} says L* = {c['l_star']}, its rows in "
                             f"{csv_path} give {again and again['l_star']}: not the same study's files")
        c.setdefault("ties", again["ties"])
    summary_path.write_text(json.dumps(summary, indent=2))
    out.mkdir(parents=True, exist_ok=True)
    return decision_figures(rows, summary["crossovers"], out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.experiments.decision_redraw", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, help="a decision.csv or .csv.gz (its X_summary.json beside it)")
    parser.add_argument("--out", type=Path, default=None, help="where the figures go (default: the CSV's directory)")
    args = parser.parse_args(argv)
    try:
        paths = redraw(args.csv, args.out or args.csv.parent)
    except (OSError, ValueError, KeyError) as e:
        print(f"decision_redraw: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
