"""Restate a decision study's rows under the current steadiness rule, from its
own probes: a row is steady when its capacity probe is (an older rule wanted
its first failing probe steady too, and past capacity that probe seldom is).

    python -m testbed.analysis.restate_steady ROWS --out DIR

ROWS is a study's decision.csv (its decision_summary.json and
decision_probes.csv beside it), or a saved X_decision.csv.gz (beside
X_decision_summary.json and X_decision_probes.csv.gz: python -m testbed.analysis.grid_table --save).
DIR gets the three files, under the same names, with each row's `steady`
taken from its capacity probe's row in the probes, and the summary's
crossovers, ties, definition changes and unsteady count recomputed from the
rows (`restated_steady` in the summary says so). The restatement is exact: the searches never read a row's
steadiness (they bisect on pass or fail, and the probes' own lengthening
reads each probe's window), so the code after the change, given the same
probes, writes these rows. A row whose capacity probe is not found is left
as it was and counted in `unmatched`.
"""
from __future__ import annotations

import argparse
import json
import shutil
from collections import defaultdict
from pathlib import Path

from testbed.experiments.decision_summary import crossovers, definition_changes
from testbed.experiments.study_files import read_csv, siblings, write_csv


def _probes(path: Path) -> dict[str, list[tuple[float, bool]]]:
    out: dict[str, list[tuple[float, bool]]] = defaultdict(list)
    for p in read_csv(path)[1]:
        out[p["key"]].append((float(p["rate"]), p["steady"] == "True"))
    return out


def capacity_probe_steady(row: dict, probes: dict[str, list[tuple[float, bool]]]) -> bool | None:
    """The steadiness of the probe at the row's capacity (its rate is the
    capacity per GPU times N: every deployment of the grid fills its N GPUs), None when none is
    found. The probe's key is the study's: model/hardware/N/deployment/link or
    -/L/TBT or -, with /no-slack for adaptive judged by p99 TBT."""
    cap, n = float(row["capacity_per_gpu"]), int(row["num_gpus"])
    head = f"{row['model']}/{row['hardware']}/{n}/{row['deployment']}"
    tbt = row["tbt_slo_ms"]
    tbt = str(int(float(tbt))) if float(tbt).is_integer() else tbt
    suffixes = ("/no-slack", "") if row["slo"] == "p99_tbt" else ("",)
    for link in (row["link"], "-"):
        for t in (tbt, "-"):
            for suffix in suffixes:
                for rate, steady in probes.get(f"{head}/{link}/{row['context_len']}/{t}{suffix}", []):
                    if abs(rate / cap - n) < 1e-6 * n:
                        return steady
    return None


def _typed(row: dict) -> dict:
    """A CSV row with the study's types where the summary keeps them."""
    tbt = float(row["tbt_slo_ms"])
    return dict(row, num_gpus=int(row["num_gpus"]), context_len=int(row["context_len"]),
                link_gbps=float(row["link_gbps"]), tbt_slo_ms=int(tbt) if tbt.is_integer() else tbt)


def restate(rows_path: Path, out: Path) -> dict:
    summary_path, probes_path = siblings(rows_path)
    columns, rows = read_csv(rows_path)
    probes = _probes(probes_path)
    counts = {"rows": len(rows), "now_steady": 0, "now_unsteady": 0, "unmatched": 0}
    for r in rows:
        if not r["capacity_per_gpu"] or (r.get("source") or "sim") != "sim":
            continue
        steady = capacity_probe_steady(r, probes)
        if steady is None:
            counts["unmatched"] += 1
            continue
        was = r["steady"] == "True"
        counts["now_steady"] += steady and not was
        counts["now_unsteady"] += was and not steady
        r["steady"] = str(steady)
    summary = json.loads(summary_path.read_text())
    sim = [_typed(r) for r in rows if (r.get("source") or "sim") == "sim"]
    changes = definition_changes(sim)
    summary.update(crossovers=crossovers(sim), definition_changes=changes,
                   winner_changes_with_definition=bool(changes),
                   unsteady_rows=sum(r["steady"] != "True" for r in sim),
                   restated_steady={"rule": "a row is steady when its capacity probe is", **counts})
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / rows_path.name, columns, rows)
    shutil.copyfile(probes_path, out / probes_path.name)
    (out / summary_path.name).write_text(json.dumps(summary, indent=2))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path, nargs="+", help="decision.csv or X_decision.csv.gz, its files beside it")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for rows_path in args.rows:
        missing = [p for p in (rows_path, *siblings(rows_path)) if not p.is_file()]
        if missing:
            raise SystemExit(f"no {missing[0]}: pass a study's decision.csv (or a saved X_decision.csv.gz) with "
                             f"its summary and probes beside it")
        if (args.out / rows_path.name).resolve() == rows_path.resolve():
            raise SystemExit("--out: give another directory than the study's (its files are the record)")
    for rows_path in args.rows:
        print(f"{rows_path.name}: {json.dumps(restate(rows_path, args.out))}")


if __name__ == "__main__":
    main()
