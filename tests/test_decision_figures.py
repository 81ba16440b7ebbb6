"""The decision study's figures on synthetic decision.csv rows: the winner
of each (L, link) cell, and what the two figures draw (asserted on the
artists, not on pixels)."""
from __future__ import annotations

import csv
import gzip
import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from testbed.experiments import decision_figures as F  # noqa: E402
from figure_capture import capture_figures  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LENGTHS = [1024, 2048, 4096, 8192, 16384]
LINKS = {"tcp-25": 25.0, "rdma-400": 400.0, "nvlink": 7200.0}
# the L at which disaggregation overtakes, per link: a faster link flips earlier
FLIP = {25.0: None, 400.0: 8192, 7200.0: 2048}


def row(n, link, deployment, family, cap, steady=True, source="sim") -> dict:
    return {"model": "llama3-8b", "hardware": "h100-sxm", "link": link, "link_gbps": LINKS[link], "num_gpus": 2,
            "slo": "p99_tbt", "tbt_slo_ms": 100, "ttft_slo_ms": 1000.0, "context_len": n, "deployment": deployment,
            "family": family, "capacity_per_gpu": cap, "first_failing_per_gpu": float(cap) * 1.1 if cap else "",
            "bound": "bracketed" if cap else "none",
            "limited_by": "tbt", "steady": steady, "probes": 6, "source": source}


def synthetic_rows() -> list[dict]:
    """Colocated capacity halves with L; disaggregated is 0.8x colocated below
    the link's flip and 1.5x from it on. An unsteady disagg row that would win
    (1000 req/s) sits at (1024, tcp-25) and must not count."""
    rows = []
    for link, gbps in LINKS.items():
        for n in LENGTHS:
            colo = 64.0 * 1024 / n
            flip = FLIP[gbps]
            disagg = colo * (1.5 if flip is not None and n >= flip else 0.8)
            rows += [row(n, link, "sarathi-512", "colocated", colo * 0.9),
                     row(n, link, "sarathi-2048", "colocated", colo),
                     row(n, link, "disagg-1P1D", "disaggregated", disagg)]
    rows.append(row(1024, "tcp-25", "kvstore-1P1D", "disaggregated", 1000.0, steady=False))
    rows.append(row(16384, "tcp-25", "hybrid", "hybrid", None))
    return rows


def test_winner_per_cell_is_the_highest_steady_capacity():
    best = F.winners(synthetic_rows())
    assert set(best) == {(n, g) for n in LENGTHS for g in LINKS.values()}
    for (n, gbps), r in best.items():
        flip = FLIP[gbps]
        expect = "disagg-1P1D" if flip is not None and n >= flip else "sarathi-2048"
        assert r["deployment"] == expect, (n, gbps)
        assert r["family"] == ("disaggregated" if expect.startswith("disagg") else "colocated")
    # the unsteady 1000 req/s row did not win its cell
    assert best[(1024, 25.0)]["deployment"] == "sarathi-2048"


def test_a_cell_with_no_steady_capacity_has_no_winner():
    rows = [row(1024, "tcp-25", "sarathi-512", "colocated", None),
            row(1024, "tcp-25", "disagg-1P1D", "disaggregated", 5.0, steady=False),
            row(2048, "tcp-25", "disagg-1P1D", "disaggregated", "", steady="false"),
            row(2048, "tcp-25", "sarathi-512", "colocated", "3.5", steady="True")]     # as csv.DictReader gives them
    best = F.winners(rows)
    assert set(best) == {(2048, 25.0)} and best[(2048, 25.0)]["deployment"] == "sarathi-512"


def test_token_tick_labels():
    assert [F.fmt_tokens(n) for n in (512, 1024, 1536, 32768, 1 << 20, 1 << 21)] == \
        ["512", "1K", "1.5K", "32K", "1M", "2M"]


def test_a_cell_label_puts_each_short_part_on_a_line_of_its_own():
    assert F.cell_label("disagg-6P1D-p_tp1-d_tp2") == "disagg\n6P1D\ntp 1/2"
    assert F.cell_label("kvstore-2P2D") == "kvstore\n2P2D"
    assert F.cell_label("sarathi-512") == "sarathi\n512"
    assert F.cell_label("adaptive") == "adaptive"


