"""testbed/analysis/grid_table.py: a decision sweep's summaries read back into
one L* table, run as a user runs it (a subprocess on a sweep-shaped directory)."""
import csv
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

TOOL = "testbed.analysis.grid_table"
FIELDS = ("model", "hardware", "link", "num_gpus", "slo", "tbt_slo_ms", "context_len", "deployment", "family",
          "capacity_per_gpu", "steady", "source")


def _crossover(link: str, l_star, colocated: dict, disaggregated: dict, tbt_ms: int = 100) -> dict:
    return {"model": "m", "hardware": "h", "link": link, "num_gpus": 4, "slo": "p99_tbt", "tbt_slo_ms": tbt_ms,
            "l_star": l_star, "best_colocated_capacity": {str(k): v for k, v in colocated.items()},
            "best_disaggregated_capacity": {str(k): v for k, v in disaggregated.items()}}


def _rows(c: dict, unsteady: dict[int, float] | None = None) -> list[dict]:
    """The steady rows a crossover's bests come from, and unsteady colocated rows
    (capacity by length) that the study did not count."""
    base = {k: c[k] for k in ("model", "hardware", "link", "num_gpus", "slo", "tbt_slo_ms")}
    out = [dict(base, context_len=L, deployment=f"{fam[:4]}-x", family=fam, capacity_per_gpu=cap, steady=True,
                source="sim")
           for fam, caps in (("colocated", c["best_colocated_capacity"]),
                             ("disaggregated", c["best_disaggregated_capacity"])) for L, cap in caps.items()]
    out += [dict(base, context_len=L, deployment="adaptive", family="colocated", capacity_per_gpu=cap,
                 steady=False, source="sim") for L, cap in (unsteady or {}).items()]
    return out


def _point(root: Path, name: str, crossovers: list[dict], rows: list[dict]) -> None:
    point = root / name / "nested"
    point.mkdir(parents=True)
    (point / "decision_summary.json").write_text(json.dumps({"crossovers": crossovers}))
    with open(point / "decision.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def _table(*args: str) -> list[str]:
    return subprocess.run([sys.executable, "-m", TOOL, *args], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_the_table_groups_links_that_agree_and_names_those_that_differ(tmp_path):
    col = {1024: 4.0, 2048: 2.0, 4096: 1.0, 8192: 0.5}
    # fast link: disaggregated ahead at 1K, behind at 2K, ahead from 4K on (L* = 4K);
    # slow link: ahead only at 2K (no L*: colocation wins back at 4K); no steady colocated
    # capacity at 8K counts 0, so 8K is a win for the fast link.
    fast = _crossover("fast", 4096, {k: v for k, v in col.items() if k != 8192},
                      {1024: 5.0, 2048: 1.0, 4096: 2.0, 8192: 0.1})
    fast["ties"] = [2048]
    slow = _crossover("slow", None, col, {1024: 1.0, 2048: 3.0, 4096: 0.5, 8192: 0.1})
    same = [_crossover(link, None, col, {1024: 1.0}, tbt_ms=50) for link in ("fast", "slow")]
    other = [dict(c, hardware="g") for c in same]
    # on the fast link an unsteady colocated row (uncounted) would have won 1K and 8K
    rows_a = _rows(fast, unsteady={1024: 6.0, 8192: 0.2}) + [r for c in (slow, *same) for r in _rows(c)]
    sweep = tmp_path / "sweep"
    _point(sweep, "0-a", [fast, slow, *same], rows_a)
    _point(sweep, "1-b", other, [r for c in other for r in _rows(c)])
    saved = tmp_path / "saved"
    lines = _table(str(sweep), "--save", str(saved))
    assert lines[0] == ("| model | hardware | N | smoothness | L* | disaggregated wins at | ties at "
                        "| winner rests on unsteady rows at |")
    assert ("| m | h | 4 | p99_tbt@100ms | 4K (fast); none (slow) | 1K, 4K-8K (fast); 2K (slow) "
            "| 2K (fast); none (slow) | 1K, 8K (fast); none (slow) |") in lines
    assert "| m | h | 4 | p99_tbt@50ms | none | none | none | none |" in lines
    assert "| m | g | 4 | p99_tbt@50ms | none | none | none | none |" in lines
    assert sorted(p.name for p in saved.iterdir()) == [
        "m_g_decision.csv.gz", "m_g_decision_summary.json", "m_h_decision.csv.gz", "m_h_decision_summary.json"]
    first = (saved / "m_h_decision.csv.gz").read_bytes()
    assert first[4:8] == bytes(4) and first[3] & 0x08 == 0     # no time and no file name in the gzip header
    _table(str(sweep), "--save", str(saved))                # so saving again changes no byte
    assert (saved / "m_h_decision.csv.gz").read_bytes() == first
    with gzip.open(saved / "m_h_decision.csv.gz", "rt", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(rows_a)
    assert json.loads((saved / "m_g_decision_summary.json").read_text())["crossovers"] == other
    # the saved directory gives the same table (the committed full grid is read back this way),
    # its points read side by side, not those of a directory below it (full_grid/as_run)
    shutil.copytree(saved, saved / "as_run")
    assert _table(str(saved)) == [line for line in lines if not line.startswith("saved ")]
    # the committed grid keeps its summaries gzipped: read the same
    for summary in saved.glob("*_summary.json"):
        summary.with_name(summary.name + ".gz").write_bytes(gzip.compress(summary.read_bytes()))
        summary.unlink()
    assert _table(str(saved)) == [line for line in lines if not line.startswith("saved ")]


def test_save_refuses_two_points_of_one_model_and_hardware(tmp_path):
    crossover = _crossover("fast", None, {1024: 1.0}, {1024: 0.5})
    _point(tmp_path, "0-a", [crossover], _rows(crossover))
    _point(tmp_path, "1-a", [crossover], _rows(crossover))
    done = subprocess.run([sys.executable, "-m", TOOL, str(tmp_path), "--save", str(tmp_path / "saved")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "2 points hold m_h" in done.stderr
    assert not (tmp_path / "saved").exists()


def test_a_directory_without_summaries_is_refused_with_what_to_pass(tmp_path):
    done = subprocess.run([sys.executable, "-m", TOOL, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0
    assert "no decision_summary.json under" in done.stderr and "decision sweep" in done.stderr
