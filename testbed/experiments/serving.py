"""The serving studies (experiments/README.md): whole runs of the testbed, one
per serving policy, compared.

- `stall` (Sarathi-Serve Figure 1): the `stall` workload (long prompts landing
  among running decodes) on the real engine under vllm_v0, orca, sarathi and
  disaggregation; every inter-token gap over time, one panel per policy
  (stall.png), and p50/p99/max TBT per policy (stall.csv).
- `capacity`: the highest request rate meeting the p99 TTFT and p99 TBT SLOs
  (testbed/capacity.py's binary search), colocated against disaggregated at
  equal GPU count, per GPU, per workload (capacity.csv, capacity.png).

A policy is a (mode, scheduler, token budget, worker layout) applied to the
experiment's RunConfig; each policy's run is an ordinary run directory below
the experiment's (summary.json, requests.jsonl, ...), so `testbed report`
reads it like any other."""
from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from testbed.config import RunConfig
from testbed.experiments.config import ExperimentConfig, parse_split
from testbed.metrics import read_requests


@dataclass(frozen=True)
class Policy:
    label: str               # "sarathi-512", "vllm_v0", "disagg-1P1D"
    mode: str                # colocated | disagg
    scheduler: str
    token_budget: int | None = None      # None: the run's
    replicas: int = 1                    # colocated
    prefill_workers: int = 1             # disagg
    decode_workers: int = 1

    @property
    def num_gpus(self) -> int:
        return self.replicas if self.mode == "colocated" else self.prefill_workers + self.decode_workers

    def apply(self, cfg: RunConfig, **changes) -> RunConfig:
        """`cfg` run under this policy as a plain run (no experiment, no W&B run of its own)."""
        return dataclasses.replace(
            cfg, mode=self.mode, scheduler=self.scheduler,
            token_budget=self.token_budget or cfg.token_budget, replicas=self.replicas,
            prefill_workers=self.prefill_workers, decode_workers=self.decode_workers,
            experiment=ExperimentConfig(), wandb=dataclasses.replace(cfg.wandb, mode="disabled"), **changes)


def policies(e: ExperimentConfig, num_gpus: int = 1) -> list[Policy]:
    """The colocated schedulers (sarathi once per token budget) on `num_gpus`
    replicas, then each xPyD split of e.disagg_splits with that many GPUs
    (all of them when num_gpus is 1, the stall study's single worker)."""
    out = []
    for s in e.schedulers:
        if s == "sarathi":
            out += [Policy(f"sarathi-{b}", "colocated", s, b, replicas=num_gpus) for b in e.token_budgets]
        else:
            out.append(Policy(s, "colocated", s, replicas=num_gpus))
    for split in e.disagg_splits:
        p, d = parse_split(split)
        if num_gpus == 1 or p + d == num_gpus:
            out.append(Policy(f"disagg-{split}", "disagg", e.disagg_scheduler, prefill_workers=p, decode_workers=d))
    return out


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# -- stall -------------------------------------------------------------------------------------------
def _plot_stall(runs: list[tuple[Policy, Path]], cfg: RunConfig, path: Path) -> None:
    """One panel per policy, shared axes: every inter-token gap at the time its
    token arrived (the running decodes in blue, the long prompts' own decodes
    in orange), the long prompts' arrivals as dashed lines."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.2 * len(runs) + 0.8), sharex=True, sharey=True,
                             squeeze=False)
    long_len = min(cfg.workload.inject_prompt_len, default=None)
    for ax, (policy, run_dir) in zip(axes[:, 0], runs):
        records = read_requests(run_dir / "requests.jsonl")
        t0 = min(r.arrival_s for r in records)
        for is_long, color, name in ((False, "tab:blue", "running decodes"),
                                     (True, "tab:orange", "the long prompts' decodes")):
            sel = [r for r in records if (long_len is not None and r.prompt_len >= long_len) == is_long]
            xs = [t - t0 for r in sel for t in r.token_times_s[1:]]
            ys = [max(g * 1e3, 1e-2) for r in sel for g in r.tbt_s]
            if xs:
                ax.scatter(xs, ys, s=5, color=color, label=name)
        for r in records:
            if long_len is not None and r.prompt_len >= long_len:
                ax.axvline(r.arrival_s - t0, color="tab:red", ls="--", lw=0.8)
        gaps = [g * 1e3 for r in records for g in r.tbt_s]
        ax.set_title(f"{policy.label}: TBT max {max(gaps, default=0):.0f} ms", fontsize=9, loc="left")
        ax.set_yscale("log")
        ax.set_ylabel("TBT ms")
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the first arrival (s); dashed: a long prompt arrives")
    fig.suptitle(f"A long prompt among running decodes ({cfg.model.name}, real engine on this CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_stall(cfg: RunConfig, out: Path, log=print) -> dict:
    rows, runs = [], []
    for policy in policies(cfg.experiment):
        run_dir = out / policy.label
        log(f"stall: {policy.label}")
        s = execute_run(policy.apply(cfg), run_dir)
        runs.append((policy, run_dir))
        long_len = min(cfg.workload.inject_prompt_len, default=None)
        long_ttft = [r.ttft_s * 1e3 for r in read_requests(run_dir / "requests.jsonl")
                     if long_len is not None and r.prompt_len >= long_len and r.ttft_s is not None]
        rows.append({"policy": policy.label, "mode": policy.mode, "scheduler": policy.scheduler,
                     "token_budget": policy.token_budget or "", "num_finished": s["num_finished"],
                     "tbt_p50_ms": s["tbt_ms"]["p50"], "tbt_p99_ms": s["tbt_ms"]["p99"],
                     "tbt_max_ms": s["tbt_ms"]["max"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                     "long_prompt_ttft_ms": max(long_ttft, default=None), "e2e_p99_ms": s["e2e_ms"]["p99"],
                     "run_dir": policy.label})
    _write_csv(out / "stall.csv", rows)
    _plot_stall(runs, cfg, out / "stall.png")
    return {"experiment": "stall", "policies": [r["policy"] for r in rows],
            "tbt_ms": {r["policy"]: {k: r[f"tbt_{k}_ms"] for k in ("p50", "p99", "max")} for r in rows},
            "figures": ["stall.png"], "rows": rows}


def execute_run(cfg: RunConfig, out_dir: Path) -> dict:
    """One plain run (testbed.run.execute) into out_dir; its summary."""
    from testbed.run import execute
    return execute(cfg, out_dir)
