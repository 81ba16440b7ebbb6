"""testbed/analysis/decision_compare.py on two hand-made decision.csv files:
the cells both have, winners that agree, one that differs by a steadiness
flag, the capacity ratios and the probe counts."""
from __future__ import annotations

import csv

from testbed.analysis.decision_compare import compare, main, read

COLUMNS = ("model", "hardware", "link", "link_gbps", "num_gpus", "slo", "tbt_slo_ms", "context_len", "deployment",
           "family", "capacity_per_gpu", "bound", "limited_by", "steady", "probes", "first_failing_per_gpu")


def row(L: int, deployment: str, family: str, cap, probes: int, steady: bool = True, limited_by: str = "ttft",
        fail=None) -> dict:
    return {"model": "m", "hardware": "h", "link": "l", "link_gbps": 100.0, "num_gpus": 4, "slo": "p99_tbt",
            "tbt_slo_ms": 100, "context_len": L, "deployment": deployment, "family": family,
            "capacity_per_gpu": "" if cap is None else cap, "bound": "bracketed" if cap else "none",
            "limited_by": limited_by, "steady": steady, "probes": probes,
            "first_failing_per_gpu": fail if fail is not None else (cap * 1.1 if cap else "")}


def write(path, rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


SAVED = [row(1024, "sarathi", "colocated", 10.0, 6), row(1024, "disagg-3P1D", "disaggregated", 8.0, 5),
         row(1024, "disagg-1P3D", "disaggregated", 4.0, 5),
         row(4096, "sarathi", "colocated", 3.0, 6), row(4096, "disagg-3P1D", "disaggregated", 2.5, 5),
         row(4096, "disagg-1P3D", "disaggregated", 1.0, 5),
         row(8192, "sarathi", "colocated", 1.0, 6)]                   # a cell only the saved file has
NEW = [row(1024, "sarathi", "colocated", 10.5, 2), row(1024, "disagg-3P1D", "disaggregated", 8.0, 2),
       row(1024, "disagg-1P3D", "disaggregated", None, 1, steady=False, limited_by="dominated", fail=8.0),
       row(4096, "sarathi", "colocated", 3.1, 2, steady=False), row(4096, "disagg-3P1D", "disaggregated", 2.5, 2),
       row(4096, "disagg-1P3D", "disaggregated", None, 1, steady=False, limited_by="dominated", fail=2.5)]


def test_the_comparison_counts_cells_winners_ratios_and_probes(tmp_path, capsys):
    write(tmp_path / "new.csv", NEW)
    write(tmp_path / "saved.csv", SAVED)
    r = compare(read(tmp_path / "new.csv"), read(tmp_path / "saved.csv"), 0.1)
    assert r["cells"] == 2 and r["dominated"] == 2
    # at 4K the new sarathi's capacity is flagged unsteady: 3P1D wins there, and the family flips
    ((cell, new, saved, why),) = r["winner_differs"]
    assert (cell[-1], new, saved, why) == ("4096", ["disagg-3P1D"], ["sarathi"], "unsteady")
    assert [c[-1] for c, *_ in r["family_differs"]] == ["4096"]
    assert sorted(round(x, 6) for x in r["ratios"]) == [1.0, 1.0, 1.05]    # the unsteady and dominated: none
    assert (r["probes_new"], r["probes_saved"]) == (10, 32)
    assert main([str(tmp_path / "new.csv"), str(tmp_path / "saved.csv")]) == 0
    out = capsys.readouterr().out
    assert "probes: new 10 saved 32 (3.20x fewer)" in out and "rows dominated (not searched): 2" in out


def test_a_missing_file_is_named(tmp_path, capsys):
    assert main([str(tmp_path / "nope.csv"), str(tmp_path / "nope.csv")]) == 2
    assert "nope.csv: no such decision.csv" in capsys.readouterr().err
