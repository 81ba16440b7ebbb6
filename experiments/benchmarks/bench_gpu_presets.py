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
  --staircase   are the GEMM tables' steps wave quantisation? Where the
                up-steps (> 15% from one profiled m to the next, m >= 64) sit:
                at row-tile boundaries (m crossing a multiple of tm) and at
                wave boundaries (ceil(ceil(m/tm)·ceil(n/tn)/SMs) changes,
                the part that moves with n), per candidate tile
  --waves       leave one model out with the GEMM interpolation done on
                wave-normalised time (seconds / waves^beta, times the held-out
                shape's waves), per candidate tile, against the plain model

    python experiments/benchmarks/bench_gpu_presets.py [--loo] [--iterations] [--h200] [--fit-triton]
                                                       [--staircase] [--waves [BETA]]
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
from testbed.sim.operator_table import GEMM_OPS, elementwise_samples, gemm_samples, load_compute_table
from testbed.sim.table_pricing import BANDWIDTH, TableElementwise, TableGemms, _interp, local_loglinear

RESULTS = Path(__file__).resolve().parents[1] / "results"
SMS = {"h100": 132, "a100": 108}       # H100 SXM, A100: streaming multiprocessors
TILES = [(tm, tn) for tm in (64, 128, 256) for tn in (64, 128, 256)]


def waves(m, n: int, tile: tuple[int, int], sms: int):
    return np.ceil(np.ceil(m / tile[0]) * np.ceil(n / tile[1]) / sms)


class WaveGemms(TableGemms):
    """TableGemms interpolating log(seconds / waves^beta) across shapes, then
    multiplying by the queried shape's own waves^beta: the staircase carried
    by the wave count, the smooth rest by the regression."""

    def __init__(self, samples, tile: tuple[int, int], sms: int, beta: float = 1.0):
        super().__init__(samples)
        f = self.family
        self._log_waves = lambda n: beta * np.log(waves(f.grid, n, tile, sms))
        f._y = f._y - np.array([self._log_waves(n) for n in np.exp(f._x[:, 0])])

    def seconds(self, m: float, n: int, k: int) -> float:
        f, key = self.family, (int(n), int(k))
        if key not in f._cache:
            q = np.log(np.array(key, dtype=np.float64))
            f._cache[key] = np.exp(local_loglinear(f._x, f._y, q, f.bandwidth) + self._log_waves(n))
        return _interp(m, f.grid, f._cache[key])


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
          "(ops: 15% at m>=64, 25% below; layer: 10% at every m)")
    for gpu in ("h100", "a100"):
        for pm in load_compute_table(gpu):
            errors = leave_one_out_errors(gpu, pm.name, bandwidth)
            layer = np.abs([x for _, x in errors.pop("layer")])
            print(f"{gpu} {pm.name}: layer median {np.median(layer):.1%} max {layer.max():.1%} "
                  f"within 10% {np.mean(layer <= 0.10):.1%}")
            for op, errs in errors.items():
                big, small = summarize(errs, False), summarize(errs, True)
                print(f"    {op:26s} m>=64 {big[0]:6.1%} {big[1]:6.1%} {big[2]:6.1%}   "
                      f"m<64 {small[0]:6.1%} {small[1]:6.1%} {small[2]:6.1%}")


def gemm_curves(gpu: str):
    """(n, m [ascending, >= 64], median seconds) of every profiled (model, GEMM op, TP)."""
    for pm in load_compute_table(gpu):
        for op in GEMM_OPS:
            for tp in sorted({t for _, t, _ in pm.rows}):
                pts = [(m, ops[op]) for m, t, ops in pm.rows if t == tp and op in ops and m >= 64]
                ms = np.array(sorted({m for m, _ in pts}))
                ts = np.array([np.median([t for mm, t in pts if mm == m]) for m in ms])
                yield pm.gemm_shape(op, tp)[0], ms, ts


