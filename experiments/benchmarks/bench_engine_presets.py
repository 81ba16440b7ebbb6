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
                and, per load stage of the aggregate runs, mean TTFT and TPOT
  --grid FIELD=V1,V2,...  with --replay: the runs FIELD affects replayed
                at each value of that engine field, in sample (the value
                best over all of them) and leaving each run out (the best
                over the others); --allreduce-grid US,... is
                --grid allreduce_latency_us=US,...
  --fit-metrics METRIC,...  with --grid: judge each value by the worst
                of these metrics only (ttft_mean, ttft_p50, tpot_mean);
                default all of a run's
  --set FIELD=VALUE  with --replay: an engine field for every replay
  --operating-points  each vLLM 0.15.1 run's load stages priced at the
                operating point the run measured (Little's law), apart
                from the replay's queueing

Datasets come from $TESTBED_DATA (testbed.data.dataset_dir).

    python experiments/benchmarks/bench_engine_presets.py [--iterations] [--v0] [--operating-points]
        [--replay [--grid FIELD=V,... | --allreduce-grid US,...] [--fit-metrics M,...] [--set FIELD=VALUE ...]
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
METRICS = ("ttft_mean", "ttft_p50", "tpot_mean")   # what a replay is judged by (Run.measured)


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


def _key(run_name: str, overrides: dict) -> str:
    return json.dumps({"run": run_name, **overrides}, sort_keys=True)


def _load_cache(path: str | None) -> dict[str, dict]:
    """Replays already done, by run and engine overrides, from --cache's JSON lines."""
    results = {}
    if path and Path(path).exists():
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            results[_key(row.pop("run"), row.pop("engine"))] = row
    return results


def _affects(field: str, run) -> bool:
    """Whether `field` can change `run`'s replay (a TP 1 run has no all-reduce)."""
    return run.tp > 1 or field != "allreduce_latency_us"


def _engine_value(engine, field: str, text: str):
    kind = type(getattr(engine, field))
    return text.lower() in ("1", "true", "yes") if kind is bool else kind(text)


def print_replay(grid: tuple[str, list[float]] | None, base: dict, cache: str | None = None,
                 fit_metrics: tuple[str, ...] = ()) -> None:
    """The replay table: in sample (the grid value best over the runs it
    affects, by the worst of their metrics, or of `fit_metrics` alone) and
    leaving each run out (the value best over the others), then each run's
    load stages."""
    engine = load_engine_preset("vllm-v1")
    runs = per_request_runs() + aggregate_runs()[0]
    skipped = aggregate_runs()[1]
    results = _load_cache(cache)
    field, values = grid if grid else ("", [])

    def overrides(run, value) -> dict:
        return {**base, field: value} if field and _affects(field, run) else dict(base)

    def result(run, value) -> dict:
        key = _key(run.name, overrides(run, value))
        if key not in results:
            with tempfile.TemporaryDirectory() as tmp:
                results[key] = replay(run, dataclasses.replace(engine, **overrides(run, value)), Path(tmp))
            if cache:
                with open(cache, "a") as f:
                    f.write(json.dumps({"run": run.name, "engine": overrides(run, value), **results[key]}) + "\n")
            print(f"  replayed {run.name} {overrides(run, value)}", file=sys.stderr, flush=True)
        return results[key]

    def worst(run, value) -> float:
        got = result(run, value)
        return max((abs(got[k] / v - 1) for k, v in run.measured.items() if not fit_metrics or k in fit_metrics),
                   default=0.0)

    chosen, loo = None, {}
    if field:
        affected = [r for r in runs if _affects(field, r)]
        chosen = min(values, key=lambda v: max(worst(r, v) for r in affected))
        for run in affected:
            loo[run.name] = min(values, key=lambda v: max(worst(r, v) for r in affected if r is not run))
        judged = f", judged by {', '.join(fit_metrics)}" if fit_metrics else ""
        print(f"{field}: in sample {chosen:g} (grid {values}, with {base}{judged}); leaving each run out: "
              + ", ".join(f"{k} -> {v:g}" for k, v in loo.items()))
    elif base:
        print(f"engine overrides: {base}")
    print(f"\n{'run':<48s}{'TP':>3s}  {'metric':<10s}{'measured':>10s}{'in sample':>18s}{'leave run out':>18s}")
    for run in runs:
        for metric, measured in run.measured.items():
            got = result(run, chosen)[metric]
            out = result(run, loo.get(run.name, chosen))[metric]
            print(f"{run.name:<48s}{run.tp:>3d}  {metric:<10s}{measured:10.2f}{got:10.2f} ({got / measured - 1:+6.1%})"
                  f"{out:10.2f} ({out / measured - 1:+6.1%})")
    for name, why in skipped.items():
        print(f"{name:<48s} not replayed: {why}")
    print("\nper load stage (in sample), ms: measured / replayed")
    print(f"{'run':<48s}{'stage':>6s}{'req/s':>7s}{'TTFT':>24s}{'TPOT':>24s}")
    for run in runs:
        got = result(run, chosen)
        for i, stage in enumerate(run.stages):
            cells = [f"{stage[k]:7.2f} / {got[f'stage{i}_{k}']:7.2f} ({got[f'stage{i}_{k}'] / stage[k] - 1:+6.1%})"
                     for k in ("ttft_mean", "tpot_mean")]
            print(f"{run.name:<48s}{i:>6d}{stage['rate']:7.1f}" + "".join(f"{c:>24s}" for c in cells))


def print_operating_points() -> None:
    """Each vLLM 0.15.1 run's load stages priced at the operating point the run
    measured, without a replay's queueing: N = rate x mean E2E sequences in
    flight (Little's law) at the mean context, one decode iteration of them,
    and the time one prompt's uncached tokens add to an iteration. A steady
    server then spends rate x that share of its time on prompts, so
    TPOT ~ decode / (1 - rate x prompt). Where this is near the measured TPOT
    and the replay is not, the replay's error is queueing; where it is off,
    the iteration's price is. The last column is the measured TTFT less the
    priced iteration that carries the prompt, in measured TPOTs: the wait
    before that iteration (half an iteration where a scheduler admits a
    request at the next iteration, about one more where it schedules one
    iteration ahead) and the server's own per-request time."""
    engine, hw = load_engine_preset("vllm-v1"), load_hardware_preset("h100-sxm")
    print("\noperating points, ms: decode = one iteration of N decodes; prompt = what one prompt adds")
    print(f"{'run':<48s}{'stage':>6s}{'N':>6s}{'ctx':>6s}{'decode':>8s}{'prompt':>8s}{'prompt share':>13s}"
          f"{'TPOT measured':>15s}{'priced':>18s}{'TTFT wait':>11s}")
    for run in aggregate_runs()[0]:
        cost = CostModel(load_model_preset(run.model), hw, ParallelConfig(tp=run.tp), engine)
        # prompt_len_mean may read "573 (nominal)"
        prompt, output = float(run.spec["prompt_len_mean"].split()[0]), float(run.spec["output_len_mean"])
        cached = int(run.spec["sys_prompt_len"]) // engine.block_size * engine.block_size
        ctx, new = int(prompt + output / 2), int(prompt) - cached
        for i, stage in enumerate(run.stages):
            n = max(1, round(stage["rate"] * stage["e2e_mean"] / 1e3))
            decode = cost.iteration_time_s([(1, ctx)] * n) * 1e3
            added = cost.iteration_time_s([(1, ctx)] * n + [(new, int(prompt))]) * 1e3 - decode
            share = stage["rate"] * added / 1e3
            priced = decode / (1 - share) if share < 1 else float("inf")
            wait = (stage["ttft_mean"] - decode - added) / stage["tpot_mean"]
            print(f"{run.name:<48s}{i:>6d}{n:>6d}{ctx:>6d}{decode:8.2f}{added:8.2f}{share:13.2f}"
                  f"{stage['tpot_mean']:15.2f}{priced:10.2f} ({priced / stage['tpot_mean'] - 1:+6.1%}){wait:11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", action="store_true")
    parser.add_argument("--v0", action="store_true")
    parser.add_argument("--replay", action="store_true")
    parser.add_argument("--operating-points", action="store_true")
    parser.add_argument("--grid", default="", help="FIELD=V1,V2,...: an engine field's values to replay")
    parser.add_argument("--allreduce-grid", default="", help="US,US,...: --grid allreduce_latency_us=US,US,...")
    parser.add_argument("--fit-metrics", default="",
                        help="METRIC,...: with --grid, judge each value by these metrics alone (e.g. tpot_mean)")
    parser.add_argument("--set", action="append", default=[], help="FIELD=VALUE: an engine field for every replay")
    parser.add_argument("--cache", default=None, help="a JSON lines file keeping each replay's figures")
    args = parser.parse_args()
    if not (args.iterations or args.v0 or args.replay or args.operating_points):
        args.iterations = args.v0 = True
    if args.iterations:
        print_iterations()
    if args.v0:
        print_v0()
    if args.replay:
        engine = load_engine_preset("vllm-v1")
        grid_text = args.grid or (f"allreduce_latency_us={args.allreduce_grid}" if args.allreduce_grid else "")
        grid = None
        if grid_text:
            field, _, values = grid_text.partition("=")
            grid = (field, [_engine_value(engine, field, v) for v in values.split(",") if v])
        base = {f: _engine_value(engine, f, v) for f, _, v in (o.partition("=") for o in args.set)}
        fit_metrics = tuple(m for m in args.fit_metrics.split(",") if m)
        unknown = set(fit_metrics) - set(METRICS)
        if unknown:
            parser.error(f"--fit-metrics: {', '.join(sorted(unknown))} not among {', '.join(METRICS)}")
        print_replay(grid, base, args.cache, fit_metrics)
    if args.operating_points:
        print_operating_points()


if __name__ == "__main__":
    main()
