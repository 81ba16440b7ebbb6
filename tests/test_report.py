"""`testbed report` on run directories built from hand-made records."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from testbed.metrics import IterationRecord, RequestRecord, write_jsonl
from testbed.run_stats import summarize
from testbed.report import report_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(run_dir: Path, stall_ms: float, overrides: list[str] | None = None,
             config_yaml: str | None = None, transfer: bool = False) -> dict:
    """Two requests decoding every 10 ms; the second token of r0 waits `stall_ms`."""
    run_dir.mkdir(parents=True)
    requests, iterations = [], []
    for k in range(2):
        times, t = [], 0.05 + k * 0.01
        for i in range(20):
            t += stall_ms / 1000 if (k == 0 and i == 1) else 0.01
            times.append(round(t, 6))
        extra = dict(kv_bytes_sent=1_000_000, transfer_start_s=0.04, transfer_end_s=0.05,
                     exposed_transfer_s=0.002) if transfer else {}
        requests.append(RequestRecord(f"r{k}", "finished", 100, list(range(20)), 0.0, 0.01,
                                      times[0], times, times[-1], 0, None, **extra))
    t = 0.0
    while t < 0.5:
        iterations.append(IterationRecord(round(t, 6), 0.01, 64 if t < 0.05 else 0, 2, 1000))
        t += 0.01
    write_jsonl(run_dir / "requests.jsonl", requests)
    write_jsonl(run_dir / "iterations.jsonl", iterations)
    summary = summarize(requests, iterations, slo_ttft_ms=100, slo_tpot_ms=20)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    if overrides is not None or config_yaml is not None:
        (run_dir / ".hydra").mkdir()
    if overrides is not None:
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if config_yaml is not None:
        (run_dir / ".hydra" / "config.yaml").write_text(config_yaml)
    return summary


def read_csv(path: Path) -> dict[str, list[str]]:
    with open(path) as f:
        return {row[0]: row[1:] for row in csv.reader(f)}


def test_report_table_csv_and_plots(tmp_path, capsys):
    smooth = make_run(tmp_path / "a", 10, overrides=["scheduler=sarathi", "workload=stall", "hydra.run.dir=x"])
    stalled = make_run(tmp_path / "b", 400, config_yaml="scheduler:\n  name: vllm_v0\nworkload:\n  name: stall\n")
    assert report_main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "scheduler=sarathi workload=stall" in out and "scheduler=vllm_v0 workload=stall" in out
    tbt_max = next(line for line in out.splitlines() if line.startswith("TBT max ms"))
    assert tbt_max.split()[-2:] == ["10.0", "400.0"]
    assert "KV transfers" not in out

    for run_dir in (tmp_path / "a", tmp_path / "b"):
        table = read_csv(run_dir / "report.csv")
        assert table["metric"] == ["scheduler=sarathi workload=stall", "scheduler=vllm_v0 workload=stall"]
        assert table["run_dir"] == [str(tmp_path / "a"), str(tmp_path / "b")]
        assert [float(v) for v in table["TBT max ms"]] == [smooth["tbt_ms"]["max"], stalled["tbt_ms"]["max"]]
        assert [float(v) for v in table["fluidity index"]] == [smooth["fluidity_index"], stalled["fluidity_index"]]
        assert table["finished"] == ["2", "2"]
        png = (run_dir / "tbt.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_report_out_dir_and_transfer_rows(tmp_path, capsys):
    make_run(tmp_path / "runs" / "colocated", 10)
    make_run(tmp_path / "runs" / "disagg", 10, transfer=True)
    out = tmp_path / "cmp"
    assert report_main([str(tmp_path / "runs" / "colocated"), str(tmp_path / "runs" / "disagg"),
                        "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "KV transfers" in text and "achieved GB/s" in text
    table = read_csv(out / "report.csv")
    assert table["metric"] == ["colocated", "disagg"]              # no .hydra: the directory name
    assert table["KV bytes sent"] == ["", "2000000"]
    assert float(table["achieved GB/s"][1]) == pytest.approx(0.1)  # 2 MB in 2 x 10 ms
    assert sorted(p.name for p in out.glob("*.png")) == ["1_colocated_tbt.png", "2_disagg_tbt.png"]
    assert not (tmp_path / "runs" / "colocated" / "report.csv").exists()


def test_report_errors_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"testbed report: {tmp_path / 'empty'}: no summary.json here; is this a run directory?"


def test_report_without_requests_still_prints_the_table(tmp_path, capsys):
    make_run(tmp_path / "r", 10)
    (tmp_path / "r" / "requests.jsonl").unlink()
    assert report_main([str(tmp_path / "r")]) == 0
    captured = capsys.readouterr()
    assert "TTFT p99 ms" in captured.out and "no requests.jsonl, so no TBT plot" in captured.err
    assert not (tmp_path / "r" / "tbt.png").exists()


def test_report_of_a_run_interrupted_before_any_request(tmp_path, capsys):
    """Ctrl-C during start-up leaves empty records: the table and a figure that
    says so, not matplotlib's refusal to log-scale nothing."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    write_jsonl(run_dir / "requests.jsonl", [])
    write_jsonl(run_dir / "iterations.jsonl", [])
    (run_dir / "summary.json").write_text(json.dumps(summarize([], [], slo_ttft_ms=100, slo_tpot_ms=20)))
    assert report_main([str(run_dir)]) == 0
    assert "requests" in capsys.readouterr().out
    assert (run_dir / "tbt.png").read_bytes().startswith(PNG_MAGIC)


