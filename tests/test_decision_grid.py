"""The decision study's grid cut into sweeps (testbed/experiments/decision_grid.py): which
deployments and SLO definitions share a sweep, and the progress bar over them, on the
constructed case of tests/decision_case.py."""
from __future__ import annotations

import dataclasses

from testbed.experiments.decision import run_decision

from decision_case import DATA, constructed, read_rows  # noqa: E402  (tests/ on sys.path: conftest)


def test_the_grid_progress_counts_probes_and_decided_cells_on_a_terminal(capsys, monkeypatch):
    """A cell is decided once every deployment has its row there; a sweep reported again (its
    worker died, run anew) replaces its counts instead of adding to them."""
    import sys

    from testbed.experiments.decision_grid import GridProgress, cells_of, sweeps
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    cfg = dataclasses.replace(constructed(links=[str(DATA / "decision_link.yaml"),
                                                 str(DATA / "decision_link_b.yaml")]), progress=True)
    grid = sweeps(cfg)
    assert [[d.label for d in s.deployments] for s in grid] == [["sarathi-1100"], ["disagg-1P1D"]]
    cells = cells_of(cfg, grid[0])
    assert len(cells) == 2 * 4 * 2                      # links x L x SLO definitions
    assert cells[0] == ("tiny", "fixed-10ms", "instant", 2, "p99_tbt", 50, 512)      # as decision.csv names them
    bar = GridProgress(cfg, grid)
    bar.update(0, 5, cells)                             # sarathi's rows everywhere: no cell decided yet
    bar.update(1, 3, cells[:4])
    bar.update(1, 2, cells[:2])                         # sweep 1 again, from its start
    bar.bar.refresh()
    line = capsys.readouterr().err.split("\r")[-1]
    assert "18/32" in line and "7 probes, 2/16 cells decided" in line and "<" in line    # the ETA
    bar.update(1, 9, cells)
    bar.bar.refresh()
    line = capsys.readouterr().err.split("\r")[-1]
    assert "32/32" in line and "14 probes, 16/16 cells decided" in line
    bar.close()


def test_adaptive_splits_into_one_sweep_per_definition_group_with_the_same_rows(tmp_path):
    """adaptive runs without its fluidity slack under p99_tbt, so the two definitions share no probe
    run: each is a sweep of its own (two cores take one half each), sarathi's definitions share
    their runs and stay one sweep. Every cell still gets each deployment's row exactly once, with
    the same capacities a one-definition study finds."""
    from testbed.experiments.decision_grid import cells_of, runs_per_rate, sweeps
    cfg = constructed(colocated=["sarathi", "adaptive"], context_lens=[512, 1024])
    grid = sweeps(cfg)
    assert [([d.label for d in s.deployments], s.smoothness) for s in grid] == [
        (["sarathi-1100"], ()), (["adaptive"], ("p99_tbt",)), (["adaptive"], ("fluidity",)),
        (["disagg-1P1D"], ())]
    assert {c[4] for c in cells_of(cfg, grid[1])} == {"p99_tbt"}
    # one run per rate each (disagg's on its one link), adaptive's planned by the predictor: Ray
    # starts both halves first
    assert [runs_per_rate(cfg, s) for s in grid] == [(0, 1), (1, 1), (1, 1), (0, 1)]
    one = sweeps(dataclasses.replace(cfg, experiment=dataclasses.replace(cfg.experiment, sweep_by="cell")))
    assert [runs_per_rate(cfg, s) for s in one] == [(2, 4)]      # adaptive's two runs, sarathi's, disagg's
    two_links = dataclasses.replace(cfg.experiment, links=[str(DATA / "decision_link.yaml"),
                                                           str(DATA / "decision_link_b.yaml")])
    assert runs_per_rate(dataclasses.replace(cfg, experiment=two_links), grid[3]) == (0, 2)    # one per link
    for d in ("both", "p99_tbt", "fluidity"):
        (tmp_path / d).mkdir()
    run_decision(cfg, tmp_path / "both", lambda *_: None)
    rows = read_rows(tmp_path / "both" / "decision.csv")
    cells = [(r["deployment"], r["slo"], r["context_len"]) for r in rows]
    assert len(cells) == len(set(cells)) == 3 * 2 * 2        # deployments x definitions x L
    for slo in ("p99_tbt", "fluidity"):
        run_decision(constructed(colocated=["sarathi", "adaptive"], context_lens=[512, 1024], smoothness=[slo]),
                     tmp_path / slo, lambda *_: None)
        alone = {(r["deployment"], r["context_len"]): r["capacity_per_gpu"]
                 for r in read_rows(tmp_path / slo / "decision.csv") if r["deployment"] == "adaptive"}
        assert alone == {(r["deployment"], r["context_len"]): r["capacity_per_gpu"] for r in rows
                         if r["deployment"] == "adaptive" and r["slo"] == slo}