def test_phase_diagram_colors_each_cell_by_its_winner_and_draws_l_star(tmp_path, monkeypatch):
    figs = capture_figures(monkeypatch)
    path = F.plot_phase_diagram(synthetic_rows(), tmp_path / "phase.png",
                                "llama3-8b on h100-sxm, 2 GPUs, p99 TBT 100 ms", FLIP)
    assert path.read_bytes()[:8] == PNG_MAGIC
    ax = figs[0].axes[0]
    mesh = ax.collections[0]
    codes = mesh.get_array().reshape(len(LINKS), len(LENGTHS))
    links = sorted(LINKS.values())
    for i, gbps in enumerate(links):
        flip = FLIP[gbps]
        expect = [F.FAMILIES.index("disaggregated" if flip is not None and n >= flip else "colocated")
                  for n in LENGTHS]
        assert list(codes[i]) == expect, gbps
    # the boundary: nothing in the tcp-25 row (no L*), then the left edge of the L* cell in each other row
    (boundary,) = [line for line in ax.get_lines() if line.get_label().startswith("L*")]
    xs, ys = boundary.get_xdata(), boundary.get_ydata()
    assert math.isnan(xs[0]) and math.isnan(ys[0])
    edge = lambda n: n / math.sqrt(2)  # noqa: E731  (doubling grid: halfway in log2)
    assert list(xs[1:]) == pytest.approx([edge(8192)] * 2 + [edge(2048)] * 2)
    assert list(ys[1:]) == [0.5, 1.5, 1.5, 2.5]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1K", "2K", "4K", "8K", "16K"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["tcp-25 25 Gb/s", "rdma-400 400 Gb/s",
                                                            "nvlink 7200 Gb/s"]
    legend = ax.get_legend()
    assert {t.get_text() for t in legend.get_texts()} >= {"colocated wins", "disaggregated wins"}
    plt.close("all")


def test_phase_diagram_hatches_a_winner_inside_another_familys_bracket(tmp_path, monkeypatch):
    figs = capture_figures(monkeypatch)
    rows = synthetic_rows()
    assert not F.tied_cells(rows)                   # 0.8x and 1.5x: every bracket clear of the winner
    close = next(r for r in rows if (r["context_len"], r["link"], r["deployment"]) == (2048, "tcp-25", "disagg-1P1D"))
    colo = 64.0 * 1024 / 2048
    close.update(capacity_per_gpu=0.95 * colo, first_failing_per_gpu=1.045 * colo)    # reaches above colo
    assert F.tied_cells(rows) == {(2048, 25.0)}
    F.plot_phase_diagram(rows, tmp_path / "phase.png", "tie", FLIP)
    ax = figs[0].axes[0]
    (hatch,) = [p for p in ax.patches if p.get_hatch()]
    x0, y0 = hatch.get_xy()
    assert (x0, x0 + hatch.get_width()) == pytest.approx((2048 / math.sqrt(2), 2048 * math.sqrt(2)))
    assert (y0, hatch.get_height()) == (-0.5, 1.0)                                     # the tcp-25 row
    assert any(t.get_text().startswith("a tie") for t in ax.get_legend().get_texts())
    plt.close("all")


def test_capacity_vs_length_draws_one_line_per_deployment(tmp_path, monkeypatch):
    figs = capture_figures(monkeypatch)
    rows = [r for r in synthetic_rows() if r["link"] == "rdma-400"]
    rows += [row(n, "rdma-400", "sarathi-2048", "colocated", 30.0 * 1024 / n, source="real") for n in (1024, 2048)]
    rows.append(row(32768, "rdma-400", "disagg-1P1D", "disaggregated", 1.0, steady=False))
    title = "capacity per GPU against context length: llama3-8b on h100-sxm over rdma-400, 2 GPUs, p99 TBT 100 ms"
    path = F.plot_capacity_vs_length(rows, tmp_path / "cap.png", title)
    assert path.read_bytes()[:8] == PNG_MAGIC
    ax = figs[0].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"sarathi-512", "sarathi-2048", "disagg-1P1D", "sarathi-2048 (measured)"}
    assert list(lines["disagg-1P1D"].get_xdata()) == LENGTHS + [32768]
    assert list(lines["sarathi-2048 (measured)"].get_xdata()) == [1024, 2048]
    assert lines["sarathi-2048 (measured)"].get_linestyle() == "--"
    # the unsteady point is drawn hollow; measured points are squares
    hollow = [c for c in ax.collections if len(c.get_offsets()) and c.get_facecolors().size == 0]
    assert [list(c.get_offsets()[0]) for c in hollow] == [[32768, 1.0]]
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1K", "2K", "4K", "8K", "16K", "32K"]
    # the legend is outside the data, the long title wrapped to fit
    assert ax.get_legend().get_bbox_to_anchor().x0 > ax.bbox.x1 - 1
    assert "\n" in ax.get_title() and max(len(s) for s in ax.get_title().splitlines()) <= 70
    plt.close("all")


def test_capacity_vs_length_leaves_a_gap_where_nothing_passed(tmp_path, monkeypatch):
    figs = capture_figures(monkeypatch)
    rows = [row(n, "rdma-400", "disagg-1P1D", "disaggregated", cap) for n, cap in
            ((1024, 8.0), (2048, None), (4096, 2.0))]
    F.plot_capacity_vs_length(rows, tmp_path / "cap.png", "gap")
    (line,) = figs[0].axes[0].get_lines()
    y = list(line.get_ydata())
    assert y[0] == 8.0 and math.isnan(y[1]) and y[2] == 2.0
    plt.close("all")


