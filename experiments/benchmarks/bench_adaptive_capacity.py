"""Capacity of `scheduler=adaptive` against sarathi's fixed token budgets, in
the simulator (llama3-8b on h100-sxm, the GPU's KV memory after the weights,
max_num_seqs 256), under p99 TBT SLOs of 50 and 100 ms with a p99 TTFT SLO per
workload; then TTFT p50 and p99 TBT of adaptive and sarathi-512 at a rate
below both capacities.

    python experiments/benchmarks/bench_adaptive_capacity.py [--out DIR] [--jobs N] [--quick] [--only LABEL,...]

Capacity is testbed.capacity.find_capacity's binary search (each probe a
complete run). Prints one table per (workload, TBT SLO): every policy's
capacity in req/s, adaptive over the best fixed budget, and the comparison
below capacity; writes capacity.csv and ttft.csv under --out. Figures and
their reading: experiments/README.md, "adaptive"."""
from __future__ import annotations

import argparse
import csv
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

WORKLOADS = {     # name -> (overrides, p99 TTFT SLO ms, start rate req/s)
    "azure_code": (["workload=azure_code", "workload.max_requests=300", "workload.max_prompt_len=null",
                    "workload.max_output_len=null", "workload.arrival=poisson", "workload.time_scale=1.0"],
                   2000.0, 16.0),
    "chat": (["workload=chat", "workload.num_requests=600"], 500.0, 150.0),
    "long_context": (["workload.name=long_context", "workload.num_requests=60", "workload.arrival=poisson",
                      "workload.prompt_dist=lognormal", "workload.prompt_len=16384", "workload.prompt_sigma=1.2",
                      "workload.prompt_min=1024", "workload.prompt_max=131072", "workload.output_dist=uniform",
                      "workload.output_min=64", "workload.output_max=512"], 20000.0, 0.3),
}
TBT_SLOS_MS = (50.0, 100.0)
POLICIES = [("sarathi-256", 256), ("sarathi-512", 512), ("sarathi-1024", 1024), ("sarathi-2048", 2048),
            ("sarathi-4096", 4096), ("sarathi-auto", "auto"), ("adaptive", None)]
