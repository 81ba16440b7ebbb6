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

from testbed.experiments import save_figure
from testbed.config import RunConfig
from testbed.experiments.config import parse_split
from testbed.experiments.serving_config import StallConfig
from testbed.metrics import read_requests
from testbed.model.config import load_model_preset
from testbed.sim.config import load_hardware_preset
from testbed.workloads.config import WorkloadConfig, load_workload_preset, make_workload_config


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
        """Workers in the mode's layout (one accelerator each)."""
        from testbed.modes.registry import ModeSettings, get_mode
        settings = ModeSettings(self.replicas, self.prefill_workers, self.decode_workers, "", "", "", 0, 0)
        return len(get_mode(self.mode, settings).layout())

    def apply(self, cfg: RunConfig, **changes) -> RunConfig:
        """`cfg` run under this policy as a plain run (no experiment, no W&B run of its own)."""
        return dataclasses.replace(
            cfg, mode=self.mode, scheduler=self.scheduler,
            token_budget=self.token_budget or cfg.token_budget, replicas=self.replicas,
            prefill_workers=self.prefill_workers, decode_workers=self.decode_workers,
            experiment=None, wandb=dataclasses.replace(cfg.wandb, mode="disabled"), **changes)


def policies(e: StallConfig, num_gpus: int = 1) -> list[Policy]:
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
    save_figure(fig, path, f"A long prompt among running decodes ({cfg.model.name}, real engine on this CPU)")


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


# -- capacity ------------------------------------------------------------------------------------------
# a capacity workload: {name (real point only), preset, workload: {fields}, slo: {ttft_ms, tbt_ms},
# rate_start (req/s per GPU, where the search starts doubling or halving), max_probes}
SPEC_KEYS = {"name", "preset", "workload", "slo", "rate_start", "max_probes"}


def _capacity_rows(cfg: RunConfig, source: str, labels: list[str] | None, out: Path, log) -> tuple[list, list]:
    """Capacity per policy and workload of cfg.experiment (labels: only these
    policies, at one GPU), by testbed.capacity.find_capacity with Poisson
    arrivals at the probed rate. Returns (capacity rows, probe rows)."""
    from testbed.capacity import find_capacity
    from testbed.steady_state import SteadyRule
    e = cfg.experiment
    rows, probe_rows = [], []
    gpu_counts = sorted({sum(parse_split(s)) for s in e.disagg_splits}) if labels is None else [1]
    if labels is None:
        specs = list(e.workloads.items())
    else:
        specs = [(e.real_workload.get("name", "small"), e.real_workload)]
    # the real-engine point's probes reach a steady state (testbed/steady_state.py): a burst of a
    # dozen requests measures nothing; the simulator's workloads are fixed request sets
    steady = (SteadyRule(e.span_factor, e.min_judged, e.max_requests)
              if source == "real" else None)
    for name, spec in specs:
        slo, workload = dict(spec["slo"]), _workload(name, spec)
        start = spec.get("rate_start", e.rate_start)
        max_probes = spec.get("max_probes", e.max_probes)
        for gpus in gpu_counts:
            for policy in [p for p in policies(e, gpus) if labels is None or p.label in labels]:
                run_cfg = policy.apply(
                    cfg, workload=dataclasses.replace(workload, arrival="poisson", time_scale=1.0,
                                                      rate=start * policy.num_gpus), slo=_slo(cfg, slo))
                res = find_capacity(run_cfg, out / "probes" / name / f"{policy.label}-{policy.num_gpus}gpu",
                                    e.rel_tol, max_probes, log=lambda *_: None, steady=steady)
                bound = ("below_lowest" if res.rate is None else "no_failure" if res.first_failing_rate is None
                         else "found")
                at = next((p for p in res.probes if p.meets_slo and p.rate == res.rate), None)
                rows.append({"source": source, "workload": name, "model": cfg.model.name,
                             "hardware": cfg.hardware.name if source == "sim" else "this-cpu",
                             "policy": policy.label, "mode": policy.mode, "scheduler": policy.scheduler,
                             "token_budget": policy.token_budget or "", "num_gpus": policy.num_gpus,
                             "capacity_rps": res.rate,
                             "capacity_per_gpu": None if res.rate is None else res.rate / policy.num_gpus,
                             "bound": bound, "first_failing_rps": res.first_failing_rate,
                             "ttft_p99_ms": at and at.ttft_p99_ms, "tbt_p99_ms": at and at.tbt_p99_ms,
                             "slo_ttft_ms": slo["ttft_ms"], "slo_tbt_ms": slo["tbt_ms"],
                             "num_probes": len(res.probes),
                             "steady": res.steady if steady is not None else None})
                probe_rows += [{"source": source, "workload": name, "policy": policy.label,
                                "num_gpus": policy.num_gpus, "rate": p.rate, "meets_slo": p.meets_slo,
                                "reason": p.reason, "ttft_p99_ms": p.ttft_p99_ms, "tbt_p99_ms": p.tbt_p99_ms,
                                "num_finished": p.num_finished, "num_requests": p.num_requests,
                                "steady": p.steady if steady is not None else None,
                                "run_dir": str(Path(p.out_dir).relative_to(out))} for p in res.probes]
                per_gpu = "-" if res.rate is None else f"{res.rate / policy.num_gpus:.3g}"
                log(f"capacity {source} {name} {policy.label} ({policy.num_gpus} GPU): {per_gpu} req/s/GPU "
                    f"({bound}, {len(res.probes)} probes)")
    return rows, probe_rows


