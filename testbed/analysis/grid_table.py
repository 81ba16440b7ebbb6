"""The L* table of a decision sweep: every point's `decision_summary.json`
under SWEEP_DIR (a `testbed run -m experiment=decision...` sweep, one point per
model and hardware) read into one markdown table, a row per model, hardware,
GPU count and SLO, with L* and the lengths where the best disaggregated
deployment serves more per GPU than the best colocated one, and the ties (the
lengths where the loser's search bracket reaches above the winner: within the
search's resolution, the summary's `ties`). Links that agree
share a cell, so a row says at once whether the link moves the answer.

    python -m testbed.analysis.grid_table SWEEP_DIR [--save DIR]
    python -m testbed.analysis.grid_table experiments/results/decision/full_grid

A last column names the lengths whose winner changes when the rows the study
did not count (their deciding probes too short to be steady) are counted: an
answer there rests on probes too short, not on the deployments.

--save copies each point's summary and its gzipped decision.csv and
decision_probes.csv to DIR/<model>_<hardware>_decision{_summary.json,.csv.gz,
_probes.csv.gz}; two points of one model and hardware are refused rather than
one overwriting the other. experiments/results/decision/full_grid/ keeps the
summaries (gzipped) and rows of the full grid, which this tool reads as they are.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

from testbed.experiments.decision_figures import fmt_tokens
from testbed.experiments.decision_summary import best_by_family
from testbed.experiments.study_files import gzip_copy, read_csv, siblings


def disagg_wins(crossover: dict) -> list[int]:
    """The lengths where the best disaggregated capacity exceeds the best
    colocated one (a family with no steady capacity at a length counts 0)."""
    col, dis = crossover["best_colocated_capacity"], crossover["best_disaggregated_capacity"]
    return sorted(int(L) for L, c in dis.items() if c > col.get(L, 0.0))


def unsteady_decided(csv_rows: list[dict]) -> dict[tuple, list[int]]:
    """Per (model, hardware, link, N, slo, TBT target): the lengths whose
    winning family changes when the capacities of unsteady rows (their
    deciding probes too short to say, not counted by the study) are counted:
    there the answer rests on probes too short, not on the deployments."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in csv_rows:
        if (r.get("source") or "sim") == "sim":
            groups[(r["model"], r["hardware"], r["link"], int(r["num_gpus"]), r["slo"],
                    float(r["tbt_slo_ms"]))].append(r)
    out: dict[tuple, list[int]] = {}
    for cell, rs in groups.items():
        study, every = _disagg_ahead(rs), _disagg_ahead([dict(r, steady=True) for r in rs])
        flipped = sorted(L for L in every if study.get(L, False) != every[L])
        if flipped:
            out[cell] = flipped
    return out


def _disagg_ahead(rows: list[dict]) -> dict[int, bool]:
    """Per length: whether the best steady disaggregated capacity exceeds the best colocated one."""
    col, dis = best_by_family(rows, "colocated"), best_by_family(rows, "disaggregated")
    return {L: dis.get(L, ("", 0.0))[1] > col.get(L, ("", 0.0))[1] for L in col.keys() | dis.keys()}


def _runs(lengths: list[int]) -> str:
    """[32K, 64K, 128K, 512K] as '32K-128K, 512K' (doubling lengths)."""
    if not lengths:
        return "none"
    spans, start, prev = [], lengths[0], lengths[0]
    for L in lengths[1:]:
        if L != 2 * prev:
            spans.append((start, prev))
            start = L
        prev = L
    spans.append((start, prev))
    return ", ".join(fmt_tokens(a) if a == b else f"{fmt_tokens(a)}-{fmt_tokens(b)}" for a, b in spans)


def _cell(by_value: dict[str, list[str]]) -> str:
    """One value, or each value with the links that gave it."""
    if len(by_value) == 1:
        return next(iter(by_value))
    return "; ".join(f"{value} ({', '.join(links)})" for value, links in by_value.items())