def test_the_per_run_figure_bins_10_5_iterations_and_wraps_a_long_title(tmp_path, monkeypatch):
    """10^5 iterations: no bar per iteration (they merge into black) but filled
    time buckets with no edges; the stall in the middle still shows as the
    bucket's largest iteration; a long title is wrapped inside the figure."""
    import time

    import matplotlib.pyplot as plt

    from testbed import report_tbt
    from testbed.report import Run
    n = 100_000
    iterations = [IterationRecord(i * 1e-3, 1e-3, 4096 if i == n // 2 else 0, 8) for i in range(n)]
    times = [0.01 + 0.001 * i for i in range(2000)]
    requests = [RequestRecord("r0", "finished", 100, list(range(2000)), 0.0, 0.0, times[0], times, times[-1], 0, None)]
    label = " ".join(["mode=disagg scheduler=sarathi token_budget=2048 workload.prompt_len=131072"] * 3)
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))     # keep the figure to inspect it
    t0 = time.perf_counter()
    report_tbt.plot_tbt(Run(tmp_path, label, {}, requests, iterations), tmp_path / "tbt.png")
    print(f"plot_tbt, 10^5 iterations: {time.perf_counter() - t0:.1f} s (noisy: shared CPU)")
    assert (tmp_path / "tbt.png").read_bytes()[:8] == PNG_MAGIC
    fig = figs[0]
    ax_it = fig.axes[1]
    assert len(ax_it.patches) == 0                                   # no bars
    fills = [c for c in ax_it.collections]
    assert len(fills) == 2 and all(np.all(c.get_linewidths() == 0) for c in fills)
    (peak,) = ax_it.get_lines()
    assert peak.get_ydata().max() == 4096 + 8 and len(peak.get_ydata()) == report_tbt.NUM_BINS + 1
    # the buckets' means: 8 decode tokens per iteration everywhere
    edges, decode, prefill, _ = report_tbt.binned_iterations(iterations, 0.0)
    assert np.allclose(decode, 8) and prefill.sum() == pytest.approx(4096 / (n / report_tbt.NUM_BINS))
    title = fig._suptitle
    fig.canvas.draw()
    box = title.get_window_extent()
    assert "\n" in title.get_text() and box.x0 >= 0 and box.x1 <= fig.bbox.x1


def test_a_short_run_keeps_one_bar_per_iteration(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from testbed import report_tbt
    from testbed.report import Run
    iterations = [IterationRecord(i * 0.01, 0.01, 64 if i < 5 else 0, 2) for i in range(50)]
    times = [0.05 + 0.01 * i for i in range(20)]
    requests = [RequestRecord("r0", "finished", 100, list(range(20)), 0.0, 0.01, times[0], times, times[-1], 0, None)]
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    report_tbt.plot_tbt(Run(tmp_path, "scheduler=sarathi", {}, requests, iterations), tmp_path / "tbt.png")
    assert len(figs[0].axes[1].patches) == 2 * 50
