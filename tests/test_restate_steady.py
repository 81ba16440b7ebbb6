"""testbed/analysis/restate_steady.py on the decision study's constructed
case (tests/decision_case.py), run as a user runs it."""
import csv
import json
import subprocess
import sys
from pathlib import Path

from testbed.experiments.decision import run_decision

from decision_case import constructed, read_rows  # noqa: E402  (tests/ on sys.path: conftest)


def test_restating_a_studys_rows_under_the_capacity_probe_rule_is_exact(tmp_path):
    """restate_steady re-derives each row's `steady` from its capacity probe:
    on a study of this code it changes nothing; on rows marked unsteady as the
    older rule did (for a failing probe too short) it gives back this code's
    rows and crossovers."""
    study = tmp_path / "study"
    study.mkdir()
    run_decision(constructed(), study, lambda *_: None)
    rows = read_rows(study / "decision.csv")

    def restated(src: Path) -> tuple[list[dict], dict, str]:
        out = tmp_path / f"re-{src.parent.name}"
        done = subprocess.run([sys.executable, "-m", "testbed.analysis.restate_steady", str(src), "--out", str(out)], capture_output=True,
                              text=True, check=True)
        return read_rows(out / "decision.csv"), json.loads((out / "decision_summary.json").read_text()), done.stdout

    again, summary, said = restated(study / "decision.csv")
    assert again == rows and '"now_steady": 0' in said and '"unmatched": 0' in said
    # the old rule's rows: some steady ones marked unsteady (as an unsteady failing probe did)
    old = tmp_path / "old"
    old.mkdir()
    for name in ("decision_probes.csv", "decision_summary.json"):
        (old / name).write_bytes((study / name).read_bytes())
    marked = [dict(r, steady="False") if r["capacity_per_gpu"] and i % 3 == 0 else r for i, r in enumerate(rows)]
    assert sum(r["steady"] == "False" for r in marked) > sum(r["steady"] == "False" for r in rows)
    with open(old / "decision.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(marked)
    back, summary, said = restated(old / "decision.csv")
    assert back == rows and '"unmatched": 0' in said
    assert summary["crossovers"] == json.loads((study / "decision_summary.json").read_text())["crossovers"]
