"""The engine presets (conf/engine/) side by side, and against the public
measurements they were built from.

  --iterations  per engine preset (testbed, vllm-v0, vllm-v1): one decode
                iteration at batch 1, 8, 32, 128, 256 (1K context each) and
                one prefill of 2K, 8K and 32K tokens, for llama2-7b TP1,
                llama3-8b TP1, llama2-70b TP4 and TP8 on h100-sxm and
                a100-80gb-sxm, split into GPU kernels, collectives and host
                time (ms)
  --v0          engine=vllm-v0's host time against the vidur-profiles
                cpu_overheads rows it was fitted to: in sample and leaving
                each model out (a100, the host the preset uses; a40 shown
                for comparison)
  --replay      engine=vllm-v1 replaying the blis-h100 runs (two vLLM 0.11
                per-request runs from their OpenTelemetry spans, the vLLM
                0.15.1 aggregate runs as nominal traces): mean TTFT, p50 TTFT
                (per-request runs) and mean TPOT, replayed against measured
  --allreduce-grid US,US,...  with --replay: the TP > 1 runs at each
                allreduce_latency_us, in sample (the best over all of them)
                and leaving each run out (the best over the others)

Datasets come from $TESTBED_DATA (testbed.data.dataset_dir).

    python experiments/benchmarks/bench_engine_presets.py [--iterations] [--v0] [--replay [--allreduce-grid ...]
        [--cache FILE]]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from testbed.model.config import load_model_preset
from testbed.sim.config import ParallelConfig, load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.engine_config import load_engine_preset

from testbed.analysis.blis_replay import aggregate_runs, per_request_runs, replay

ENGINES = ("testbed", "vllm-v0", "vllm-v1")
CASES = (("llama2-7b", 1), ("llama3-8b", 1), ("llama2-70b", 4), ("llama2-70b", 8))
HARDWARE = ("h100-sxm", "a100-80gb-sxm")
KERNEL_TERMS = ("gemm_s", "experts_s", "attention_s", "elementwise_s", "lm_head_s")


def iteration_split(cost: CostModel, slices) -> tuple[float, float, float, float]:
    """(GPU kernels, collectives, host time shown, total) of one iteration, ms."""
    b = cost.breakdown(slices)
    kernels = sum(b[k] for k in KERNEL_TERMS)
    collectives = b["allreduce_s"] + b["pp_transfer_s"]
    return kernels * 1e3, collectives * 1e3, b["overhead_s"] * 1e3, b["total_s"] * 1e3


def print_iterations() -> None:
    print("one iteration, ms: kernels + collectives + host (exposed) = total; host_seconds is the engine's whole host time")
    for hw_name in HARDWARE:
        hw = load_hardware_preset(hw_name)
        for model_name, tp in CASES:
            model = load_model_preset(model_name)
            print(f"\n{model_name} TP{tp} on {hw_name}")
            print(f"  {'iteration':<14s}" + "".join(f"{e:>34s}" for e in ENGINES))
            costs = [CostModel(model, hw, ParallelConfig(tp=tp), load_engine_preset(e)) for e in ENGINES]
            shapes = [(f"decode b={b}", [(1, 1024)] * b) for b in (1, 8, 32, 128, 256)] + \
                     [(f"prefill {n // 1024}K", [(n, n)]) for n in (2048, 8192, 32768)]
            for label, slices in shapes:
                cells = []
                for cost in costs:
                    k, c, h, t = iteration_split(cost, slices)
                    cells.append(f"{k:8.2f} +{c:6.2f} +{h:6.2f} ={t:8.2f}")
                print(f"  {label:<14s}" + "".join(f"{c:>34s}" for c in cells))


def print_v0() -> None:
    from testbed.data import dataset_dir
    from testbed.sim.vllm_v0_fit import fit_rows, read_host_rows
    root = dataset_dir("vidur-profiles", needed_by="bench_engine_presets.py --v0")
    for host in ("a100", "a40"):
        rows = read_host_rows(root / "cpu_overheads" / f"{host}.csv")
        fit = fit_rows(rows)
        errors = [fit.host_ms(r.batch_size, r.tp) / r.host_ms - 1 for r in rows]
        print(f"\n{host}: {len(rows)} rows; host_ms = {fit.a:.3f} + {fit.b:.4f}·B + [TP>1]·({fit.c:.3f} + "
              f"{fit.d:.4f}·B + {fit.e:.3f}·log2 TP)")
        print(f"  in sample: max |error| {max(map(abs, errors)):.1%}, rows within 10%: "
              f"{sum(abs(e) < 0.10 for e in errors)}/{len(rows)}")
        for model in sorted({r.model for r in rows}):
            held = [r for r in rows if r.model == model]
            loo = fit_rows([r for r in rows if r.model != model])
            worst = max(abs(loo.host_ms(r.batch_size, r.tp) / r.host_ms - 1) for r in held)
            print(f"  leaving out {model:<40s} ({len(held):2d} rows): max |error| {worst:.1%}")


def _load_cache(path: str | None) -> dict:
    """Replays already done, by (run, allreduce_latency_us), from --cache's JSON lines."""
    results = {}
    if path and Path(path).exists():
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            results[row.pop("run"), row.pop("allreduce_latency_us")] = row
    return results