def test_a_dominated_point_is_a_triangle_at_the_rate_it_failed_and_wins_nothing(tmp_path, monkeypatch):
    figs = capture_figures(monkeypatch)
    skipped = dict(row(2048, "rdma-400", "disagg-2P2D", "disaggregated", None), limited_by="dominated",
                   first_failing_per_gpu=3.5, steady=False)
    rows = [row(n, "rdma-400", "disagg-3P1D", "disaggregated", cap) for n, cap in ((1024, 8.0), (2048, 3.5))]
    rows += [row(1024, "rdma-400", "disagg-2P2D", "disaggregated", 5.0), skipped]
    F.plot_capacity_vs_length(rows, tmp_path / "cap.png", "dominated")
    ax = figs[0].axes[0]
    # at 2K: 3P1D's capacity (a full marker) and, small, the rate the skipped 2P2D failed at
    at_2k = [c for c in ax.collections if [2048, 3.5] in c.get_offsets().tolist()]
    assert sorted(c.get_sizes().tolist()[0] for c in at_2k) == [14, 28]
    labels = {t.get_text() for t in ax.get_legend().get_texts()}
    assert any(t.startswith("dominated") for t in labels) and not any(t.startswith("not steady") for t in labels)
    assert F.winners(rows)[(2048, 400.0)]["deployment"] == "disagg-3P1D"
    plt.close("all")


def test_all_figures_and_series_from_decision_rows_and_summary(tmp_path):
    rows = synthetic_rows() + [row(1024, "tcp-25", "sarathi-2048", "colocated", 2.0, source="real")]
    crossovers = [{"model": "llama3-8b", "hardware": "h100-sxm", "link": link, "link_gbps": gbps, "num_gpus": 2,
                   "slo": "p99_tbt", "tbt_slo_ms": 100, "l_star": FLIP[gbps]} for link, gbps in LINKS.items()]
    paths = F.decision_figures(rows, crossovers, tmp_path)
    assert [p.name for p in paths] == ["phase_llama3-8b_h100-sxm_2gpu_p99_tbt_100ms.png"] + [
        f"capacity_llama3-8b_h100-sxm_2gpu_p99_tbt_100ms_{link}.png" for link in LINKS]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)

    series = F.capacity_series(rows)
    assert [s["key"] for s in series] == [f"decision/capacity/llama3-8b/h100-sxm/{link}/2gpu/p99_tbt-100ms"
                                          for link in LINKS]
    tcp = series[0]
    assert tcp["xs"] == LENGTHS
    assert tcp["keys"] == ["sarathi-512", "sarathi-2048", "disagg-1P1D", "kvstore-1P1D", "hybrid"]
    assert tcp["ys"][1] == [64.0 * 1024 / n for n in LENGTHS]
    assert tcp["ys"][3] == [None] * 5                       # its one row is not steady: not counted
    assert tcp["ys"][4] == [None] * 5                       # nothing passed


def test_redraw_from_a_studys_files_adds_ties_and_refuses_another_studys_summary(tmp_path, capsys):
    from testbed.experiments.decision_redraw import main
    from testbed.experiments.decision_summary import crossovers
    rows = synthetic_rows()
    with open(tmp_path / "x_decision.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    summary = {"crossovers": [{k: v for k, v in c.items() if k != "ties"} for c in crossovers(rows)]}
    (tmp_path / "x_decision_summary.json").write_text(json.dumps(summary))
    assert main([str(tmp_path / "x_decision.csv"), "--out", str(tmp_path / "figs")]) == 0
    again = json.loads((tmp_path / "x_decision_summary.json").read_text())
    assert [c["ties"] for c in again["crossovers"]] == [[], [], []]
    assert {p.name for p in (tmp_path / "figs").glob("phase_*.png")} == {"phase_llama3-8b_h100-sxm_2gpu_p99_tbt_100ms.png"}
    again["crossovers"][1]["l_star"] = 1024                         # not what its rows give (8192)
    (tmp_path / "x_decision_summary.json").write_text(json.dumps(again))
    capsys.readouterr()
    assert main([str(tmp_path / "x_decision.csv"), "--out", str(tmp_path / "figs")]) == 2
    assert "L* = 1024" in capsys.readouterr().err
    plt.close("all")


def test_redraw_reads_a_gzipped_csv_beside_its_summary(tmp_path):
    from testbed.experiments.decision_redraw import main
    from testbed.experiments.decision_summary import crossovers
    rows = synthetic_rows()
    with gzip.open(tmp_path / "y_decision.csv.gz", "wt", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (tmp_path / "y_decision_summary.json").write_text(json.dumps({"crossovers": crossovers(rows)}))
    assert main([str(tmp_path / "y_decision.csv.gz"), "--out", str(tmp_path / "figs")]) == 0
    assert {p.name for p in (tmp_path / "figs").glob("phase_*.png")} == {"phase_llama3-8b_h100-sxm_2gpu_p99_tbt_100ms.png"}
    plt.close("all")
