"""`testbed report SWEEP_DIR` on a real simulated sweep over mode and
workload.prompt_len: goodput per GPU against L, one line per deployment."""
from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest

from test_wandb_sweeps import SMALL, points, run_testbed
from testbed import report_sweep
from testbed.report import report_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow          # ~25 s here: a four-point CLI sweep
def test_report_draws_goodput_per_gpu_against_l_from_a_sweep(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    proc = run_testbed("run", "-m", *SMALL, "wandb.mode=disabled", "mode=colocated,disagg",
                       "workload.prompt_len=64,256", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    assert report_main([str(sweep)]) == 0
    assert f"wrote {sweep / 'capacity_vs_length.png'}" in capsys.readouterr().out
    assert (sweep / "capacity_vs_length.png").read_bytes()[:8] == PNG_MAGIC

    # the points: goodput / GPUs (colocated: 1 replica; disagg: 1 prefill + 1 decode worker)
    summaries = [json.loads((p / "summary.json").read_text()) for p in points(sweep)]
    rows = report_sweep.capacity_rows([report_sweep.point(p, s) for p, s in zip(points(sweep), summaries)])
    got = {(r["deployment"], r["context_len"]): (r["num_gpus"], r["capacity_per_gpu"]) for r in rows}
    expect = {}
    for s, (mode, n) in zip(summaries, [("colocated", 64), ("colocated", 256), ("disagg", 64), ("disagg", 256)]):
        gpus = 1 if mode == "colocated" else 2
        expect[(f"mode={mode} num_gpus={gpus}", n)] = (gpus, pytest.approx(s["goodput"] / gpus))
    assert got == expect and all(g > 0 for _, g in got.values())

    # the figure: one line per deployment over the sweep's two lengths
    ax = next(f for f in figs if f is not None and f.axes and f.axes[0].get_ylabel().startswith("goodput")).axes[0]
    lines = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    assert lines == {"mode=colocated num_gpus=1": [64, 256], "mode=disagg num_gpus=2": [64, 256]}

    # points over one length only draw nothing
    one_length = [(p, s) for p, s in zip(points(sweep), summaries) if "prompt_len=64" in p.name]
    assert len(one_length) == 2 and report_sweep.plot_sweep_capacity(one_length, tmp_path / "x.png") is None


def test_each_deployment_and_length_takes_its_best_goodput_per_gpu_over_rates():
    def pt(mode, budget, n, rate, goodput, gpus):
        identity = {"mode": mode, "scheduler": "sarathi", "token_budget": budget, "replicas": 1,
                    "prefill_workers": 1, "decode_workers": 1, "num_gpus": gpus}
        return {"identity": identity, "context_len": n, "rate": rate, "capacity_per_gpu": goodput / gpus,
                "source": "sim", "steady": True, "run_dir": f"{mode}-{budget}-{n}-{rate}"}
    points = [pt("colocated", 512, 1024, 4.0, 4.0, 1), pt("colocated", 512, 1024, 8.0, 6.0, 1),
              pt("colocated", 2048, 1024, 8.0, 7.0, 1), pt("disagg", 512, 1024, 8.0, 8.0, 2),
              pt("disagg", 512, 4096, 8.0, 3.0, 2)]
    rows = report_sweep.capacity_rows(points)
    assert [(r["deployment"], r["context_len"], r["capacity_per_gpu"], r["rate"]) for r in rows] == [
        ("mode=colocated token_budget=2048 num_gpus=1", 1024, 7.0, 8.0),
        ("mode=colocated token_budget=512 num_gpus=1", 1024, 6.0, 8.0),      # the better of its two rates
        ("mode=disagg token_budget=512 num_gpus=2", 1024, 4.0, 8.0),
        ("mode=disagg token_budget=512 num_gpus=2", 4096, 1.5, 8.0)]
    assert report_sweep.num_gpus({"parallel": {"tp": 2, "pp": 2}}, {"workers": {"prefill0": {}, "decode0": {}}}) == 8
    assert report_sweep.num_gpus({"parallel": {"tp": 2}}, {"num_gpus": 3, "workers": {"a": {}}}) == 3