def _slo(cfg: RunConfig, slo: dict):
    """cfg.slo with the workload's p99 TTFT and TBT targets (find_capacity
    judges TBT against slo.tbt_ms when the config has one, else slo.tpot_ms)."""
    changes = {"ttft_ms": float(slo["ttft_ms"]), "tpot_ms": float(slo["tbt_ms"])}
    if hasattr(cfg.slo, "tbt_ms"):
        changes["tbt_ms"] = float(slo["tbt_ms"])
    return dataclasses.replace(cfg.slo, **changes)


def _check_spec(where: str, spec: dict) -> None:
    unknown = set(spec) - SPEC_KEYS
    if unknown or "slo" not in spec or not {"ttft_ms", "tbt_ms"} <= set(spec["slo"]):
        optional = ", ".join(sorted(SPEC_KEYS - {"slo"}))
        raise ValueError(f"{where}: give slo: {{ttft_ms, tbt_ms}} and optionally {optional} (got keys {sorted(spec)})")


def _workload(name: str, spec: dict) -> WorkloadConfig:
    """spec's `workload` fields over its `preset` (or WorkloadConfig's defaults), named `name`."""
    fields = {**(spec.get("workload") or {}), "name": name}
    if spec.get("preset"):
        fields.pop("name")
        return dataclasses.replace(load_workload_preset(spec["preset"], **fields), name=name)
    return make_workload_config(fields)


def _real_cfg(cfg: RunConfig) -> RunConfig:
    """The real-engine point: the first of real_models on this CPU."""
    model = load_model_preset(cfg.experiment.real_models[0])
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, name="real"), model=model,
                               hardware=load_hardware_preset("cpu"), num_kv_blocks=RunConfig.num_kv_blocks,
                               progress=False)


def _sim_cfg(cfg: RunConfig) -> RunConfig:
    """The simulator on the run's model and hardware, with the KV memory the accelerator has after the weights."""
    from testbed.sim.cost_model import CostModel
    tokens = CostModel(cfg.model, cfg.hardware, cfg.parallel, cfg.engine).kv_capacity_tokens()
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, name="sim"),
                               num_kv_blocks=tokens // cfg.block_size, progress=False)


