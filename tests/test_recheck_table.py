"""testbed/analysis/recheck_table.py: re-run cells set beside the saved grid's
rows of the same cell, run as a user runs it (a subprocess on study directories)."""
import subprocess
import sys

from testbed.experiments.study_files import write_csv

TOOL = "testbed.analysis.recheck_table"
FIELDS = ["model", "hardware", "link", "num_gpus", "slo", "tbt_slo_ms", "context_len", "deployment", "family",
          "capacity_per_gpu", "steady", "source", "first_failing_per_gpu"]


def _row(L: int, deployment: str, family: str, cap: float, steady: bool = True, n: int = 4,
         link: str = "fast") -> dict:
    return dict(model="m", hardware="h", link=link, num_gpus=n, slo="p99_tbt", tbt_slo_ms=100.0, context_len=L,
                deployment=deployment, family=family, capacity_per_gpu=cap, steady=steady, source="sim",
                first_failing_per_gpu=cap * 1.1)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", TOOL, *args], capture_output=True, text=True)


def test_each_length_of_a_cell_gets_the_grids_winner_and_the_reruns(tmp_path):
    grid = tmp_path / "grid"
    grid.mkdir()
    write_csv(grid / "m_h_decision.csv.gz", FIELDS, [
        # 1K: colocation's best row was unsteady in the grid, so disaggregation won there
        _row(1024, "sarathi-512", "colocated", 10.0), _row(1024, "adaptive", "colocated", 30.0, steady=False),
        _row(1024, "disagg-3P1D", "disaggregated", 20.0),
        # 2K: disaggregation ahead; 4K: within one bracket (1.05 < 1.0 * 1.1), a tie
        _row(2048, "sarathi-512", "colocated", 5.0), _row(2048, "disagg-3P1D", "disaggregated", 6.0),
        _row(4096, "sarathi-512", "colocated", 1.0), _row(4096, "disagg-3P1D", "disaggregated", 1.05),
        # another cell of the same point (N = 8, another link) and a length the re-run has not: not compared
        _row(1024, "sarathi-512", "colocated", 99.0, n=8), _row(1024, "disagg-3P1D", "disaggregated", 0.1,
                                                                 link="slow"),
        _row(8192, "disagg-3P1D", "disaggregated", 0.5)])
    cell = tmp_path / "cell"
    cell.mkdir()
    write_csv(cell / "decision.csv", FIELDS, [
        _row(1024, "adaptive", "colocated", 28.0), _row(1024, "disagg-3P1D", "disaggregated", 19.0),
        _row(2048, "adaptive", "colocated", 7.0), _row(2048, "disagg-3P1D", "disaggregated", 6.0),
        _row(4096, "adaptive", "colocated", 0.9, steady=False), _row(4096, "disagg-3P1D", "disaggregated", 1.2)])
    done = _run(str(cell), "--grid", str(grid))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("| model | GPU | N | link | smoothness | L |")
    assert lines[2:] == [
        "| m | h | 4 | fast | p99_tbt@100ms | 1K | disaggregation (10 / 20) | colocation (28 / 19) |",
        "| m | h | 4 | fast | p99_tbt@100ms | 2K | disaggregation (5 / 6) | colocation (7 / 6) |",
        "| m | h | 4 | fast | p99_tbt@100ms | 4K | tie (1 / 1.05) | disaggregation (0 / 1.2) |"]


def test_a_directory_without_rows_or_a_point_without_grid_rows_is_refused(tmp_path):
    done = _run(str(tmp_path))
    assert done.returncode != 0 and "no decision.csv in" in done.stderr
    write_csv(tmp_path / "decision.csv", FIELDS, [_row(1024, "adaptive", "colocated", 1.0)])
    done = _run(str(tmp_path), "--grid", str(tmp_path / "nowhere"))
    assert done.returncode != 0 and "no grid rows for m on h" in done.stderr and "--grid" in done.stderr
