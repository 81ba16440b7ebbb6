"""Capacity per GPU of mode=hybrid against the best colocated (token budgets
512 and 2,048) and the best disaggregated deployment (xPyD splits, prefill at
tp 1 or 2, prefill budget 2,048 or 512) at the same GPU count, each with every
scheduler of --schedulers, in the simulator, on a mixed-length workload:
Azure-conversation-like lengths plus a long-context tail to 128K tokens.

    python experiments/benchmarks/bench_hybrid_capacity.py [--out DIR] [--jobs N] [--quick] [--gpus 4]
        [--ttft-floor-ms 0] [--schedulers sarathi,sarathi_srpt] [--thresholds 4096,16384] [--only LABEL,...]

The workload (written to --out as a lengths-only trace, Poisson arrivals at
the probed rate): 95% of prompts lognormal with median 1,020 tokens and
sigma 0.7 (clipped to 16..8,192), the Splitwise paper's Azure conversation
trace median; exactly 5% in a tail at evenly spaced log-quantiles of
16K..128K, at random positions (stratified: with ~50 tail requests a random
draw moved the capacity by 2x between seeds); outputs lognormal with median
129 (the same trace's) and sigma 1.0, clipped to 4..2,048. llama3-8b on
h100-sxm, rdma-400 between GPUs, num_kv_blocks=auto (the GPU's memory after
weights), max_num_seqs 256.

SLOs, per request as DistServe's attainment: at least 99% of requests get
their first token within max(floor, k x their own prompt's whole-prefill
time on one idle GPU) (k = 5, the decision study's TTFT SLO, scaled with each
request's length since the lengths span 16..128K; floor 250 ms by default,
--ttft-floor-ms: without it a 200-token prompt's target is ~50 ms, shorter
than two iterations of any GPU that batches), p99 TBT over all token gaps <=
100 ms, and every request finished. testbed.capacity's judge has one fixed TTFT
for the whole run, so the search here is its bracket-and-bisect over rates
with this judge; capacity per GPU divides by testbed.runtime.deployment.num_gpus.
The noise floor: the best deployment of each family searched again on a
second workload seed (the simulator is deterministic; the draw is the noise).
Every deployment is searched with each scheduler of --schedulers (sarathi,
and sarathi_srpt: chunks shortest-remaining-prompt-first) for every family.
Figures and their reading: experiments/README.md, "hybrid capacity"."""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

TAIL_FRACTION = 0.05
TAIL_MIN, TAIL_MAX = 16384, 131072
TTFT_K = 5.0
TBT_SLO_MS = 100.0
COMMON = ["runtime=sim", "model=llama3-8b", "hardware=h100-sxm", "link=rdma-400", "max_num_seqs=256",
          "progress=false", "wandb.mode=disabled", "timeout_s=1000000", "workload.name=hybrid_mixed",
          "workload.arrival=poisson", "workload.prompt_dist=trace", "workload.output_dist=trace",
          "workload.trace_format=sarathi_csv", f"slo.tpot_ms={TBT_SLO_MS}"]


def write_workload(path: Path, n: int, seed: int) -> dict:
    """The mixed-length trace (lengths only) and its statistics."""
    rng = np.random.default_rng([seed, 0x4B1D])
    prompts = np.clip(np.round(1020 * np.exp(0.7 * rng.standard_normal(n))), 16, 8192).astype(np.int64)
    n_tail = round(TAIL_FRACTION * n)
    quantiles = (np.arange(n_tail) + rng.random()) / n_tail      # one random offset, evenly spaced
    tail = rng.permutation(n)[:n_tail]
    prompts[tail] = np.round(np.exp(np.log(TAIL_MIN) + quantiles * np.log(TAIL_MAX / TAIL_MIN)))
    outputs = np.clip(np.round(129 * np.exp(1.0 * rng.standard_normal(n))), 4, 2048).astype(np.int64)
    with open(path, "w") as f:
        f.write("num_prefill_tokens,num_decode_tokens\n")
        f.writelines(f"{p},{o}\n" for p, o in zip(prompts, outputs))
    return {"requests": n, "prompt_median": float(np.median(prompts)), "prompt_mean": float(prompts.mean()),
            "prompt_max": int(prompts.max()), "tail_requests": n_tail,
            "tail_share_of_prompt_tokens": float(prompts[tail].sum() / prompts.sum()),
            "output_median": float(np.median(outputs)), "output_mean": float(outputs.mean())}


