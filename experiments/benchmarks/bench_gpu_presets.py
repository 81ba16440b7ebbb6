"""How well the GPU presets' table-priced cost model predicts what was measured.

  --loo         leave one model out: for each profiled model on h100 and a100,
                the tables without it predict its rows; error per op and for
                the whole layer (the sum of its ops but the embedding)
  --iterations  one decode iteration (batch 1/16/64/256 at 1K context) and one
                prefill (2K/8K/32K) on llama2-70b TP8 and llama3-8b TP1,
                h100-sxm, against the same preset priced by the old roofline
  --h200        the h200 preset against experiments/results/h200_prefill.csv
                (llama3-8b, Triton backend, whole and chunked prefills)
  --fit-triton  the triton kernel's peak_fraction, q_half, ctx_half fitted to
                those rows (attention_kernels.py carries the result)

  (whether the GEMM tables' steps are wave quantisation: bench_gemm_waves.py)

    python experiments/benchmarks/bench_gpu_presets.py [--loo] [--iterations] [--h200] [--fit-triton]
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
from pathlib import Path

import numpy as np

from testbed.model.config import load_model_preset
from testbed.sim.attention_kernels import KERNELS
from testbed.sim.config import ParallelConfig, load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.operator_table import GEMM_OPS, elementwise_samples, gemm_samples, tables_dir
from testbed.sim.operator_table import load_compute_table as load_table
from testbed.sim.engine_config import EngineConfig
from testbed.sim.table_pricing import BANDWIDTH, TableElementwise, TableGemms

RESULTS = Path(__file__).resolve().parents[1] / "results"


def load_compute_table(gpu: str):
    """A GPU table of the vidur-profiles dataset (`testbed data fetch vidur-profiles`)."""
    return load_table(tables_dir("vidur-profiles", needed_by="bench_gpu_presets"), gpu)


def leave_one_out_errors(gpu: str, held_name: str, bandwidth: float = BANDWIDTH,
                         make_gemms=None) -> dict[str, list[tuple[int, float]]]:
    """{op or 'layer': [(num_tokens, predicted / measured - 1), ...]} for one held-out model."""
    models = load_compute_table(gpu)
    held = next(m for m in models if m.name == held_name)
    train = [m for m in models if m.name != held_name]
    gemms = make_gemms(gemm_samples(train)) if make_gemms else TableGemms(gemm_samples(train), bandwidth)
    elementwise = TableElementwise(elementwise_samples(train), bandwidth)
    errors: dict[str, list[tuple[int, float]]] = {}
    for m, tp, ops in held.rows:
        predicted_layer = measured_layer = 0.0
        for op, measured in ops.items():
            if op in GEMM_OPS:
                predicted = gemms.seconds(m, *held.gemm_shape(op, tp))
            else:
                predicted = elementwise.seconds(op, m, held.elementwise_width(op, tp), held.elementwise_kernel(op))
            errors.setdefault(op, []).append((m, predicted / measured - 1))
            if op != "emb":
                predicted_layer += predicted
                measured_layer += measured
        errors.setdefault("layer", []).append((m, predicted_layer / measured_layer - 1))
    return errors


def summarize(errs: list[tuple[int, float]], small: bool) -> tuple[float, float, float]:
    """(median |error|, max |error|, fraction within the target) over m < 64 or m >= 64."""
    e = np.abs([x for m, x in errs if (m < 64) == small])
    if len(e) == 0:
        return float("nan"), float("nan"), float("nan")
    return float(np.median(e)), float(e.max()), float((e <= (0.25 if small else 0.15)).mean())


def print_loo(bandwidth: float) -> None:
    print(f"leave-one-model-out, kernel width {bandwidth}: |error| median / max / share within target "
          "(ops: 15% at m>=64, 25% below; layer: 10% at every m); "
          "[bytes]: a kernel no other model ran, priced by the bytes it moves")
    for gpu in ("h100", "a100"):
        models = load_compute_table(gpu)
        for pm in models:
            seen = {s.kernel for s in elementwise_samples([m for m in models if m is not pm])}
            errors = leave_one_out_errors(gpu, pm.name, bandwidth)
            layer = np.abs([x for _, x in errors.pop("layer")])
            print(f"{gpu} {pm.name}: layer median {np.median(layer):.1%} max {layer.max():.1%} "
                  f"within 10% {np.mean(layer <= 0.10):.1%}")
            for op, errs in errors.items():
                big, small = summarize(errs, False), summarize(errs, True)
                bytes_priced = op not in GEMM_OPS and pm.elementwise_kernel(op) not in seen
                print(f"    {op:26s} m>=64 {big[0]:6.1%} {big[1]:6.1%} {big[2]:6.1%}   "
                      f"m<64 {small[0]:6.1%} {small[1]:6.1%} {small[2]:6.1%}"
                      + (f"   [bytes: {pm.elementwise_kernel(op)}]" if bytes_priced else ""))


# the hardware's pricing alone: no engine terms, the hardware's attention kernel
BARE_ENGINE = EngineConfig(name="bare")


def roofline_of(hardware):
    """The same preset priced as before the tables: roofline GEMMs and attention, ring all-reduce."""
    return dataclasses.replace(hardware, gemm_table="", allreduce_table="", attention_kernel="")


def print_iterations() -> None:
    hw = load_hardware_preset("h100-sxm")
    print("one iteration on h100-sxm, ms: tables (gemm + elementwise + attention + all-reduce + overhead) | old roofline")
    for model, tp in (("llama2-70b", 8), ("llama3-8b", 1)):
        cfg, par = load_model_preset(model), ParallelConfig(tp=tp)
        new, old = CostModel(cfg, hw, par, BARE_ENGINE), CostModel(cfg, roofline_of(hw), par, BARE_ENGINE)
        cases = [(f"decode x{b} @1K", [(1, 1024)] * b) for b in (1, 16, 64, 256)]
        cases += [(f"prefill {n // 1024}K", [(n, n)]) for n in (2048, 8192, 32768)]
        for name, slices in cases:
            b = new.breakdown(slices)
            parts = " ".join(f"{k[:-2]} {b[k] * 1e3:.2f}" for k in ("gemm_s", "elementwise_s", "attention_s",
                                                                     "allreduce_s", "lm_head_s", "overhead_s"))
            print(f"  {model} tp{tp} {name:16s} {b['total_s'] * 1e3:9.2f} | {old.iteration_time_s(slices) * 1e3:9.2f}"
                  f"   ({parts})")


def h200_rows() -> list[dict]:
    with (RESULTS / "h200_prefill.csv").open() as f:
        return [r for r in csv.DictReader(f) if r["backend"] == "triton" and r["status"] == "ok"]


def prefill_slices(prompt: int, chunk: int) -> list[list[tuple[int, int]]]:
    """The iterations of one prompt alone: whole (chunk 0) or in chunks."""
    if chunk == 0:
        return [[(prompt, prompt)]]
    return [[(min(chunk, prompt - start), min(start + chunk, prompt))] for start in range(0, prompt, chunk)]


def print_h200() -> None:
    hw, model = load_hardware_preset("h200"), load_model_preset("llama3-8b")
    new, old = CostModel(model, hw, engine=BARE_ENGINE), CostModel(model, roofline_of(hw), engine=BARE_ENGINE)
    print("h200 llama3-8b prefill, TTFT ms: measured | preset (error) | old roofline (error)")
    for r in h200_rows():
        prompt, chunk, measured = int(r["prompt_len"]), int(r["chunk"]), float(r["ttft_s"]) * 1e3
        its = prefill_slices(prompt, chunk)
        t_new = sum(new.iteration_time_s(s) for s in its) * 1e3
        t_old = sum(old.iteration_time_s(s) for s in its) * 1e3
        print(f"  {prompt:>7} C={chunk:<5} {measured:9.1f} | {t_new:9.1f} ({t_new / measured - 1:+.1%}) | "
              f"{t_old:9.1f} ({t_old / measured - 1:+.1%})")


def fit_triton() -> None:
    hw, model = load_hardware_preset("h200"), load_model_preset("llama3-8b")
    cost = CostModel(model, hw)
    shape, layers = cost.shapes.attention, cost.shapes.num_layers
    rows = []
    for r in h200_rows():
        its = prefill_slices(int(r["prompt_len"]), int(r["chunk"]))
        rest = sum(cost.breakdown(s)["total_s"] - cost.breakdown(s)["attention_s"] for s in its)
        q = np.array([s[0][0] for s in its], dtype=np.float64)
        ctx = np.array([s[0][1] for s in its], dtype=np.float64)
        rows.append((float(r["ttft_s"]), rest, q, ctx, shape.flops(q, ctx) * layers))
    peak = hw.peak_flops(model.dtype)
    best = None
    for q_half, ctx_half in itertools.product((0, 4, 8, 16, 32, 64, 128, 256), (0, 64, 128, 256, 512, 1024, 2048)):
        # at fixed ramps the rows' attention is (Σ flops / eff) / (peak · pf): least squares in relative error over pf
        work = np.array([(f / (q / (q + q_half) * ctx / (ctx + ctx_half))).sum() / peak for _, _, q, ctx, f in rows])
        measured, rest = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
        inv_pf = np.linspace(1 / 0.9, 1 / 0.1, 4000)
        err = np.array([np.abs((rest + work * x) / measured - 1).max() for x in inv_pf])
        i = int(np.argmin(err))
        if best is None or err[i] < best[0]:
            best = (err[i], 1 / inv_pf[i], q_half, ctx_half)
    print(f"triton fit (minimax relative TTFT error over {len(rows)} rows): peak_fraction {best[1]:.3f} "
          f"q_half {best[2]} ctx_half {best[3]} -> worst row {best[0]:.1%} "
          f"(attention_kernels.py has {KERNELS['triton'].peak_fraction['h100']}, "
          f"{KERNELS['triton'].q_half}, {KERNELS['triton'].ctx_half})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loo", action="store_true")
    p.add_argument("--bandwidth", type=float, nargs="*", default=[BANDWIDTH])
    p.add_argument("--iterations", action="store_true")
    p.add_argument("--h200", action="store_true")
    p.add_argument("--fit-triton", action="store_true")
    args = p.parse_args()
    everything = not (args.loo or args.iterations or args.h200 or args.fit_triton)
    if args.fit_triton:
        fit_triton()
    if args.loo or everything:
        for bw in args.bandwidth:
            print_loo(bw)
    if args.iterations or everything:
        print_iterations()
    if args.h200 or everything:
        print_h200()


if __name__ == "__main__":
    main()
