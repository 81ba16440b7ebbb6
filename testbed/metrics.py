"""Metrics: per-request and per-iteration records, and the run summary.

Data flow (DESIGN.md "Metrics", "Outputs"): the frontend (real runtime) or the
event loop (sim) turns each finished, failed or aborted Request into a
`RequestRecord`; each engine step becomes an `IterationRecord`. They are written
to `requests.jsonl` / `iterations.jsonl`, and `summarize` turns them into
`summary.json`, which `testbed report` and the capacity search read.

Names follow vLLM's benchmark_serving: TTFT, TPOT, ITL (here TBT: every
inter-token gap of every request, pooled), E2EL (here E2E). All times in the
records are seconds on one clock (wall or virtual); the summary reports ms.
"""
from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter
from pathlib import Path

import numpy as np

from testbed.batch import Batch, StepResult
from testbed.jsonl import jsonl_objects
from testbed.request import Request

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}
# Deadline comparisons tolerate float noise: a gap of exactly 3 TBT deadlines
# must count 3 misses, not 2 because 0.03/0.01 came out as 2.9999999.
_EPS_S = 1e-9
# records per write_jsonl batch: bounds the memory its columns take
_JSONL_CHUNK = 4096


@dataclass
class RequestRecord:
    request_id: str
    status: str                                  # RequestStatus value: finished | aborted | failed | ...
    prompt_len: int
    output_token_ids: list[int]
    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)   # one per output token, first included
    finish_s: float | None = None
    num_preemptions: int = 0
    error: str | None = None
    # disaggregation: the prefill worker's KV sent to the decode worker
    kv_bytes_sent: int = 0
    transfer_start_s: float | None = None
    transfer_end_s: float | None = None
    exposed_transfer_s: float | None = None      # the part of the transfer nothing overlapped

    @classmethod
    def from_request(cls, req: Request, **transfer) -> RequestRecord:
        """A record of `req` as it stands (timestamps from the engine's clock);
        `transfer` sets the disaggregation fields."""
        return cls(request_id=req.request_id, status=getattr(req.status, "value", str(req.status)),
                   prompt_len=req.prompt_len, output_token_ids=list(req.output_token_ids),
                   arrival_s=req.arrival_s, first_scheduled_s=req.first_scheduled_s,
                   first_token_s=req.token_times_s[0] if req.token_times_s else None,
                   token_times_s=list(req.token_times_s), finish_s=req.finish_s,
                   num_preemptions=req.num_preemptions, error=req.error, **transfer)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def ttft_s(self) -> float | None:
        first = self.first_token_s if self.first_token_s is not None else \
            (self.token_times_s[0] if self.token_times_s else None)
        return None if first is None else first - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        end = self.finish_s if self.finish_s is not None else \
            (self.token_times_s[-1] if self.token_times_s else None)
        return None if end is None else end - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (n - 1); None for a one-token request (no decode step)."""
        n, ttft, e2e = self.num_output_tokens, self.ttft_s, self.e2e_s
        if n < 2 or ttft is None or e2e is None:
            return None
        return (e2e - ttft) / (n - 1)

    @property
    def tbt_s(self) -> list[float]:
        """Every gap between consecutive tokens (vLLM's ITL)."""
        return np.diff(self.token_times_s).tolist() if len(self.token_times_s) > 1 else []

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def transfer_s(self) -> float | None:
        if self.transfer_start_s is None or self.transfer_end_s is None:
            return None
        return self.transfer_end_s - self.transfer_start_s


@dataclass
class KVStoreRequestRecord(RequestRecord):
    """mode=kvstore's record: the prompt tokens whose KV was reused (testbed/prefix_metrics.py)."""
    num_cached_tokens: int = 0                 # local + store (vLLM: RequestOutput.num_cached_tokens)
    num_local_cached_tokens: int = 0           # from the prefill worker's own prefix cache
    num_external_cached_tokens: int = 0        # read from the KV store (vLLM: a connector's external tokens)
    store_fetch_s: float | None = None         # store lookup plus read


@dataclass
class IterationRecord:
    start_s: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    kv_bytes_read: int = 0
    worker: str | None = None
    token_budget: int | None = None          # the budgeted policy's token budget (decodes + prefill)
    predicted_s: float | None = None         # the duration the policy's predictor expected

    @classmethod
    def from_step(cls, start_s: float, batch: Batch, result: StepResult, worker: str | None = None) -> IterationRecord:
        return cls(start_s, result.duration_s, batch.num_prefill_tokens, batch.num_decode_tokens,
                   result.kv_bytes_read, worker, batch.token_budget, batch.predicted_s)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def latency_stats_ms(values_s: Sequence[float]) -> dict:
    """mean, p50, p90, p99, p999 and max in ms of values in seconds (numpy's
    linear-interpolated percentiles, as vLLM); every entry None when empty."""
    if len(values_s) == 0:
        return {"mean": None, **{k: None for k in PERCENTILES}, "max": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(ms.mean()), **{k: float(np.percentile(ms, q)) for k, q in PERCENTILES.items()},
            "max": float(ms.max())}


def fluidity_deadlines(record: RequestRecord, ttft_deadline_s: float, tbt_deadline_s: float) -> tuple[int, int]:
    """(missed, total) token deadlines of one request, Etalon's fluidity-index
    (Agrawal et al., "Etalon/Metron", Algorithm 1), with the prefill deadline
    given directly as the TTFT SLO and no separate scheduling slack.

    The intervals are T0 = TTFT and Ti = gap before token i. Interval i has
    deadline D = ttft_deadline_s for i = 0, else tbt_deadline_s. With `slack`
    starting at 0:
      - Ti <= D + slack: one deadline met; slack += D - Ti (early tokens bank
        time that absorbs later stalls);
      - otherwise: floor((Ti - slack - D) / tbt_deadline_s) + 1 deadlines missed
        (a gap of 3 TBT deadlines with no slack misses 3), slack resets to 0,
        so later deadlines count from this token.
    """
    return _missed_deadlines(record.ttft_s, record.tbt_s, ttft_deadline_s, tbt_deadline_s)


def _missed_deadlines(ttft_s: float | None, tbt_s: list[float], ttft_deadline_s: float,
                      tbt_deadline_s: float) -> tuple[int, int]:
    """fluidity_deadlines from a request's TTFT and inter-token gaps."""
    intervals = [] if ttft_s is None else [ttft_s]
    intervals += tbt_s
    missed = total = 0
    slack = 0.0
    for i, t in enumerate(intervals):
        deadline = ttft_deadline_s if i == 0 else tbt_deadline_s
        if t <= deadline + slack + _EPS_S:
            slack += deadline - t
            total += 1
        else:
            misses = math.floor((t - slack - deadline) / tbt_deadline_s + _EPS_S) + 1
            missed += misses
            total += misses
            slack = 0.0
    return missed, total


def _run_span_s(requests: Sequence[RequestRecord], iterations: Sequence[IterationRecord]) -> float:
    """From the first arrival to the last token, finish or iteration end."""
    starts = [r.arrival_s for r in requests] + [it.start_s for it in iterations]
    ends = [t for r in requests for t in (r.finish_s, r.token_times_s[-1] if r.token_times_s else None)
            if t is not None] + [it.start_s + it.duration_s for it in iterations]
    if not starts or not ends:
        return 0.0
    return max(0.0, max(ends) - min(starts))


def _kv_transfer_summary(requests: Sequence[RequestRecord]) -> dict | None:
    sent = [r for r in requests if r.kv_bytes_sent or r.transfer_s is not None]
    if not sent:
        return None
    durations = [r.transfer_s for r in sent if r.transfer_s is not None]
    total_bytes = int(sum(r.kv_bytes_sent for r in sent))
    busy_s = float(sum(durations))
    return {"num_transfers": len(sent), "bytes": total_bytes,
            "bytes_per_request": total_bytes / len(sent),
            "transfer_ms": latency_stats_ms(durations),
            "exposed_ms": latency_stats_ms([r.exposed_transfer_s for r in sent if r.exposed_transfer_s is not None]),
            # bytes over the summed per-transfer times: the link rate one transfer saw on average
            "achieved_gb_per_s": total_bytes / busy_s / 1e9 if busy_s > 0 else None}


def _iteration_summary(iterations: Sequence[IterationRecord]) -> dict:
    # one pass: a simulated run leaves ~10^5 records spread over its heap, and
    # each pass over them costs more than the arithmetic
    durations, prefill_budgets, errors = [], [], []
    num_prefill = num_decode = kv_bytes = most = 0
    for it in iterations:
        durations.append(it.duration_s)
        num_prefill += it.num_prefill_tokens
        num_decode += it.num_decode_tokens
        kv_bytes += it.kv_bytes_read
        most = max(most, it.num_prefill_tokens + it.num_decode_tokens)
        if it.token_budget is not None and it.num_prefill_tokens:
            prefill_budgets.append(it.token_budget - it.num_decode_tokens)
        if it.predicted_s is not None and it.duration_s > 0:
            errors.append(it.predicted_s / it.duration_s - 1.0)
    out = {"num_iterations": len(iterations),
           "duration_ms": latency_stats_ms(durations),
           "num_prefill_tokens": int(num_prefill),
           "num_decode_tokens": int(num_decode),
           "max_tokens_per_iteration": most,
           "kv_bytes_read": int(kv_bytes)}
    if prefill_budgets:
        out["prefill_budget"] = _distribution(prefill_budgets)
    if errors:
        out["predictor_error"] = _predictor_error(errors)
    return out


def _distribution(values: Sequence[float]) -> dict:
    """min, mean, p10/p50/p90 and max of the prefill budgets of iterations that prefilled."""
    a = np.asarray(values, dtype=np.float64)
    return {"min": float(a.min()), "mean": float(a.mean()),
            **{f"p{q}": float(np.percentile(a, q)) for q in (10, 50, 90)}, "max": float(a.max())}


def _predictor_error(errors: Sequence[float]) -> dict:
    """predicted / measured - 1 per iteration: its mean (the bias), and the
    absolute error's mean and percentiles, overall and over the last half of
    the run (after the self-correction had time to converge)."""
    e = np.asarray(errors, dtype=np.float64)
    late = np.abs(e[len(e) // 2:])
    return {"num_iterations": len(e), "bias": float(e.mean()), "abs_mean": float(np.abs(e).mean()),
            **{f"abs_{k}": float(np.percentile(np.abs(e), q)) for k, q in PERCENTILES.items()},
            "abs_mean_second_half": float(late.mean()), "abs_p50_second_half": float(np.percentile(late, 50))}


def summarize(requests: Sequence[RequestRecord], iterations: Sequence[IterationRecord],
              slo_ttft_ms: float | None, slo_tpot_ms: float | None, duration_s: float | None = None,
              slo_tbt_ms: float | None = None) -> dict:
    """The run's summary (summary.json). Latency stats count finished requests only.

    - `tpot_ms` excludes one-token requests (TPOT is undefined for n = 1); for
      goodput such a request meets the TPOT SLO vacuously, as in vLLM.
    - `goodput`: finished requests with TTFT <= slo_ttft_ms and TPOT <=
      slo_tpot_ms, per second of `duration_s` (vLLM's definition); an SLO of
      None is not applied. `slo_attainment`: the same count over num_requests.
    - `fluidity_index`: 1 - missed/total deadlines pooled over finished
      requests (see `fluidity_deadlines`), TTFT deadline slo_ttft_ms, TBT
      deadline slo_tbt_ms (default slo_tpot_ms); None without both SLOs.
      `fluidity_index_mean` is the mean of the per-request indices.
    - `duration_s` defaults to first arrival .. last token/finish/iteration end.
    """
    done = [r for r in requests if r.finished]
    duration = _run_span_s(requests, iterations) if duration_s is None else duration_s

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    good = [r for r in done
            if (slo_ttft_ms is None or (r.ttft_s is not None and r.ttft_s * 1000 <= slo_ttft_ms))
            and (slo_tpot_ms is None or r.tpot_s is None or r.tpot_s * 1000 <= slo_tpot_ms)]
    output_tokens = sum(r.num_output_tokens for r in done)
    tbt_ms = slo_tpot_ms if slo_tbt_ms is None else slo_tbt_ms
    # every finished request's inter-token gaps, once: the fluidity index and tbt_ms both read them
    gaps = [np.diff(r.token_times_s) for r in done]
    fluidity = fluidity_mean = None
    if slo_ttft_ms is not None and tbt_ms is not None and done:
        counts = [_missed_deadlines(r.ttft_s, g.tolist(), slo_ttft_ms / 1000, tbt_ms / 1000)
                  for r, g in zip(done, gaps)]
        total = sum(t for _, t in counts)
        fluidity = 1.0 - sum(m for m, _ in counts) / total if total else None
        fluidity_mean = float(np.mean([1.0 - m / t for m, t in counts if t]))

    summary = {
        "num_requests": len(requests),
        "num_finished": len(done),
        "num_failed": sum(r.status == "failed" for r in requests),
        "num_aborted": sum(r.status == "aborted" for r in requests),
        # refused at arrival (mode=kvstore's early rejection): never finished, so goodput misses them
        "num_rejected": sum(r.status == "rejected" for r in requests),
        "num_preemptions": int(sum(r.num_preemptions for r in requests)),
        "num_single_token": sum(r.num_output_tokens == 1 for r in done),
        "duration_s": duration,
        "ttft_ms": latency_stats_ms(ttft),
        # pooled as one array: a list of Python floats is ~4x the memory at 10^7 gaps
        "tbt_ms": latency_stats_ms(np.concatenate([g for g in gaps if len(g)] or [np.empty(0)])),
        "tpot_ms": latency_stats_ms(tpot),
        "e2e_ms": latency_stats_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "queue_ms": latency_stats_ms([r.queue_s for r in done if r.queue_s is not None]),
        "throughput": {"requests_per_s": per_s(len(done)),
                       "output_tokens_per_s": per_s(output_tokens),
                       "total_tokens_per_s": per_s(output_tokens + sum(r.prompt_len for r in done))},
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "tbt_ms": tbt_ms},
        "goodput": per_s(len(good)),
        "slo_attainment": len(good) / len(requests) if requests else None,
        "fluidity_index": fluidity,
        "fluidity_index_mean": fluidity_mean,
        "iterations": _iteration_summary(iterations),
    }
    transfer = _kv_transfer_summary(requests)
    if transfer is not None:
        summary["kv_transfer"] = transfer
    return summary


def write_jsonl(path: str | Path, records: Iterable[RequestRecord | IterationRecord]) -> None:
    """One JSON object per line (the dataclass fields), each line exactly what
    json.dumps writes for the record's field dict."""
    # json.dumps per record costs a few µs, a second for a 200K-iteration run:
    # each field of a chunk of records is encoded in one call instead, and the
    # lines are filled in from a template of the keys
    with open(path, "w") as f:
        for cls, group in itertools.groupby(records, key=type):
            names = [fl.name for fl in fields(cls)]
            line = "{" + ", ".join(f"{json.dumps(name)}: %s" for name in names) + "}\n"
            while chunk := list(itertools.islice(group, _JSONL_CHUNK)):
                columns = [_json_column(list(map(attrgetter(name), chunk))) for name in names]
                f.writelines(map(line.__mod__, zip(*columns)))


def _json_column(values: list) -> list[str]:
    """json.dumps of each value. A column of scalars is encoded in one call and
    split at the ", " between items: exact when that gives one part per value,
    which it does unless a value's own encoding contains ", " (a list, or a
    string holding one); those columns are encoded value by value."""
    if not isinstance(values[0], list):
        parts = json.dumps(values)[1:-1].split(", ")
        if len(parts) == len(values):
            return parts
    return list(map(json.dumps, values))


def _read_jsonl(path: str | Path, cls: type) -> list:
    known = {f.name for f in fields(cls)}
    records = []
    for line_no, obj in jsonl_objects(path):
        where = f"{path}:{line_no}"
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown} for {cls.__name__}")
        try:
            records.append(cls(**obj))
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None
    return records


def read_requests(path: str | Path) -> list[RequestRecord]:
    """A mode may record more per request (a RequestRecord subclass, e.g.
    mode=kvstore's): the file's first row says which class reads it."""
    first = next(iter(jsonl_objects(path)), None)
    cls = RequestRecord
    if first is not None:
        keys = set(first[1])
        cls = next((sub for sub in RequestRecord.__subclasses__() if {f.name for f in fields(sub)} == keys), cls)
    return _read_jsonl(path, cls)


def read_iterations(path: str | Path) -> list[IterationRecord]:
    return _read_jsonl(path, IterationRecord)