def print_replay(grid: list[float], cache: str | None = None) -> None:
    engine = load_engine_preset("vllm-v1")
    runs = per_request_runs() + aggregate_runs()[0]
    skipped = aggregate_runs()[1]
    results = _load_cache(cache)
    for run in runs:
        latencies = grid if (grid and run.tp > 1) else [engine.allreduce_latency_us]
        for us in latencies:
            if (run.name, us) not in results:
                with tempfile.TemporaryDirectory() as tmp:
                    got = replay(run, dataclasses.replace(engine, allreduce_latency_us=us), Path(tmp))
                results[run.name, us] = got
                if cache:
                    with open(cache, "a") as f:
                        f.write(json.dumps({"run": run.name, "allreduce_latency_us": us, **got}) + "\n")
            print(f"  replayed {run.name} (allreduce_latency_us={us:g})", file=sys.stderr, flush=True)
    multi = [r for r in runs if r.tp > 1]

    def result(run, us) -> dict:
        # a TP 1 run has no all-reduce: its one replay stands for every latency
        return results[run.name, us if run.tp > 1 and grid else engine.allreduce_latency_us]

    def worst(run, us) -> float:
        got = result(run, us)
        return max(abs(got[k] / v - 1) for k, v in run.measured.items())

    chosen, loo = engine.allreduce_latency_us, {}
    if grid:
        chosen = min(grid, key=lambda us: max(worst(r, us) for r in multi))
        for run in multi:
            loo[run.name] = min(grid, key=lambda us: max(worst(r, us) for r in multi if r is not run))
        print(f"allreduce_latency_us: in sample {chosen:g} (grid {grid}); leaving each TP>1 run out: "
              + ", ".join(f"{k} -> {v:g}" for k, v in loo.items()))
    print(f"\n{'run':<48s}{'TP':>3s}  {'metric':<10s}{'measured':>10s}{'in sample':>18s}{'leave run out':>18s}")
    for run in runs:
        for metric, measured in run.measured.items():
            got = result(run, chosen)[metric]
            out = result(run, loo.get(run.name, chosen))[metric]
            print(f"{run.name:<48s}{run.tp:>3d}  {metric:<10s}{measured:10.2f}{got:10.2f} ({got / measured - 1:+6.1%})"
                  f"{out:10.2f} ({out / measured - 1:+6.1%})")
    for name, why in skipped.items():
        print(f"{name:<48s} not replayed: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", action="store_true")
    parser.add_argument("--v0", action="store_true")
    parser.add_argument("--replay", action="store_true")
    parser.add_argument("--allreduce-grid", default="", help="comma-separated allreduce_latency_us values")
    parser.add_argument("--cache", default=None, help="a JSON lines file keeping each replay's figures")
    args = parser.parse_args()
    if not (args.iterations or args.v0 or args.replay):
        args.iterations = args.v0 = True
    if args.iterations:
        print_iterations()
    if args.v0:
        print_v0()
    if args.replay:
        print_replay([float(x) for x in args.allreduce_grid.split(",") if x], args.cache)


if __name__ == "__main__":
    main()