SHORT = {"sarathi": "", "sarathi_srpt": "-srpt", "adaptive": "-adaptive"}


def deployments(gpus: int, quick: bool, schedulers: tuple[str, ...] = ("sarathi",),
                thresholds: tuple[int, ...] = (4096, 16384)) -> list[tuple[str, str, list[str]]]:
    """(label, family, overrides) of every deployment searched at `gpus` GPUs,
    each with every scheduler in `schedulers` (the same policy choice for every
    family: colocated replicas, disaggregated prefill workers, and both of
    hybrid's pools; decode workers only decode)."""
    out = []
    for sched in schedulers:
        tag, s = SHORT.get(sched, "-" + sched), f"scheduler={sched}"
        out += [(f"sarathi-{b}{tag}", "colocated", ["mode=colocated", f"replicas={gpus}", f"token_budget={b}", s])
                for b in (512, 2048)]
        # the prefill workers chunk at the GPU's default 2,048 or at hybrid's 512 ("-b512")
        for btag, budget in (("", []), ("-b512", ["token_budget=512"])):
            for p in range(1, gpus):
                out.append((f"disagg-{p}P{gpus - p}D{btag}{tag}", "disaggregated",
                            ["mode=disagg", f"prefill_workers={p}", f"decode_workers={gpus - p}", s, *budget]))
            for p in range(1, gpus // 2):            # prefill at tp=2: 2p GPUs of prefill, the rest decode
                if gpus - 2 * p >= 1:
                    out.append((f"disagg-{p}P{gpus - 2 * p}D-p_tp2-d_tp1{btag}{tag}", "disaggregated",
                                ["mode=disagg", f"prefill_workers={p}", f"decode_workers={gpus - 2 * p}",
                                 "prefill.parallel.tp=2", s, *budget]))
        for c in range(1, gpus - 1):
            for p in range(1, gpus - c):
                d = gpus - c - p
                for threshold in thresholds:      # Dynamo's fixed 4,096, and the tail's start
                    out.append((f"hybrid-{c}C{p}P{d}D-t{threshold}{tag}", "hybrid",
                                ["mode=hybrid", f"hybrid.colocated_replicas={c}", f"prefill_workers={p}",
                                 f"decode_workers={d}", f"hybrid.threshold={threshold}", "token_budget=512", s]))
    if quick:
        keep = {f"{name}{SHORT.get(sched, '-' + sched)}" for sched in schedulers
                for name in ("sarathi-512", f"disagg-{gpus // 2}P{gpus - gpus // 2}D", f"disagg-{gpus - 1}P1D",
                             "hybrid-1C2P1D-t16384", "hybrid-2C1P1D-t16384")}
        out = [d for d in out if d[0] in keep]
    return out


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs
    from testbed.model.config import CONF_DIR
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(hydra_compose("config", overrides))


class TTFTDeadline:
    """max(floor, k x the prompt's whole-prefill time on one idle GPU of the run's hardware)."""

    def __init__(self, cfg, floor_s: float):
        self.floor_s = floor_s
        from testbed.sim.cost_model import CostModel
        from testbed.sim.config import ParallelConfig
        self.cost = CostModel(cfg.model, cfg.hardware, ParallelConfig(), cfg.engine)
        self.memo: dict[int, float] = {}

    def __call__(self, prompt_len: int) -> float:
        if prompt_len not in self.memo:
            self.memo[prompt_len] = max(self.floor_s,
                                        TTFT_K * self.cost.iteration_time_s([(prompt_len, prompt_len)], 1))
        return self.memo[prompt_len]


def probe(cfg, rate: float, deadline: TTFTDeadline) -> dict:
    """One complete run at `rate`: whether it meets the SLOs, and why not."""
    import dataclasses

    from testbed.run_stats import summarize
    from testbed.run import run_workload
    from testbed.runtime.build import apply_sampling
    from testbed.workloads.build import build_workload
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, rate=rate))
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, requests)
    with contextlib.redirect_stderr(io.StringIO()):
        result = run_workload(cfg, requests)
    records = result.records
    s = summarize(records, result.iterations, cfg.slo.ttft_ms, cfg.slo.tpot_ms)
    unfinished = sum(not r.finished for r in records)
    late = sum(r.ttft_s is None or r.ttft_s > deadline(r.prompt_len) for r in records)
    tbt = s["tbt_ms"]["p99"]
    if unfinished:
        why = f"{unfinished} unfinished"
    elif late > 0.01 * len(records):
        why = f"{late / len(records):.1%} of TTFTs late"
    elif tbt is not None and tbt > TBT_SLO_MS:
        why = f"p99 TBT {tbt:.0f} ms"
    else:
        why = "ok"
    return {"rate": rate, "ok": why == "ok", "why": why, "late_share": late / len(records), "tbt_p99_ms": tbt}


