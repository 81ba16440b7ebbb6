"""Weights & Biases logging of a finished run: the resolved config, the
summary, the per-iteration series and a per-request table. Offline by default
(`wandb.mode=offline`: no network; `wandb sync <run dir>/wandb/...` uploads
later); the files land in the run directory."""
from __future__ import annotations

import json
import os
from pathlib import Path

from testbed.config import RunConfig, to_dict


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "/"))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
    return out


def _config(cfg: RunConfig) -> dict:
    """The resolved config, its engine as priced (engine=auto resolved, with each term's provenance)."""
    import dataclasses
    config = to_dict(cfg)
    config["engine"] = dataclasses.asdict(cfg.run_engine())
    return config


def log_run(cfg: RunConfig, out_dir: Path, summary: dict, result) -> str | None:
    """Returns the wandb run's directory (None when disabled)."""
    if cfg.wandb.mode == "disabled":
        return None
    import wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, group=cfg.wandb.group,
                     mode=cfg.wandb.mode, dir=str(out_dir), config=_config(cfg),
                     name=cfg.wandb.name or f"{cfg.mode}-{cfg.scheduler}-{cfg.model.name}-{cfg.workload.name}",
                     reinit="finish_previous")
    try:
        # from the streamed files, one record at a time (requests in arrival order)
        for it in result.log.iter_iterations():
            run.log({"iteration/start_s": it.start_s, "iteration/duration_ms": it.duration_s * 1e3,
                     "iteration/num_prefill_tokens": it.num_prefill_tokens,
                     "iteration/num_decode_tokens": it.num_decode_tokens,
                     "iteration/kv_bytes_read": it.kv_bytes_read})
        columns = ["request_id", "status", "prompt_len", "num_output_tokens", "ttft_ms", "tpot_ms", "e2e_ms",
                   "num_preemptions", "kv_bytes_sent", "exposed_transfer_ms"]
        table = wandb.Table(columns=columns)
        for r in result.log.iter_requests():
            ms = lambda s: None if s is None else s * 1e3  # noqa: E731
            table.add_data(r.request_id, r.status, r.prompt_len, len(r.output_token_ids), ms(r.ttft_s),
                           ms(r.tpot_s), ms(r.e2e_s), r.num_preemptions, r.kv_bytes_sent, ms(r.exposed_transfer_s))
        run.log({"requests": table})
        run.summary.update(_flat({k: v for k, v in summary.items() if k != "workers"}))
        return run.dir
    finally:
        run.finish()


def _table(wandb, rows: list[dict]):
    """A wandb.Table of row dicts: columns in first-seen order; lists and dicts as JSON text."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: json.dumps(v) if isinstance(v, (list, dict, tuple)) else v  # noqa: E731
    return wandb.Table(columns=columns, data=[[cell(r.get(c)) for c in columns] for r in rows])


def log_experiment(cfg: RunConfig, out_dir: Path, result: dict, rows: list[dict] | None,
                   series: list[dict] | None = None, tables: dict[str, list[dict]] | None = None) -> str | None:
    """An experiment's result table (one wandb.Table, so a dashboard can draw
    line plots from it with no custom code), its line series (each a
    wandb.plot.line_series under its own key), its other tables (under
    EXPERIMENT/NAME), its figures and its summary. `series` and `tables` follow
    the contract of a study's result dict (testbed/experiments/__init__.py)."""
    import wandb
    run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, group=cfg.wandb.group or cfg.experiment.name,
                     mode=cfg.wandb.mode, dir=str(out_dir), config=_config(cfg), job_type="experiment",
                     name=cfg.wandb.name or f"experiment-{cfg.experiment.name}",
                     reinit="finish_previous")
    try:
        if rows:
            table = _table(wandb, rows)
            run.log({f"{cfg.experiment.name}/table": table})
            if {"context_len", "reread_ms", "transfer_ms"} <= set(table.columns):
                run.log({f"{cfg.experiment.name}/reread_ms": wandb.plot.scatter(table, "context_len", "reread_ms"),
                         f"{cfg.experiment.name}/transfer_ms": wandb.plot.scatter(table, "context_len", "transfer_ms")})
        for s in series or []:
            run.log({s["key"]: wandb.plot.line_series(xs=s["xs"], ys=s["ys"], keys=s["keys"], title=s["title"],
                                                      xname=s["xname"])})
        for name, table_rows in (tables or {}).items():
            if table_rows:
                run.log({f"{cfg.experiment.name}/{name}": _table(wandb, table_rows)})
        for png in sorted(out_dir.glob("*.png")):
            run.log({f"figures/{png.stem}": wandb.Image(str(png))})
        run.summary.update(_flat({k: v for k, v in result.items() if not isinstance(v, list)}))
        return run.dir
    finally:
        run.finish()