def rows(summaries: list[dict], flips: dict[tuple, list[int]] | None = None) -> list[tuple]:
    """(model, hardware, N, slo, L* by link, wins by link, ties by link[, lengths decided
    by unsteady rows by link]), a row per point and SLO; the last column with `flips`
    (unsteady_decided of the points' decision.csv rows)."""
    l_stars: dict[tuple, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    wins: dict[tuple, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    ties: dict[tuple, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    shaky: dict[tuple, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for summary in summaries:
        for c in summary["crossovers"]:
            key = (c["model"], c["hardware"], c["num_gpus"], f"{c['slo']}@{c['tbt_slo_ms']}ms")
            l_stars[key]["none" if c["l_star"] is None else fmt_tokens(c["l_star"])].append(c["link"])
            wins[key][_runs(disagg_wins(c))].append(c["link"])
            ties[key][_runs(sorted(c.get("ties", [])))].append(c["link"])
            if flips is not None:
                cell = (c["model"], c["hardware"], c["link"], c["num_gpus"], c["slo"], float(c["tbt_slo_ms"]))
                shaky[key][_runs(flips.get(cell, []))].append(c["link"])
    return [(*key, _cell(l_stars[key]), _cell(wins[key]), _cell(ties[key]),
             *((_cell(shaky[key]),) if flips is not None else ())) for key in sorted(l_stars)]


def markdown(table: list[tuple]) -> str:
    head = ["model", "hardware", "N", "smoothness", "L*", "disaggregated wins at", "ties at"]
    head += ["winner rests on unsteady rows at"] if table and len(table[0]) > len(head) else []
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    lines += [f"| {' | '.join(str(x) for x in row)} |" for row in table]
    return "\n".join(lines)


def _point(summary: dict) -> str:
    """The point's file stem: its models and hardware (a point may hold several)."""
    models = sorted({c["model"] for c in summary["crossovers"]})
    hardware = sorted({c["hardware"] for c in summary["crossovers"]})
    return f"{'+'.join(models)}_{'+'.join(hardware)}"


def csv_beside(summary_path: Path) -> Path | None:
    """A point's rows: decision.csv beside decision_summary.json (a study's
    directory), or X_decision.csv[.gz] beside X_decision_summary.json[.gz] (--save's)."""
    stem = summary_path.name.removesuffix(".gz")[:-len("_summary.json")]
    for name in (f"{stem}.csv", f"{stem}.csv.gz"):
        if (summary_path.parent / name).is_file():
            return summary_path.parent / name
    return None


def summary_paths(root: Path) -> list[Path]:
    """A --save directory's points side by side (gzipped or not), else a sweep's, each in a directory of its own."""
    side = sorted([*root.glob("*decision_summary.json"), *root.glob("*decision_summary.json.gz")])
    return side or sorted(root.rglob("*decision_summary.json"))


def read_summary(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


def save(paths: list[Path], summaries: list[dict], dest: Path) -> None:
    stems = [_point(s) for s in summaries]
    for stem in set(stems):
        same = [str(p) for p, s in zip(paths, stems) if s == stem]
        if len(same) > 1:
            raise SystemExit(f"--save: {len(same)} points hold {stem} ({', '.join(same)}); "
                             "pass one sweep whose points differ in model or hardware")
    dest.mkdir(parents=True, exist_ok=True)
    for path, stem in zip(paths, stems):
        shutil.copyfile(path, dest / f"{stem}_decision_summary.json{path.suffix if path.suffix == '.gz' else ''}")
        rows_path = csv_beside(path)
        if rows_path is None:
            raise SystemExit(f"--save: no decision.csv beside {path}")
        gzip_copy(rows_path, dest / f"{stem}_decision.csv.gz")
        _, probes = siblings(rows_path)
        if probes.is_file():                  # what restate_steady.py restates the rows from
            gzip_copy(probes, dest / f"{stem}_decision_probes.csv.gz")
    print(f"saved {len(paths)} points to {dest}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="a decision sweep's directory, or a directory --save wrote")
    parser.add_argument("--save", type=Path, help="copy each point's summary and gzipped decision.csv here")
    args = parser.parse_args()
    paths = summary_paths(args.sweep)
    if not paths:
        raise SystemExit(f"no decision_summary.json under {args.sweep}: is it a decision sweep's directory?")
    summaries = [read_summary(p) for p in paths]
    csvs = [csv_beside(p) for p in paths]
    flips = None
    if all(csvs):
        flips = {}
        for path in csvs:
            flips.update(unsteady_decided(read_csv(path)[1]))
    else:
        print(f"(no decision.csv beside {paths[csvs.index(None)]}: the unsteady column is left out)", file=sys.stderr)
    print(markdown(rows(summaries, flips)))
    if args.save:
        save(paths, summaries, args.save)


if __name__ == "__main__":
    main()
