"""build_workload: WorkloadConfig -> the list of Requests a run serves.

Arrival times, prompt lengths and output lengths each come from a synthetic
policy (arrivals.py, lengths.py) or from a trace (readers.py), chosen per
field by the config; injected requests are added; `max_prompt_len` and
`max_output_len` clip; requests are sorted by arrival and named r0, r1, ...
Prompts are lazy SyntheticTokens (tokens.py) unless the trace gives exact ids.

Each concern draws from its own random stream derived from the seed, so
changing the arrival process does not change the lengths, and vice versa.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from testbed.request import Request
from testbed.workloads.arrivals import make_arrivals
from testbed.workloads.config import WorkloadConfig
from testbed.workloads.lengths import make_lengths
from testbed.workloads.multiturn import multiturn_rows
from testbed.workloads.readers import TraceRow, read_trace
from testbed.workloads.tokens import hash_id_uses, private_from, synthesize_prompt

_ARRIVAL_STREAM, _PROMPT_STREAM, _OUTPUT_STREAM = 0, 1, 2


def _trace_arrivals(cfg: WorkloadConfig, rows: list[TraceRow]) -> np.ndarray:
    missing = [r.line for r in rows if r.arrival_s is None]
    if missing:
        raise ValueError(f"workload.arrival: trace {cfg.resolved_trace_path()}:{missing[0]} has no "
                         f"arrival time ({len(missing)} such lines); add arrival_s or choose a "
                         "synthetic arrival process")
    times = np.array([r.arrival_s for r in rows], dtype=np.float64)
    return times - times.min()


def _lengths(cfg: WorkloadConfig, side: str, rows: list[TraceRow] | None, n: int,
             rng: np.random.Generator) -> np.ndarray:
    if getattr(cfg, f"{side}_dist") == "trace":
        field = "prompt_len" if side == "prompt" else "output_len"
        return np.array([getattr(r, field) for r in rows], dtype=np.int64)
    return make_lengths(cfg, side).sample(rng, n)


def build_workload(cfg: WorkloadConfig, vocab_size: int, seed: int) -> list[Request]:
    """The workload's requests, sorted by arrival_s (seconds from the first
    request), ids r0, r1, ... in that order; the same for the same seed."""
    return list(iter_workload(cfg, vocab_size, seed))


def iter_workload(cfg: WorkloadConfig, vocab_size: int, seed: int) -> Iterator[Request]:
    """build_workload's requests, one at a time in arrival order: the draws
    (arrival times and lengths, a few numbers per request) are made up front,
    each Request and its lazy prompt only when the consumer reaches it, so a
    1M-request simulation never holds the workload. Its checks run at the
    call, before the first request is asked for."""
    cfg.validate()
    if vocab_size < 1:
        raise ValueError(f"build_workload: vocab_size={vocab_size} must be >= 1")
    if seed < 0:
        raise ValueError(f"seed: must be >= 0, got {seed}")
    rngs = [np.random.default_rng([seed, stream]) for stream in (_ARRIVAL_STREAM, _PROMPT_STREAM, _OUTPUT_STREAM)]

    rows = read_trace(cfg, vocab_size) if cfg.uses_trace else None
    if cfg.conversation_turns:
        return iter(_requests_of_rows(multiturn_rows(cfg, rngs), vocab_size, seed, cfg))
    if rows is not None:
        n = len(rows)
        if cfg.prompt_dist != "trace" and any(r.prompt_token_ids is not None for r in rows):
            raise ValueError(f"workload.prompt_dist: {cfg.resolved_trace_path()} gives exact "
                             "prompt_token_ids; set prompt_dist: trace to replay them")
    else:
        n = cfg.num_requests if cfg.max_requests is None else min(cfg.num_requests, cfg.max_requests)

    if cfg.arrival == "trace":
        arrivals = _trace_arrivals(cfg, rows)
    else:
        arrivals = make_arrivals(cfg).times(rngs[_ARRIVAL_STREAM], n)
    arrivals = arrivals * cfg.time_scale
    prompt_lens = _lengths(cfg, "prompt", rows, n, rngs[_PROMPT_STREAM])
    output_lens = _lengths(cfg, "output", rows, n, rngs[_OUTPUT_STREAM])

    # injected requests ride after the base ones; their times are absolute
    arrivals = np.concatenate([arrivals, np.asarray(cfg.inject_arrival_s, dtype=np.float64)])
    prompt_lens = np.concatenate([prompt_lens, np.asarray(cfg.inject_prompt_len, dtype=np.int64)])
    output_lens = np.concatenate([output_lens, np.asarray(cfg.inject_output_len, dtype=np.int64)])
    if cfg.max_prompt_len is not None:
        prompt_lens = np.minimum(prompt_lens, cfg.max_prompt_len)
    if cfg.max_output_len is not None:
        output_lens = np.minimum(output_lens, cfg.max_output_len)

    return _requests(cfg, rows, n, np.argsort(arrivals, kind="stable"), arrivals, prompt_lens, output_lens,
                     vocab_size, seed)


def _requests(cfg: WorkloadConfig, rows: list[TraceRow] | None, n: int, order: np.ndarray, arrivals: np.ndarray,
              prompt_lens: np.ndarray, output_lens: np.ndarray, vocab_size: int, seed: int) -> Iterator[Request]:
    uses = hash_id_uses(r.hash_ids for r in rows) if rows is not None and cfg.prompt_dist == "trace" else None
    for k, i in enumerate(order.tolist()):
        row = rows[i] if rows is not None and i < n and cfg.prompt_dist == "trace" else None
        length = int(prompt_lens[i])
        if row is not None and row.prompt_token_ids is not None:
            prompt, private = list(row.prompt_token_ids[:length]), None
        else:
            hash_ids = row.hash_ids if row is not None else None
            prompt = synthesize_prompt(seed, k, length, vocab_size, hash_ids, cfg.hash_block_size)
            private = private_from(hash_ids, cfg.hash_block_size, uses)
        yield Request(f"r{k}", prompt, int(output_lens[i]), arrival_s=float(arrivals[i]), private_from=private)


def _requests_of_rows(rows: list[TraceRow], vocab_size: int, seed: int, cfg: WorkloadConfig) -> list[Request]:
    """Requests replaying rows that carry everything (arrival, lengths, block ids), in order."""
    t0 = rows[0].arrival_s if rows else 0.0
    uses = hash_id_uses(row.hash_ids for row in rows)
    out = []
    for k, row in enumerate(rows):
        output = row.output_len if cfg.max_output_len is None else min(row.output_len, cfg.max_output_len)
        prompt = synthesize_prompt(seed, k, row.prompt_len, vocab_size, row.hash_ids, cfg.hash_block_size)
        out.append(Request(f"r{k}", prompt, output, arrival_s=(row.arrival_s - t0) * cfg.time_scale,
                           private_from=private_from(row.hash_ids, cfg.hash_block_size, uses)))
    return out