# searched only when --only names it: adaptive without the TTFT rollout (always the largest budget that fits),
# adaptive never deferring the decodes for fresh prompts (adaptive.prefill_first=false, the policy without prefill_first),
# and with the rollout pricing the prompts that arrive meanwhile (adaptive.rollout_arrivals)
EXTRA = [("adaptive-largest", "largest"), ("adaptive-arrivals", "arrivals"), ("adaptive-nopf", "no_prefill_first")]
COMMON = ["runtime=sim", "model=llama3-8b", "hardware=h100-sxm", "max_num_seqs=256", "num_kv_blocks=29206",
          "progress=false", "wandb.mode=disabled"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs
    from testbed.model.config import CONF_DIR
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(hydra_compose("config", overrides))


def policy_overrides(budget) -> list[str]:
    if budget == "largest":
        return ["scheduler=adaptive", "adaptive.ttft_rollout=false"]
    if budget == "arrivals":
        return ["scheduler=adaptive", "adaptive.rollout_arrivals=true"]
    if budget == "no_prefill_first":
        return ["scheduler=adaptive", "adaptive.prefill_first=false"]
    return ["scheduler=adaptive"] if budget is None else ["scheduler=sarathi", f"token_budget={budget}"]


def run_config(workload: str, tbt_ms: float, budget, rate: float):
    overrides, ttft_ms, _ = WORKLOADS[workload]
    cfg = compose(COMMON + overrides + policy_overrides(budget)
                  + [f"slo.ttft_ms={ttft_ms}", f"slo.tpot_ms={tbt_ms}", f"workload.rate={rate}"])
    return cfg


def search(args: tuple) -> dict:
    """One capacity search (a worker process's job)."""
    import contextlib
    import io

    from testbed.capacity import find_capacity
    out, workload, tbt_ms, label, budget, rel_tol, max_probes = args
    cfg = run_config(workload, tbt_ms, budget, WORKLOADS[workload][2])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        res = find_capacity(cfg, Path(out) / "probes" / f"{workload}-tbt{tbt_ms:g}" / label, rel_tol, max_probes,
                            log=lambda *_: None)
    bound = "below_lowest" if res.rate is None else "no_failure" if res.first_failing_rate is None else "found"
    fail = next((p.reason for p in res.probes if p.rate == res.first_failing_rate), "")
    return {"workload": workload, "slo_tbt_ms": tbt_ms, "slo_ttft_ms": WORKLOADS[workload][1], "policy": label,
            "capacity_rps": res.rate, "bound": bound, "first_failing_rps": res.first_failing_rate,
            "fails_by": fail, "num_probes": len(res.probes)}


def below_capacity(args: tuple) -> dict:
    """TTFT p50 and p99 TBT of one policy at `rate`."""
    import contextlib
    import io

    from testbed.run import execute
    out, workload, tbt_ms, label, budget, rate = args
    cfg = run_config(workload, tbt_ms, budget, rate)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        s = execute(cfg, Path(out) / "below" / f"{workload}-tbt{tbt_ms:g}" / label)
    it = s["iterations"]
    return {"workload": workload, "slo_tbt_ms": tbt_ms, "policy": label, "rate": rate,
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"], "tbt_p99_ms": s["tbt_ms"]["p99"],
            "prefill_budget_p50": it.get("prefill_budget", {}).get("p50")}


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/bench_adaptive_capacity")
    parser.add_argument("--jobs", type=int, default=1, help="searches run in parallel (processes)")
    parser.add_argument("--rel-tol", type=float, default=0.1)
    parser.add_argument("--max-probes", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="one workload, one SLO, three policies (a smoke run)")
    parser.add_argument("--below", type=float, default=0.7,
                        help="the TTFT comparison's rate, as a fraction of min(adaptive, sarathi-512) capacity")
    parser.add_argument("--only", default=None,
                        help="comma-separated policy labels to search (default: all of POLICIES); "
                             f"also {', '.join(label for label, _ in EXTRA)}")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads = ["azure_code"] if args.quick else list(WORKLOADS)
    slos = TBT_SLOS_MS[1:] if args.quick else TBT_SLOS_MS
    policies = [POLICIES[1], POLICIES[5], POLICIES[6]] if args.quick else POLICIES
    if args.only:
        known = dict(POLICIES + EXTRA)
        labels = args.only.split(",")
        unknown = [label for label in labels if label not in known]
        if unknown:
            parser.error(f"--only: unknown policy {', '.join(unknown)}; known: {', '.join(known)}")
        policies = [(label, known[label]) for label in labels]
    jobs = [(str(out), w, t, label, b, args.rel_tol, args.max_probes) for w in workloads for t in slos
            for label, b in policies]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(search, jobs))
    write_csv(out / "capacity.csv", rows)
    budgets = dict(POLICIES + EXTRA)
    below_jobs = []
    for w in workloads:
        for t in slos:
            cap = {r["policy"]: r["capacity_rps"] for r in rows if (r["workload"], r["slo_tbt_ms"]) == (w, t)}
            ref = [c for c in (cap.get("adaptive"), cap.get("sarathi-512")) if c]
            if ref:
                below_jobs += [(str(out), w, t, p, budgets[p], args.below * min(ref)) for p in
                               ("sarathi-512", "adaptive", "adaptive-largest", "adaptive-arrivals", "adaptive-nopf") if p in cap]
    with ProcessPoolExecutor(args.jobs) as pool:
        below = list(pool.map(below_capacity, below_jobs))
    if below:
        write_csv(out / "ttft.csv", below)
    report(rows, below, workloads, slos)
    (out / "report.json").write_text(json.dumps({"capacity": rows, "below_capacity": below}, indent=1))


def report(rows: list[dict], below: list[dict], workloads: list[str], slos) -> None:
    print("capacity, req/s (llama3-8b on h100-sxm, simulator; '>' no probed rate failed, '<' none met)")
    for w in workloads:
        for t in slos:
            sel = [r for r in rows if (r["workload"], r["slo_tbt_ms"]) == (w, t)]
            print(f"\n{w}: p99 TBT <= {t:g} ms, p99 TTFT <= {sel[0]['slo_ttft_ms']:g} ms")
            for r in sel:
                mark = {"no_failure": ">", "below_lowest": "<"}.get(r["bound"], " ")
                print(f"  {r['policy']:<17} {mark}{fmt(r['capacity_rps']):>7}   fails by: {r['fails_by'] or '-'}")
            fixed = [r["capacity_rps"] or 0.0 for r in sel if not r["policy"].startswith("adaptive")]
            adaptive = next((r["capacity_rps"] for r in sel if r["policy"] == "adaptive"), None)
            if fixed and max(fixed) > 0 and adaptive:
                best = max((r for r in sel if not r["policy"].startswith("adaptive")),
                           key=lambda r: r["capacity_rps"] or 0.0)
                print(f"  adaptive / best fixed ({best['policy']}): {adaptive / max(fixed):.2f}x")
            for b in (b for b in below if (b["workload"], b["slo_tbt_ms"]) == (w, t)):
                print(f"  at {b['rate']:.3g} req/s: {b['policy']:<17} TTFT p50 {b['ttft_p50_ms']:8.1f} ms  "
                      f"p99 {b['ttft_p99_ms']:8.1f} ms  TBT p99 {b['tbt_p99_ms']:6.1f} ms  "
                      f"prefill budget p50 {fmt(b['prefill_budget_p50'])}")


if __name__ == "__main__":
    main()
