"""GEMM seconds as the real engine meets them: every nn.Linear of the model
timed inside real engine steps, by (rows, out_features, in_features).

Why not F.linear alone, called again and again on one weight: there the
weight stays in cache, which in a forward pass it does not (between two
calls on a layer's weight the engine runs every other layer, the attention
and the sampling). Priced from an isolated table the difference would fall
to the fitted overhead, one number for every batch that cannot follow how
it changes with m; measured in the engine, the table carries it.

A token count m is a step of m decodes (contexts spread over 64..512, as in
serving) while m <= MAX_DECODE_BATCH, else a whole prefill of m tokens; lm_head
then runs on one row, so its rows stop at MAX_DECODE_BATCH and the cost model
extends them linearly. Each round steps every shape BURST times in a row, as
serving repeats a batch, and times all but the first (which follows another
shape). A shape gets as many rounds as it takes to reach `min_time_s` of
GEMM time (MIN_ROUNDS at least), spread evenly over the whole measurement
(spread_rounds), and a row is the median over the steps of the per-call
time, so whatever else runs on the machine spreads over all shapes alike.
The measurements behind these choices are in experiments/README.md
("Calibration notes")."""
from __future__ import annotations

import math
import time
from collections import defaultdict

import numpy as np
import torch

from testbed.model.config import ModelConfig
from testbed.model.loader import load_model
from testbed.request import Request
from testbed.profiling.calibration import decode_service, profiling_service
from testbed.progress import progress

MAX_DECODE_BATCH = 64
MIN_ROUNDS = 3
MAX_ROUNDS = 100      # a decode batch's contexts grow by one token a step; its blocks hold 512 more
BURST = 4             # steps of a shape in a row; the first is not timed


class _LinearTimer:
    """Forward hooks on every nn.Linear: seconds per (rows, n, k), summed until taken."""

    def __init__(self, model: torch.nn.Module):
        self.totals: dict[tuple[int, int, int], float] = defaultdict(float)
        self.calls: dict[tuple[int, int, int], int] = defaultdict(int)
        self._t0 = 0.0
        self._handles = []
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                self._handles.append(mod.register_forward_pre_hook(self._start))
                self._handles.append(mod.register_forward_hook(self._stop))

    def _start(self, _mod, _args) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, mod, args, _out) -> None:
        key = (args[0].shape[0], mod.out_features, mod.in_features)
        self.totals[key] += time.perf_counter() - self._t0
        self.calls[key] += 1

    def take(self) -> dict[tuple[int, int, int], tuple[float, int]]:
        out = {key: (self.totals[key], self.calls[key]) for key in self.totals}
        self.totals.clear()
        self.calls.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def spread_rounds(needs: dict[int, int]) -> list[list[int]]:
    """The shapes each round steps, when shape m needs `needs[m]` rounds:
    as many rounds as the most needed, every shape in the first and the last,
    each shape's rounds spread evenly in between."""
    total = max(needs.values())
    return [[m for m, n in needs.items()
             if r == 0 or r * (n - 1) // (total - 1) > (r - 1) * (n - 1) // (total - 1)] for r in range(total)]


def measure_engine_gemms(model: ModelConfig, token_counts: list[int], min_time_s: float) -> list[list[float]]:
    """Rows [m, n, k, seconds per call] for every GEMM shape of `model` at
    each of `token_counts`, timed inside real engine steps (module docstring)."""
    weights, _ = load_model(model)
    timer = _LinearTimer(weights)
    try:
        seq = [0]

        def prompt(length: int) -> list[int]:
            seq[0] += 1
            return [(7 * seq[0] + i) % model.vocab_size for i in range(length)]

        decoders = {m: decode_service(model, m, weights, prompt)[0] for m in token_counts if m <= MAX_DECODE_BATCH}
        prefillers = {m: profiling_service(model, m // 16 + 8, m, weights=weights)[0]
                      for m in token_counts if m > MAX_DECODE_BATCH}
        timer.take()                                    # the decoders' prompts and warm-up steps
        samples: dict[tuple[int, int, int], list[float]] = defaultdict(list)
        spent = dict.fromkeys(token_counts, 0.0)

        def burst(m: int) -> None:
            for i in range(BURST):
                if m in decoders:
                    decoders[m].step()
                else:
                    seq[0] += 1
                    prefillers[m].engine.add_request(Request(f"g{seq[0]}", prompt(m), max_tokens=1))
                    prefillers[m].step()
                taken = timer.take()
                if not i:
                    continue          # the first step of a burst follows another shape's
                for key, (total, calls) in taken.items():
                    samples[key].append(total / calls)
                    spent[m] += total

        for m in token_counts:        # round 0 tells how many rounds each shape needs
            burst(m)
        needs = {m: min(MAX_ROUNDS, max(MIN_ROUNDS, math.ceil(min_time_s / max(spent[m], 1e-9))))
                 for m in token_counts}
        rounds = spread_rounds(needs)[1:]
        for shapes in progress(rounds, total=len(rounds), desc="GEMM rounds", unit="round"):
            for m in shapes:
                burst(m)
        rows = [[float(m), float(n), float(k), float(np.median(secs))] for (m, n, k), secs in samples.items()]
    finally:
        timer.remove()
    rows.sort(key=lambda r: (r[1], r[2], r[0]))
    return rows