def _plot_capacity(rows: list[dict], probe_rows: list[dict], path: Path) -> None:
    """A row per workload: capacity per GPU per policy (bars; hatched where
    the search found no failing rate), then every probe's p99 TBT and p99 TTFT
    against the offered rate per GPU, with the SLOs dashed."""
    plt = _pyplot()
    groups = list(dict.fromkeys((r["source"], r["workload"]) for r in rows))
    fig, axes = plt.subplots(len(groups), 3, figsize=(16, 3.8 * len(groups)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (source, workload), (ax_c, ax_tbt, ax_ttft) in zip(groups, axes):
        grows = [r for r in rows if (r["source"], r["workload"]) == (source, workload)]
        labels = [f"{r['policy']}\n{r['num_gpus']} GPU" for r in grows]
        values = [r["capacity_per_gpu"] or 0.0 for r in grows]
        bars = ax_c.bar(range(len(grows)), values, color=[colors[i % 10] for i in range(len(grows))])
        for bar, r in zip(bars, grows):
            if r["bound"] != "found":
                bar.set_hatch("//")
            ax_c.annotate("none" if r["capacity_per_gpu"] is None else f"{r['capacity_per_gpu']:.3g}",
                          (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
        ax_c.set_xticks(range(len(grows)), labels, fontsize=7)
        ax_c.set_ylabel("capacity, req/s per GPU")
        ax_c.set_title(f"{workload} ({grows[0]['model']} on {grows[0]['hardware']}, {source})", fontsize=9)
        for i, r in enumerate(grows):
            pts = sorted((p for p in probe_rows if (p["source"], p["workload"], p["policy"], p["num_gpus"])
                          == (source, workload, r["policy"], r["num_gpus"])), key=lambda p: p["rate"])
            x = [p["rate"] / p["num_gpus"] for p in pts]
            for ax, key in ((ax_tbt, "tbt_p99_ms"), (ax_ttft, "ttft_p99_ms")):
                ax.plot(x, [p[key] for p in pts], "o-", color=colors[i % 10], ms=3, label=r["policy"])
        for ax, key, name in ((ax_tbt, "slo_tbt_ms", "p99 TBT ms"), (ax_ttft, "slo_ttft_ms", "p99 TTFT ms")):
            ax.axhline(grows[0][key], color="black", ls="--", lw=0.8, label="SLO")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("offered rate, req/s per GPU")
            ax.set_ylabel(name)
            ax.legend(fontsize=6)
    save_figure(fig, path, "Capacity under p99 TTFT and TBT SLOs, colocated vs disaggregated at equal GPU count")


def run_capacity(cfg: RunConfig, out: Path, log=print) -> dict:
    e = cfg.experiment
    for name, spec in e.workloads.items():      # every spec checked before the first run
        _check_spec(f"experiment.workloads.{name}", spec)
        _workload(name, spec)
    if e.real and e.real_policies:
        _check_spec("experiment.real_workload", e.real_workload)
        known = [p.label for p in policies(e)]
        unknown = [label for label in e.real_policies if label not in known]
        if unknown:
            raise ValueError(f"experiment.real_policies: {unknown} not among this experiment's policies "
                             f"{known} (schedulers x token_budgets, disagg_splits)")
    if not e.workloads:
        raise ValueError("experiment.workloads: empty; conf/experiment/capacity.yaml sets the workloads "
                         "and their SLOs (run `testbed run experiment=capacity`)")
    rows, probe_rows = _capacity_rows(_sim_cfg(cfg), "sim", None, out, log)
    if e.real and e.real_policies:
        real_rows, real_probes = _capacity_rows(_real_cfg(cfg), "real", list(e.real_policies), out, log)
        rows, probe_rows = rows + real_rows, probe_rows + real_probes
    _write_csv(out / "capacity.csv", rows)
    _write_csv(out / "capacity_probes.csv", probe_rows)
    _plot_capacity(rows, probe_rows, out / "capacity.png")
    return {"experiment": "capacity", "model": cfg.model.name, "hardware": cfg.hardware.name,
            "capacity_per_gpu": [{k: r[k] for k in ("source", "workload", "policy", "num_gpus", "capacity_per_gpu",
                                                    "bound")} for r in rows],
            "figures": ["capacity.png"], "rows": rows}


def execute_run(cfg: RunConfig, out_dir: Path) -> dict:
    """One plain run (testbed.run.execute) into out_dir; its summary."""
    from testbed.run import execute
    return execute(cfg, out_dir)
