"""The serving engine's host time per iteration (engine.host_model): the
scheduling, input preparation, sampling and output processing a GPU
iteration waits for (or, engine.host_overlap, runs beside), by the batch's
sequences and tokens and the TP degree.

- "linear": engine.overhead_ms + overhead_per_seq_ms · seqs +
  overhead_per_token_ms · tokens, stated or measured by `testbed profile`.
- "vidur-v0": vLLM V0's measured host time (vLLM 2024; schedule, sampler,
  prepare_inputs, process_model_outputs and, for TP > 1, the Ray round trip
  to the TP workers), fitted at first use to the `vidur-profiles` dataset's
  cpu_overheads/a100.csv (vllm_v0_fit.py) and cached in the data directory.
  The rows are decode batches of 8-128 sequences at TP 1, 2 and 4; the fit
  is linear in sequences and log2(TP), so it carries past them.
"""
from __future__ import annotations

from typing import Callable

HostSeconds = Callable[[int, float], float]      # (num_seqs, num_tokens) -> seconds


def linear_host(engine, tp: int) -> HostSeconds:
    base, per_seq, per_token = engine.overhead_ms * 1e-3, engine.overhead_per_seq_ms * 1e-3, \
        engine.overhead_per_token_ms * 1e-3

    def seconds(num_seqs: int, num_tokens: float) -> float:
        return base + per_seq * num_seqs + per_token * num_tokens
    return seconds


def vidur_v0_host(engine, tp: int) -> HostSeconds:
    from testbed.sim.vllm_v0_fit import fitted_host_model
    fit = fitted_host_model(engine.calibration)
    base, per_seq = fit.base_ms(tp) * 1e-3, fit.per_seq_ms(tp) * 1e-3

    def seconds(num_seqs: int, num_tokens: float) -> float:
        return base + per_seq * num_seqs
    return seconds


HOST_MODELS: dict[str, Callable[..., HostSeconds]] = {"linear": linear_host, "vidur-v0": vidur_v0_host}


def host_seconds(engine, tp: int) -> HostSeconds:
    return HOST_MODELS[engine.host_model](engine, tp)
