"""The rechecked cells against the grid: for each re-run cell (a study's
directory holding decision.csv, as `experiments/recheck_short_lengths.sh`
writes them), the winner at each of its lengths as the grid's restated rows
give it and as the re-run gives it, with the best colocated and the best
disaggregated capacity per GPU (steady rows only) behind each, one markdown
row per cell and length.

    python -m testbed.analysis.recheck_table CELL_DIR ... [--grid DIR]

--grid is the saved grid (default, from the repository root,
experiments/results/decision/full_grid: X_decision.csv.gz per model and hardware). The grid's side counts every
disaggregated deployment it searched; the re-run only those the script
lists. "tie" is the study's (`decision_summary.ties`: the loser's search
bracket reaches above the winner's capacity).
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from testbed.experiments.decision_figures import fmt_tokens
from testbed.experiments.decision_summary import best_by_family, ties
from testbed.experiments.study_files import read_csv

GRID = Path("experiments/results/decision/full_grid")      # from the repository root


def _cell(row: dict) -> tuple:
    return (row["model"], row["hardware"], row["link"], int(row["num_gpus"]), row["slo"], float(row["tbt_slo_ms"]))


def verdicts(rows: list[dict]) -> dict[int, str]:
    """Per length: 'colocation', 'disaggregation' or 'tie', with the two best capacities per GPU."""
    col, dis = best_by_family(rows, "colocated"), best_by_family(rows, "disaggregated")
    tied = set(ties(rows))
    out = {}
    for L in sorted(col.keys() | dis.keys()):
        c, d = col.get(L, ("", 0.0))[1], dis.get(L, ("", 0.0))[1]
        name = "tie" if L in tied else "disaggregation" if d > c else "colocation"
        out[L] = f"{name} ({c:.3g} / {d:.3g})"
    return out


def table(cell_dirs: list[Path], grid: Path) -> list[tuple]:
    grid_rows: dict[tuple, list[dict]] = {}
    out = []
    for d in cell_dirs:
        rows = read_csv(d / "decision.csv")[1]
        by_cell: dict[tuple, list[dict]] = defaultdict(list)
        for r in rows:
            by_cell[_cell(r)].append(r)
        for cell, rs in sorted(by_cell.items()):
            model, hardware, link, n, slo, tbt = cell
            point = (model, hardware)
            if point not in grid_rows:
                path = grid / f"{model}_{hardware}_decision.csv.gz"
                if not path.is_file():
                    raise SystemExit(f"no grid rows for {model} on {hardware}: {path} is missing (--grid)")
                grid_rows[point] = read_csv(path)[1]
            lengths = {int(r["context_len"]) for r in rs}
            before = verdicts([r for r in grid_rows[point]
                               if _cell(r) == cell and int(r["context_len"]) in lengths])
            after = verdicts(rs)
            for L in sorted(lengths):
                out.append((model, hardware, n, link, f"{slo}@{tbt:g}ms", fmt_tokens(L),
                            before.get(L, "none steady"), after.get(L, "none steady")))
    return out


def markdown(rows: list[tuple]) -> str:
    head = ["model", "GPU", "N", "link", "smoothness", "L", "the grid (restated): col / dis",
            "per-GPU cap: col / dis"]
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    return "\n".join(lines + [f"| {' | '.join(str(x) for x in r)} |" for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cells", type=Path, nargs="+", help="re-run cells' directories (each with decision.csv)")
    parser.add_argument("--grid", type=Path, default=GRID, help="the saved grid's directory")
    args = parser.parse_args()
    missing = [str(d) for d in args.cells if not (d / "decision.csv").is_file()]
    if missing:
        raise SystemExit(f"no decision.csv in {', '.join(missing)}: pass the cells' study directories")
    print(markdown(table(args.cells, args.grid)))


if __name__ == "__main__":
    main()