def search(args: tuple) -> dict:
    """One capacity search (a worker process's job): double or halve from
    start_rate until a passing and a failing rate bracket the capacity, then
    bisect geometrically until the bracket is within rel_tol."""
    from testbed.runtime.deployment import num_gpus
    trace, seed, label, family, overrides, start_rate, rel_tol, max_probes, floor_ms = args
    cfg = compose(COMMON + overrides + [f"workload.trace_path={trace}", f"seed={seed}"])
    deadline = TTFTDeadline(cfg, floor_ms * 1e-3)
    probes: list[dict] = []
    lo = hi = None
    rate = start_rate
    while len(probes) < max_probes and (lo is None or hi is None):
        probes.append(probe(cfg, rate, deadline))
        if probes[-1]["ok"]:
            lo, rate = rate, rate * 2
        else:
            hi, rate = rate, rate / 2
    while len(probes) < max_probes and lo is not None and hi is not None and hi / lo - 1 > rel_tol:
        mid = (lo * hi) ** 0.5
        probes.append(probe(cfg, mid, deadline))
        lo, hi = (mid, hi) if probes[-1]["ok"] else (lo, mid)
    gpus = num_gpus(cfg)
    bound = "none" if lo is None else "lower" if hi is None else "bracketed"
    fail = next((p["why"] for p in probes if p["rate"] == hi), "")
    print(f"  {label} seed {seed}: {fmt(lo)} req/s ({len(probes)} probes)", file=sys.stderr, flush=True)
    return {"deployment": label, "family": family, "seed": seed, "num_gpus": gpus, "capacity_rps": lo,
            "capacity_per_gpu": None if lo is None else lo / gpus, "bound": bound, "first_failing_rps": hi,
            "fails_by": fail, "num_probes": len(probes), "probes": probes}


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def best(rows: list[dict], family: str) -> dict | None:
    sel = [r for r in rows if r["family"] == family and r["capacity_per_gpu"] is not None]
    return max(sel, key=lambda r: r["capacity_per_gpu"]) if sel else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/bench_hybrid_capacity")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--requests", type=int, default=1000, help="requests per probe")
    parser.add_argument("--jobs", type=int, default=1, help="searches run in parallel (processes)")
    parser.add_argument("--rel-tol", type=float, default=0.05)
    parser.add_argument("--max-probes", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="five deployments instead of all")
    parser.add_argument("--ttft-floor-ms", type=float, default=250.0, help="the shortest TTFT target (250 ms)")
    parser.add_argument("--schedulers", default="sarathi,sarathi_srpt",
                        help="comma-separated: every deployment is searched with each")
    parser.add_argument("--thresholds", default="4096,16384", help="hybrid.threshold values, comma-separated")
    parser.add_argument("--only", default="", help="comma-separated deployment labels: search just these")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    traces = {seed: out / f"workload_seed{seed}.csv" for seed in (0, 1)}
    stats = {seed: write_workload(path, args.requests, seed) for seed, path in traces.items()}
    start = 2.0 * args.gpus
    searched = deployments(args.gpus, args.quick, tuple(args.schedulers.split(",")),
                           tuple(int(t) for t in args.thresholds.split(",")))
    if args.only:
        searched = [d for d in searched if d[0] in args.only.split(",")]
    jobs = [(str(traces[0]), 0, label, fam, ov, start, args.rel_tol, args.max_probes, args.ttft_floor_ms)
            for label, fam, ov in searched]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(search, jobs))
        # the noise floor: the best deployment of each family on a second draw of the workload
        again = [next(d for d in searched if d[0] == b["deployment"])
                 for b in (best(rows, f) for f in ("colocated", "disaggregated", "hybrid")) if b is not None]
        rows += list(pool.map(search, [(str(traces[1]), 1, label, fam, ov, start, args.rel_tol, args.max_probes,
                                        args.ttft_floor_ms) for label, fam, ov in again]))
    write_csv(out / "capacity.csv", [{k: v for k, v in r.items() if k != "probes"} for r in rows])
    (out / "report.json").write_text(json.dumps({"workload": stats, "ttft_k": TTFT_K, "ttft_floor_ms": args.ttft_floor_ms,
                                                 "tbt_slo_ms": TBT_SLO_MS,
                                                 "rows": rows}, indent=1))
    report(rows, stats[0], args.gpus, args.ttft_floor_ms)


def fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def report(rows: list[dict], stats: dict, gpus: int, floor_ms: float) -> None:
    print(f"workload: {stats['requests']} requests, prompt median {stats['prompt_median']:.0f} mean "
          f"{stats['prompt_mean']:.0f} max {stats['prompt_max']}, {stats['tail_requests']} in the 16K-128K tail "
          f"({stats['tail_share_of_prompt_tokens']:.0%} of prompt tokens); output median {stats['output_median']:.0f}")
    print(f"SLOs: >= 99% of TTFTs within max({floor_ms:g} ms, {TTFT_K:g} x the prompt's whole prefill on one idle "
          f"GPU), p99 TBT <= "
          f"{TBT_SLO_MS:g} ms, all finished; llama3-8b, h100-sxm, rdma-400, simulator, {gpus} GPUs")
    print(f"{'deployment':<28} {'GPUs':>4} {'req/s':>7} {'per GPU':>8}  bound      fails first by")
    for r in rows:
        tag = " (seed 1)" if r["seed"] == 1 else ""
        print(f"{r['deployment'] + tag:<28} {r['num_gpus']:>4} {fmt(r['capacity_rps']):>7} "
              f"{fmt(r['capacity_per_gpu']):>8}  {r['bound']:<10} {r['fails_by'] or '-'}")
    for seed in (0, 1):
        sel = [r for r in rows if r["seed"] == seed]
        col, dis, hyb = best(sel, "colocated"), best(sel, "disaggregated"), best(sel, "hybrid")
        if col and dis and hyb:
            other = max(col, dis, key=lambda r: r["capacity_per_gpu"])
            print(f"seed {seed}: best colocated {col['deployment']} {col['capacity_per_gpu']:.3g}, best disaggregated "
                  f"{dis['deployment']} {dis['capacity_per_gpu']:.3g}, best hybrid {hyb['deployment']} "
                  f"{hyb['capacity_per_gpu']:.3g} req/s per GPU")
            print(f"seed {seed}: hybrid / better of the two ({other['deployment']}): "
                  f"{hyb['capacity_per_gpu'] / other['capacity_per_gpu']:.2f}x (target >= 1.15x)")

if __name__ == "__main__":
    main()
