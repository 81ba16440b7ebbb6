"""One run, from a RunConfig to a run directory: build the workload, run it on
the chosen runtime and mode, which stream requests.jsonl and iterations.jsonl
into the directory as records come (testbed/record_log.py), write summary.json
(from what was streamed) and the resolved config, log to W&B, print a compact
table."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from omegaconf import OmegaConf

from testbed.config import RunConfig, to_dict, validate
from testbed.progress import progress, request_counter
from testbed.runtime.build import sampled
from testbed.runtime.deployment import num_gpus
from testbed.workloads.build import iter_workload


def run_workload(cfg: RunConfig, requests, progress=None, record_dir=None):
    """Serve `requests` (the simulator pulls them from an iterator in arrival
    order; the real runtime takes a list) on the configured runtime."""
    if cfg.runtime.name == "sim":
        from testbed.runtime.sim import SimRuntime
        from testbed.runtime.sim_split import run_split, split_groups
        groups, why = split_groups(cfg, record_dir)
        if groups is not None:
            return run_split(cfg, requests, record_dir, groups, log=_stderr)
        if cfg.runtime.sim_processes != 1:
            _stderr(f"runtime.sim_processes={cfg.runtime.sim_processes}: simulating in one process ({why})")
        return SimRuntime(cfg, record_dir=record_dir).run(requests)
    from testbed.runtime.real import RealRuntime
    return RealRuntime(cfg, progress=progress, record_dir=record_dir).run(list(requests))


def execute(cfg: RunConfig, out_dir: str | Path) -> dict:
    """Run `cfg` and write its outputs into out_dir; returns summary.json's dict."""
    validate(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.experiment is not None:
        from testbed.experiments import run_experiment
        return run_experiment(cfg, out)
    requests = (sampled(cfg, r) for r in iter_workload(cfg.workload, cfg.model.vocab_size, cfg.seed))
    if cfg.runtime.name == "sim" and cfg.progress:    # the simulator pulls each request as its arrival comes
        requests = progress(requests, total=_expected_requests(cfg.workload), desc="requests arrived",
                            unit="req", enabled=cfg.progress)
    result = run_workload(cfg, requests, request_counter(cfg.progress) if cfg.progress else None,
                          record_dir=out)
    summary = result.log.summary(duration_s=result.duration_s or None)
    summary.update({
        "mode": cfg.mode, "runtime": cfg.runtime.name, "scheduler": cfg.scheduler, "model": cfg.model.name,
        "workload": cfg.workload.name, "token_budget": cfg.token_budget,
        "interrupted": result.interrupted,
        "num_gpus": num_gpus(cfg),          # per-GPU figures (testbed report SWEEP_DIR) divide by this
        "hardware": {"name": cfg.hardware.name, "provenance": cfg.hardware.provenance,
                     "defaults": getattr(cfg, "hardware_defaults_note", "")},
        "engine": engine_summary(cfg.run_engine()),
        "kv_blocks_leaked": {w: s["num_blocks"] - s["num_free_blocks"]
                             for w, s in result.worker_stats.items() if not s["all_free"]},
        "workers": result.worker_stats,
    })
    prefix = result.log.stats.prefix.summary()
    if prefix is not None:
        summary["prefix_cache"] = prefix
    if result.store_stats is not None:
        summary["kv_store"] = result.store_stats
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if cfg.wandb.mode != "disabled":
        from testbed.wandb_log import log_run
        log_run(cfg, out, summary, result)
    print_summary(summary, out)
    return summary


def engine_summary(engine) -> dict:
    """The engine preset a run was priced with: its name, dataset and each term's source."""
    return {"name": engine.name, "calibration": engine.calibration, "provenance": engine.term_provenance()}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _expected_requests(workload) -> int | None:
    """A synthetic workload's request count (for the ETA); None for a trace or conversations."""
    if workload.uses_trace or workload.conversation_turns:
        return None
    n = workload.num_requests if workload.max_requests is None else min(workload.num_requests, workload.max_requests)
    return n + len(workload.inject_arrival_s)


def print_summary(summary: dict, out: Path) -> None:
    rows = [("requests (finished/total)", f"{summary['num_finished']}/{summary['num_requests']}")]
    for key in ("ttft_ms", "tbt_ms", "tpot_ms", "e2e_ms"):
        s = summary[key]
        if s and s.get("p50") is not None:
            rows.append((key, f"p50 {s['p50']:9.1f}  p99 {s['p99']:9.1f}  max {s['max']:9.1f}"))
    t = summary["throughput"]
    rows.append(("throughput", f"{t['requests_per_s']:.2f} req/s  {t['output_tokens_per_s']:.1f} out tok/s"))
    rows.append(("goodput", f"{summary['goodput']:.2f} req/s"))
    if summary.get("fluidity_index") is not None:
        rows.append(("fluidity_index", f"{summary['fluidity_index']:.3f}"))
    rows.append(("preemptions", str(summary["num_preemptions"])))
    first_error = summary.get("first_error") or {}
    for status, label in (("failed", "failed"), ("aborted", "aborted"), ("rejected", "rejected at arrival")):
        count = summary.get(f"num_{status}")
        if count:
            why = first_error.get(status)
            # one line (requests.jsonl has the whole error)
            rows.append((label, str(count) + (f"  first: {textwrap.shorten(why, 240)}" if why else "")))
    if summary.get("prefix_cache"):
        pc = summary["prefix_cache"]
        rows.append(("prefix_cache_hit_rate", f"{pc['prefix_cache_hit_rate']:.3f}  (local {pc['local_hit_rate']:.3f}, "
                                              f"store {pc['store_hit_rate']:.3f})"))
    if summary.get("kv_store"):
        ks = summary["kv_store"]
        moved = f"to {ks['bytes_to_store'] / 2**20:.1f} MiB  from {ks['bytes_from_store'] / 2**20:.1f} MiB"
        rows.append(("kv_store", f"hits {ks['hits']}  misses {ks['misses']}  evictions {ks['evictions']}  {moved}"))
        if ks.get("demotions") or ks.get("disk_hits"):
            rows.append(("kv_store disk tier", f"demoted {ks['demotions']}  hits {ks['disk_hits']}"))
        damaged = {k: ks.get(k) for k in ("puts_corrupt", "puts_rejected", "get_misses", "disk_corrupt",
                                          "disk_read_errors", "disk_write_errors") if ks.get(k)}
        if damaged:
            rows.append(("kv_store dropped (blocks)", "  ".join(f"{k} {v}" for k, v in damaged.items())))
    if summary.get("kv_transfer"):
        kt = summary["kv_transfer"]
        exposed = kt["exposed_ms"]["p50"]
        rows.append(("kv_transfer", f"{kt.get('bytes', 0) / 2**20:.1f} MiB  {kt.get('achieved_gb_per_s') or 0:.2f} GB/s"
                     + ("" if exposed is None else f", exposed p50 {exposed:.1f} ms")))
    if summary["kv_blocks_leaked"]:
        rows.append(("KV BLOCKS LEAKED", str(summary["kv_blocks_leaked"])))
    width = max(len(k) for k, _ in rows)
    print(f"\n{summary['mode']} / {summary['scheduler']} / {summary['model']} / {summary['workload']}  ->  {out}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
