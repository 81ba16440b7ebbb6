"""experiments/tools/grid_table.py: a decision sweep's summaries read back into
one L* table, run as a user runs it (a subprocess on a sweep-shaped directory)."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "experiments" / "tools" / "grid_table.py"


def _crossover(link: str, l_star, colocated: dict, disaggregated: dict, tbt_ms: int = 100) -> dict:
    return {"model": "m", "hardware": "h", "link": link, "num_gpus": 4, "slo": "p99_tbt", "tbt_slo_ms": tbt_ms,
            "l_star": l_star, "best_colocated_capacity": {str(k): v for k, v in colocated.items()},
            "best_disaggregated_capacity": {str(k): v for k, v in disaggregated.items()}}


def _point(root: Path, name: str, crossovers: list[dict]) -> None:
    point = root / name / "nested"
    point.mkdir(parents=True)
    (point / "decision_summary.json").write_text(json.dumps({"crossovers": crossovers}))
    (point / "decision.csv").write_text(f"model,capacity\n{name},1.0\n")


def test_the_table_groups_links_that_agree_and_names_those_that_differ(tmp_path):
    col = {1024: 4.0, 2048: 2.0, 4096: 1.0, 8192: 0.5}
    # fast link: disaggregated ahead at 1K, behind at 2K, ahead from 4K on (L* = 4K);
    # slow link: ahead only at 2K (no L*: colocation wins back at 4K); no steady colocated
    # capacity at 8K counts 0, so 8K is a win for the fast link.
    fast = _crossover("fast", 4096, {k: v for k, v in col.items() if k != 8192},
                      {1024: 5.0, 2048: 1.0, 4096: 2.0, 8192: 0.1})
    fast["best_colocated_capacity"].pop("8192", None)
    fast["ties"] = [2048]
    slow = _crossover("slow", None, col, {1024: 1.0, 2048: 3.0, 4096: 0.5, 8192: 0.1})
    same = [_crossover(link, None, col, {1024: 1.0}, tbt_ms=50) for link in ("fast", "slow")]
    other = [dict(c, hardware="g") for c in same]
    _point(tmp_path, "0-a", [fast, slow, *same])
    _point(tmp_path, "1-b", other)
    saved = tmp_path / "saved"
    out = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "--save", str(saved)],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert "| m | h | 4 | p99_tbt@100ms | 4K (fast); none (slow) | 1K, 4K-8K (fast); 2K (slow) | 2K (fast); none (slow) |" in lines
    assert "| m | h | 4 | p99_tbt@50ms | none | none | none |" in lines
    assert "| m | g | 4 | p99_tbt@50ms | none | none | none |" in lines
    assert sorted(p.name for p in saved.iterdir()) == [
        "m_g_decision.csv.gz", "m_g_decision_summary.json", "m_h_decision.csv.gz", "m_h_decision_summary.json"]
    assert gzip.open(saved / "m_h_decision.csv.gz", "rt").read() == "model,capacity\n0-a,1.0\n"
    assert json.loads((saved / "m_g_decision_summary.json").read_text())["crossovers"] == other


def test_save_refuses_two_points_of_one_model_and_hardware(tmp_path):
    crossover = _crossover("fast", None, {1024: 1.0}, {1024: 0.5})
    _point(tmp_path, "0-a", [crossover])
    _point(tmp_path, "1-a", [crossover])
    done = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "--save", str(tmp_path / "saved")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "2 points hold m_h" in done.stderr
    assert not (tmp_path / "saved").exists()


def test_a_directory_without_summaries_is_refused_with_what_to_pass(tmp_path):
    done = subprocess.run([sys.executable, str(TOOL), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0
    assert "no decision_summary.json under" in done.stderr and "decision sweep" in done.stderr