def print_staircase() -> None:
    print("GEMM up-steps (> 15% from one profiled m to the next, m >= 64): where they sit")
    for gpu in ("h100", "a100"):
        # one row per pair of neighbouring profiled m: (n, m0, m1, t1 / t0)
        iv = np.array([(n, ms[i], ms[i + 1], ts[i + 1] / ts[i])
                       for n, ms, ts in gemm_curves(gpu) for i in range(len(ms) - 1)])
        up = iv[:, 3] > 1.15
        print(f"  {gpu} ({SMS[gpu]} SMs): {up.sum()} up-steps in {len(iv)} intervals")
        for tm, tn in TILES:
            row = np.ceil(iv[:, 2] / tm) > np.ceil(iv[:, 1] / tm)
            wave = waves(iv[:, 2], iv[:, 0], (tm, tn), SMS[gpu]) > waves(iv[:, 1], iv[:, 0], (tm, tn), SMS[gpu])
            print(f"    tile {tm:3d}x{tn:3d}: steps at a row-tile boundary {row[up].mean():5.1%} (of all intervals "
                  f"{row.mean():5.1%}), at a wave boundary {wave[up].mean():5.1%} ({wave.mean():5.1%}); "
                  f"row-tile boundaries that step: with a wave change {up[row & wave].mean():5.1%}, "
                  f"without {up[row & ~wave].mean():5.1%}")


def loo_summary(gpu: str, make_gemms=None) -> str:
    rows = []
    for pm in load_compute_table(gpu):
        errors = leave_one_out_errors(gpu, pm.name, make_gemms=make_gemms)
        layer = np.abs([x for _, x in errors["layer"]])
        big = [summarize(errors[op], False) for op in GEMM_OPS]
        rows.append((np.median(layer), layer.max(), np.mean(layer <= 0.10), max(b[0] for b in big)))
    v = np.array(rows)
    return (f"layer median {np.median(v[:, 0]):.1%}, worst row {v[:, 1].max():.1%} (mean of the models' worst "
            f"{v[:, 1].mean():.1%}), within 10% {v[:, 2].min():.1%}-{v[:, 2].max():.1%}; "
            f"worst GEMM-op median at m>=64 {v[:, 3].max():.1%}")


def print_waves(beta: float) -> None:
    print(f"leave-one-model-out with wave-normalised GEMM interpolation (waves^{beta})")
    for gpu in ("h100", "a100"):
        print(f"  {gpu} plain model : {loo_summary(gpu)}", flush=True)
        for tile in TILES:
            make = lambda samples, t=tile: WaveGemms(samples, t, SMS[gpu], beta)
            print(f"  {gpu} tile {tile[0]:3d}x{tile[1]:3d}: {loo_summary(gpu, make)}", flush=True)


def roofline_of(hardware):
    """The same preset priced as before the tables: roofline GEMMs and attention, ring all-reduce."""
    return dataclasses.replace(hardware, gemm_table="", allreduce_table="", attention_kernel="",
                               kernel_launch_us=0.0, cuda_graphs=False)


def print_iterations() -> None:
    hw = load_hardware_preset("h100-sxm")
    print("one iteration on h100-sxm, ms: tables (gemm + elementwise + attention + all-reduce + overhead) | old roofline")
    for model, tp in (("llama2-70b", 8), ("llama3-8b", 1)):
        cfg, par = load_model_preset(model), ParallelConfig(tp=tp)
        new, old = CostModel(cfg, hw, par), CostModel(cfg, roofline_of(hw), par)
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
    new, old = CostModel(model, hw), CostModel(model, roofline_of(hw))
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
    p.add_argument("--staircase", action="store_true")
    p.add_argument("--waves", type=float, nargs="?", const=1.0, default=None, metavar="BETA")
    args = p.parse_args()
    everything = not (args.loo or args.iterations or args.h200 or args.fit_triton or args.staircase
                      or args.waves is not None)
    if args.staircase:
        print_staircase()
    if args.waves is not None:
        print_waves(args.waves)
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
