"""The studies (experiments/README.md): `testbed run experiment=NAME` runs one
into its run directory: its tables (CSV/JSON), figures (PNG) and an
experiment.json summary, logged to W&B like any run. Each study is its config
class (studies.py), which names the function that runs it.

A study returns a dict for experiment.json, plus what goes only to W&B
(testbed/wandb_log.py:log_experiment), popped before writing: `rows` (its main
table), `series` ([{"key", "title", "xname", "xs": [x], "ys": [[y or None]],
"keys": [line name]}], each a wandb.plot.line_series) and `tables`
({name: [row dict]}, each a wandb.Table)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path


def save_figure(fig, path: Path, title: str | None = None) -> Path:
    """Every study's figure epilogue: title, tight layout, PNG at 110 dpi, closed."""
    import matplotlib.pyplot as plt
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_experiment(cfg, out_dir: str | Path) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module, fn = type(cfg.experiment).run.split(":")
    result = getattr(importlib.import_module(module), fn)(cfg, out, print)
    rows = result.pop("rows", None)
    series, tables = result.pop("series", None), result.pop("tables", None)
    (out / "experiment.json").write_text(json.dumps(result, indent=2, default=str))
    if cfg.wandb.mode != "disabled":
        from testbed.wandb_log import log_experiment
        log_experiment(cfg, out, result, rows, series, tables)
    return result
