"""A decision.csv against a saved one (e.g. experiments/results/decision/
full_grid/*_decision.csv.gz) over the cells both have: per cell (model,
hardware, link, N, SLO, TBT target, L) whether the winning deployment, the
winning family and each family's best deployment agree, each deployment's
capacity per GPU new / saved, and the probes (decision.csv's `probes`
column) each spent; per study group (model, hardware, link, N, SLO, TBT) the
L* of both. A cell whose winner differs is listed, marked `tie` where one
winner lies within the other's search bracket and `unsteady` where the other
file's winner has a capacity here whose probe never reached steady state (the
summary does not count it): the rest are to be re-run longer or explained. Rows flagged `dominated` (decision_brackets.py)
have no capacity by design and are counted apart.

    python -m testbed.analysis.decision_compare NEW.csv SAVED.csv[.gz] [--rel-tol 0.1]
"""
from __future__ import annotations

import argparse
import csv
import gzip
import math
import sys
from collections import defaultdict
from pathlib import Path

from testbed.experiments.decision_summary import (DOMINATED, GROUP_KEYS, _capacity, best_by_family, crossovers,
                                                  within_bracket, winners)

CELL_KEYS = ("model", "hardware", "link", "num_gpus", "slo", "tbt_slo_ms", "context_len")
FAMILIES = ("colocated", "disaggregated")


def read(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        return list(csv.DictReader(f))


def by_cell(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        out[tuple(str(r[k]) for k in CELL_KEYS)].append(r)
    return out


def compare(new: list[dict], saved: list[dict], rel_tol: float) -> dict:
    """The figures `main` prints, over the cells both files have."""
    new_cells, saved_cells = by_cell(new), by_cell(saved)
    common = sorted(set(new_cells) & set(saved_cells), key=lambda c: (c[:6], int(c[6])))
    out = {"cells": len(common), "winner_differs": [], "family_differs": [], "family_best_differs": 0,
           "ratios": [], "beyond_tol": [], "dominated": 0, "probes_new": 0, "probes_saved": 0,
           "probes_by_n": defaultdict(lambda: [0, 0]), "cells_by_n": defaultdict(int)}
    for cell in common:
        n_rows, s_rows = new_cells[cell], saved_cells[cell]
        n_probes, s_probes = sum(int(r["probes"]) for r in n_rows), sum(int(r["probes"]) for r in s_rows)
        out["probes_new"] += n_probes
        out["probes_saved"] += s_probes
        out["probes_by_n"][cell[3]][0] += n_probes
        out["probes_by_n"][cell[3]][1] += s_probes
        out["cells_by_n"][cell[3]] += 1
        out["dominated"] += sum(r["limited_by"] == DOMINATED for r in n_rows)
        w_new, w_saved = winners(n_rows), winners(s_rows)
        if w_new != w_saved and not (w_new & w_saved):
            why = "tie" if _tied(n_rows, w_saved) or _tied(s_rows, w_new) else \
                "unsteady" if _unsteady(n_rows, w_saved) or _unsteady(s_rows, w_new) else ""
            out["winner_differs"].append((cell, sorted(w_new), sorted(w_saved), why))
        fam = lambda rows: {r["family"] for r in rows if r["deployment"] in winners(rows)}
        if fam(n_rows) != fam(s_rows) and not (fam(n_rows) & fam(s_rows)):
            out["family_differs"].append((cell, sorted(fam(n_rows)), sorted(fam(s_rows))))
        for family in FAMILIES:
            b_new, b_saved = best_by_family(n_rows, family), best_by_family(s_rows, family)
            if {k: v[0] for k, v in b_new.items()} != {k: v[0] for k, v in b_saved.items()}:
                out["family_best_differs"] += 1
        saved_by = {r["deployment"]: r for r in s_rows}
        for r in n_rows:
            s = saved_by.get(r["deployment"])
            a, b = _capacity(r), _capacity(s) if s else None
            if a and b:
                out["ratios"].append(a / b)
                if abs(math.log(a / b)) > math.log(1 + rel_tol) * (1 + 1e-9):
                    out["beyond_tol"].append((cell, r["deployment"], a, b))
    out["lstar_differs"] = _lstar_differs(new, saved, set(common))
    return out


def _tied(rows: list[dict], labels: set[str]) -> bool:
    """Whether the other file's winners reach this file's winner within their brackets."""
    best = [r for r in rows if r["deployment"] in winners(rows)]
    return bool(best) and within_bracket(best[0], [r for r in rows if r["deployment"] in labels])


def _unsteady(rows: list[dict], labels: set[str]) -> bool:
    """Whether the other file's winner has a capacity here that its probe's
    steadiness kept out of the count (steady=false): a flag, not a loss."""
    return any(r["deployment"] in labels and r["capacity_per_gpu"] not in (None, "")
               and str(r["steady"]).lower() != "true" for r in rows)


def _lstar_differs(new: list[dict], saved: list[dict], common: set[tuple]) -> list[tuple]:
    keep = lambda rows: [r for r in rows if tuple(str(r[k]) for k in CELL_KEYS) in common]
    lstar = lambda rows: {tuple(str(c[k]) for k in GROUP_KEYS if k != "link_gbps"): c["l_star"]
                          for c in crossovers(keep(rows))}
    a, b = lstar(new), lstar(saved)
    return sorted((k, a[k], b.get(k)) for k in a if a[k] != b.get(k))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("new", type=Path)
    p.add_argument("saved", type=Path)
    p.add_argument("--rel-tol", type=float, default=0.1, help="the searches' tolerance (experiment.rel_tol)")
    args = p.parse_args(argv)
    for path in (args.new, args.saved):
        if not path.is_file():
            print(f"error: {path}: no such decision.csv", file=sys.stderr)
            return 2
    r = compare(read(args.new), read(args.saved), args.rel_tol)
    ratios = sorted(r["ratios"])
    print(f"cells in both: {r['cells']}")
    why = [w for *_, w in r["winner_differs"]]
    print(f"winner differs: {len(why)} cells ({why.count('tie')} within the searches' brackets, "
          f"{why.count('unsteady')} where one file's winner is flagged unsteady in the other)")
    for cell, a, b, w in r["winner_differs"]:
        print(f"  {'/'.join(cell)}: new {a} saved {b}{f' ({w})' if w else ''}")
    print(f"winning family differs: {len(r['family_differs'])} cells")
    for cell, a, b in r["family_differs"]:
        print(f"  {'/'.join(cell)}: new {a} saved {b}")
    print(f"L* differs: {len(r['lstar_differs'])} groups")
    for key, a, b in r["lstar_differs"]:
        print(f"  {'/'.join(key)}: new {a} saved {b}")
    if ratios:
        print(f"capacity new/saved over {len(ratios)} rows: min {ratios[0]:.3f} median "
              f"{ratios[len(ratios) // 2]:.3f} max {ratios[-1]:.3f}; beyond rel_tol {args.rel_tol}: "
              f"{len(r['beyond_tol'])}")
    print(f"rows dominated (not searched): {r['dominated']}")
    print(f"probes: new {r['probes_new']} saved {r['probes_saved']} "
          f"({r['probes_saved'] / max(1, r['probes_new']):.2f}x fewer)")
    for n, (a, b) in sorted(r["probes_by_n"].items(), key=lambda kv: int(kv[0])):
        cells = r["cells_by_n"][n]
        print(f"  N={n}: {cells} cells, probes per cell new {a / cells:.1f} saved {b / cells:.1f} "
              f"({b / max(1, a):.2f}x fewer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
