"""Metrics: per-request and per-iteration records, their JSON Lines files and
the latency statistics the run summary (testbed/run_stats.py) is made of.

Data flow (README.md, "Architecture"): the frontend (real runtime) or the
event loop (sim) turns each finished, failed or aborted Request into a
`RequestRecord`; each engine step becomes an `IterationRecord`. They are written
to `requests.jsonl` / `iterations.jsonl` as they come (testbed/record_log.py),
and testbed/run_stats.py turns them into `summary.json`, which `testbed report`
and the capacity search read.

Names follow vLLM's benchmark_serving: TTFT, TPOT, ITL (here TBT: every
inter-token gap of every request, pooled), E2EL (here E2E). All times in the
records are seconds on one clock (wall or virtual); the summary reports ms.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter
from pathlib import Path
from typing import TextIO

import numpy as np

from testbed.batch import Batch, StepResult
from testbed.jsonl import jsonl_objects, jsonl_text
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


def write_jsonl(path: str | Path, records: Iterable[RequestRecord | IterationRecord]) -> None:
    """One JSON object per line (the dataclass fields), each line exactly what
    json.dumps writes for the record's field dict."""
    with open(path, "w") as f:
        append_jsonl(f, records)


def append_jsonl(f: TextIO, records: Iterable[RequestRecord | IterationRecord]) -> None:
    """write_jsonl's lines, appended to the open file `f`."""
    for names, columns in record_columns(records):
        f.write(jsonl_text(names, columns))


def record_columns(records: Iterable[RequestRecord | IterationRecord]) -> Iterator[tuple[list[str], list[list]]]:
    """The records as (field names, one list of values per field), a chunk of
    at most _JSONL_CHUNK records of one class at a time, in order."""
    for cls, group in itertools.groupby(records, key=type):
        names = [fl.name for fl in fields(cls)]
        while chunk := list(itertools.islice(group, _JSONL_CHUNK)):
            yield names, [list(map(attrgetter(name), chunk)) for name in names]


def _read_jsonl(path: str | Path, cls: type) -> list:
    return list(_iter_jsonl(path, cls))


def _iter_jsonl(path: str | Path, cls: type) -> Iterator:
    known = {f.name for f in fields(cls)}
    for line_no, obj in jsonl_objects(path, cut_tail=True):
        where = f"{path}:{line_no}"
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown} for {cls.__name__}")
        try:
            yield cls(**obj)
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None


def read_requests(path: str | Path) -> list[RequestRecord]:
    """A mode may record more per request (a RequestRecord subclass, e.g.
    mode=kvstore's): the file's first row says which class reads it."""
    return list(iter_requests(path))


def iter_requests(path: str | Path) -> Iterator[RequestRecord]:
    """read_requests one record at a time, in file order."""
    first = next(iter(jsonl_objects(path, cut_tail=True)), None)
    cls = RequestRecord
    if first is not None:
        keys = set(first[1])
        cls = next((sub for sub in RequestRecord.__subclasses__() if {f.name for f in fields(sub)} == keys), cls)
    return _iter_jsonl(path, cls)


def read_iterations(path: str | Path) -> list[IterationRecord]:
    return _read_jsonl(path, IterationRecord)


def iter_iterations(path: str | Path) -> Iterator[IterationRecord]:
    return _iter_jsonl(path, IterationRecord)
