"""Is the GEMM tables' staircase GPU wave quantisation, and does pricing in
wave space predict a model the tables never saw better than the plain shape
interpolation (table_pricing.py)? A wave: for output tiles tm x tn on S SMs
(132 on H100 SXM, 108 on A100), waves = ceil(ceil(m/tm)·ceil(n/tn)/S).

  --staircase   where the up-steps (> 15% from one profiled m to the next,
                m >= 64) sit: at row-tile boundaries (m crossing a multiple
                of tm) and at wave boundaries (the part that moves with n),
                per candidate tile (64/128/256 each way)
  --waves BETA  leave one model out with the interpolation done on
                seconds / waves^BETA, times the held-out shape's waves^BETA,
                per candidate tile, against the plain model
  --envelope    a wave model fitted on the training models' rows (m >= 64):
                min over the nine tiles of waves x (a + b·k), at least the
                weights over a fitted bandwidth; alone, and as the base the
                interpolation corrects (log(seconds / model) interpolated)

Tiles are fixed a priori (the candidates above), SM counts from the
datasheets; nothing is fitted to a held-out model's rows.

    python experiments/benchmarks/bench_gemm_waves.py [--staircase] [--waves [BETA]] [--envelope]
"""
from __future__ import annotations

import argparse

import numpy as np

from bench_gpu_presets import leave_one_out_errors, load_compute_table, summarize
from testbed.sim.operator_table import GEMM_OPS, gemm_samples
from testbed.sim.table_pricing import TableGemms, _interp, local_loglinear

SMS = {"h100": 132, "a100": 108}       # H100 SXM, A100: streaming multiprocessors
TILES = [(tm, tn) for tm in (64, 128, 256) for tn in (64, 128, 256)]


def waves(m, n, tile: tuple[int, int], sms: int):
    return np.ceil(np.ceil(m / tile[0]) * np.ceil(n / tile[1]) / sms)


class WaveEnvelope:
    """seconds ≈ max(n·k·2 / bandwidth, min over tiles of waves · (a_t + b_t·k)),
    fitted by alternating: assign each row to its cheapest tile, refit each
    tile's (a, b) in relative least squares on its rows."""

    def __init__(self, m, n, k, t, sms: int, iterations: int = 15):
        self.sms = sms
        w = self._waves(m, n)                                              # [rows, tiles]
        b = np.array([tm * tn for tm, tn in TILES], dtype=np.float64)      # equal efficiency to start
        a = np.zeros(len(TILES))
        b *= np.median(t / (w * b[None] * k[:, None]).min(1))
        small = m <= 64
        self.bytes_per_s = float(np.median(n[small] * k[small] * 2 / t[small]))
        for _ in range(iterations):
            best = (w * (a[None] + b[None] * k[:, None])).argmin(1)
            for j in range(len(TILES)):
                rows = best == j
                if rows.sum() < 20:
                    continue
                design = np.column_stack([w[rows, j], w[rows, j] * k[rows]]) / t[rows, None]
                coef = np.linalg.lstsq(design, np.ones(rows.sum()), rcond=None)[0]
                if coef[0] >= 0 and coef[1] > 0:
                    a[j], b[j] = coef
        self.a, self.b = a, b

    def _waves(self, m, n):
        return np.stack([waves(m, n, tile, self.sms) for tile in TILES], axis=1)

    def __call__(self, m, n, k):
        m, n, k = (np.asarray(x, dtype=np.float64) for x in np.broadcast_arrays(m, n, k))
        compute = (self._waves(m, n) * (self.a[None] + self.b[None] * k[:, None])).min(1)
        return np.maximum(compute, n * k * 2 / self.bytes_per_s)


class NormalisedGemms(TableGemms):
    """TableGemms interpolating log(seconds / base(m, n, k)) across shapes and
    multiplying the queried shape's base back: a staircase the base model
    carries, the smooth rest the regression (base 1 below min_m)."""

    def __init__(self, samples, base, min_m: float = 64):
        super().__init__(samples)
        f = self.family
        self._log_base = lambda n, k: np.where(f.grid >= min_m, np.log(base(f.grid, n, k)), 0.0)
        f._y = f._y - np.array([self._log_base(n, k) for n, k in np.exp(f._x)])

    def seconds(self, m: float, n: int, k: int) -> float:
        f, key = self.family, (int(n), int(k))
        if key not in f._cache:
            q = np.log(np.array(key, dtype=np.float64))
            f._cache[key] = np.exp(local_loglinear(f._x, f._y, q, f.bandwidth) + self._log_base(*key))
        return _interp(m, f.grid, f._cache[key])


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
        for tile in TILES:
            row = np.ceil(iv[:, 2] / tile[0]) > np.ceil(iv[:, 1] / tile[0])
            wave = waves(iv[:, 2], iv[:, 0], tile, SMS[gpu]) > waves(iv[:, 1], iv[:, 0], tile, SMS[gpu])
            print(f"    tile {tile[0]:3d}x{tile[1]:3d}: steps at a row-tile boundary {row[up].mean():5.1%} (of all "
                  f"intervals {row.mean():5.1%}), at a wave boundary {wave[up].mean():5.1%} ({wave.mean():5.1%}); "
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
            base = lambda m, n, k, t=tile, s=SMS[gpu]: waves(m, n, t, s) ** beta
            make = lambda samples, b=base: NormalisedGemms(samples, b, min_m=0)
            print(f"  {gpu} tile {tile[0]:3d}x{tile[1]:3d}: {loo_summary(gpu, make)}", flush=True)


def _arrays(samples):
    rows = [s for s in samples if s.m >= 64]
    return tuple(np.array([getattr(s, f) for s in rows], dtype=np.float64) for f in ("m", "n", "k", "seconds"))


def print_envelope() -> None:
    print("wave envelope fitted on the training models (m >= 64): held-out GEMM rows' |error| alone, "
          "then as the interpolation's base")
    for gpu in ("h100", "a100"):
        models = load_compute_table(gpu)
        for held in models:
            train = gemm_samples([m for m in models if m is not held])
            envelope, plain = WaveEnvelope(*_arrays(train), SMS[gpu]), TableGemms(train)
            m, n, k, t = _arrays(gemm_samples([held]))
            e = np.abs(envelope(m, n, k) / t - 1)
            e_plain = np.abs(np.array([plain.seconds(*x) for x in zip(m, n, k)]) / t - 1)
            print(f"  {gpu} {held.name:40s} envelope median {np.median(e):5.1%}, within 15% {np.mean(e <= 0.15):5.1%}"
                  f" | plain median {np.median(e_plain):5.1%}, within 15% {np.mean(e_plain <= 0.15):5.1%}")

        def make(samples, sms=SMS[gpu]):
            return NormalisedGemms(samples, WaveEnvelope(*_arrays(samples), sms))
        print(f"  {gpu} plain model   : {loo_summary(gpu)}", flush=True)
        print(f"  {gpu} envelope base : {loo_summary(gpu, make)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--staircase", action="store_true")
    p.add_argument("--waves", type=float, nargs="?", const=1.0, default=None, metavar="BETA")
    p.add_argument("--envelope", action="store_true")
    args = p.parse_args()
    everything = not (args.staircase or args.envelope or args.waves is not None)
    if args.staircase or everything:
        print_staircase()
    if args.waves is not None or everything:
        print_waves(1.0 if args.waves is None else args.waves)
    if args.envelope or everything:
        print_envelope()


if __name__ == "__main__":
    main()
