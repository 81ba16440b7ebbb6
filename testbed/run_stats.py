"""RunStats: the run summary (summary.json) accumulated one record at a time.

The runtimes hand it every request record in arrival order as the request
ends (testbed/record_log.py) and every iteration record as it is produced,
so a run keeps a few numbers per request, never the records. What the
summary needs of each request is a handful of scalars (TTFT, TPOT, E2E,
queueing, transfer, fluidity, its number of inter-token gaps), kept in typed
arrays; every mean sums them in the same order as a list of the records
would, so the figures are identical. The pooled inter-token gaps (TBT) are
the one per-token figure: they go to a temporary file as float64 as each
request ends, and `summary` reads them back into one array, 8 bytes a gap
for the time the percentiles take (not requests.jsonl's text again: a
float's parse costs ~0.5 µs, and a 12K-request run has ~4M gaps).
`summarize` is this class over a list; `RunStats.merged` is the state of
one run put together from the states of its parts (runtime/sim_split.py).
"""
from __future__ import annotations

import math
import tempfile
from array import array
from collections.abc import Iterable, Sequence
from operator import add

import numpy as np

from testbed.metrics import PERCENTILES, IterationRecord, RequestRecord, _missed_deadlines, latency_stats_ms
from testbed.prefix_metrics import PrefixCacheStats

_NAN = float("nan")


def _kept(column: array, keep: np.ndarray) -> np.ndarray:
    """The column's values where `keep` and not NaN (None)."""
    a = np.frombuffer(column, dtype=np.float64)[keep]
    return a[~np.isnan(a)]


class RunStats:
    """`add_request(record)` (in arrival order) and `add_iteration(record)` as the
    run goes; `summary(duration_s)` at the end."""

    def __init__(self, slo_ttft_ms: float | None, slo_tpot_ms: float | None, slo_tbt_ms: float | None = None):
        self.slo_ttft_ms, self.slo_tpot_ms = slo_ttft_ms, slo_tpot_ms
        self.slo_tbt_ms = slo_tpot_ms if slo_tbt_ms is None else slo_tbt_ms
        self.fluidity_on = slo_ttft_ms is not None and self.slo_tbt_ms is not None
        self.prefix = PrefixCacheStats()
        # per request, in arrival order
        self.finished = array("b")
        self.sent = array("b")                  # moved KV (disaggregation)
        self.num_gaps = array("q")
        self.ttft_s, self.tpot_s, self.e2e_s, self.queue_s = array("d"), array("d"), array("d"), array("d")
        self.transfer_s, self.exposed_s, self.fluidity = array("d"), array("d"), array("d")
        self.counts = dict.fromkeys(("failed", "aborted", "rejected"), 0)
        # per status, the first such request's error (in arrival order): the summary says why, not only how
        # many; and that request's place among these requests
        self.first_errors: dict[str, str] = {}
        self.first_error_at: dict[str, int] = {}
        self.num_preemptions = self.num_single_token = self.num_good = 0
        self.output_tokens = self.prompt_tokens = 0
        self.missed = self.deadlines = 0
        self.kv_bytes_sent = 0
        self.first_start, self.last_end = math.inf, -math.inf
        # per iteration (a budget and a predictor error only where the iteration has one, else NaN)
        self.it_duration_s, self.prefill_budgets, self.predictor_errors = array("d"), array("d"), array("d")
        self.num_prefill = self.num_decode = self.kv_bytes_read = self.most_tokens = 0
        # every finished request's inter-token gaps, in arrival order, as float64 bytes in a
        # temporary file: the TBT percentiles pool them, and memory stays flat meanwhile
        self._gaps = None

    @property
    def num_requests(self) -> int:
        return len(self.finished)

    def add_request(self, r: RequestRecord) -> None:
        self.prefix.add(r)
        if r.status in self.counts:
            self.counts[r.status] += 1
            if r.error and r.status not in self.first_errors:
                self.first_errors[r.status] = r.error
                self.first_error_at[r.status] = len(self.finished)
        self.num_preemptions += r.num_preemptions
        self.first_start = min(self.first_start, r.arrival_s)
        for t in (r.finish_s, r.token_times_s[-1] if r.token_times_s else None):
            if t is not None:
                self.last_end = max(self.last_end, t)
        sent = bool(r.kv_bytes_sent) or r.transfer_s is not None
        self.sent.append(sent)
        if sent:
            self.kv_bytes_sent += r.kv_bytes_sent
        self.transfer_s.append(_value(r.transfer_s) if sent else _NAN)
        self.exposed_s.append(_value(r.exposed_transfer_s) if sent else _NAN)
        done = r.finished
        self.finished.append(done)
        self.num_gaps.append(max(0, len(r.token_times_s) - 1) if done else 0)
        if not done:
            for column in (self.ttft_s, self.tpot_s, self.e2e_s, self.queue_s, self.fluidity):
                column.append(_NAN)
            return
        ttft, tpot = r.ttft_s, r.tpot_s
        for column, v in ((self.ttft_s, ttft), (self.tpot_s, tpot), (self.e2e_s, r.e2e_s), (self.queue_s, r.queue_s)):
            column.append(_value(v))
        if ((self.slo_ttft_ms is None or (ttft is not None and ttft * 1000 <= self.slo_ttft_ms))
                and (self.slo_tpot_ms is None or tpot is None or tpot * 1000 <= self.slo_tpot_ms)):
            self.num_good += 1
        n = r.num_output_tokens
        self.output_tokens += n
        self.prompt_tokens += r.prompt_len
        self.num_single_token += n == 1
        diffs = np.diff(r.token_times_s)
        if len(diffs):
            if self._gaps is None:
                self._gaps = tempfile.TemporaryFile(prefix="testbed-gaps-")
            self._gaps.write(diffs.tobytes())
        index = _NAN
        if self.fluidity_on:
            gaps = diffs.tolist()
            missed, total = _missed_deadlines(ttft, gaps, self.slo_ttft_ms / 1000, self.slo_tbt_ms / 1000)
            self.missed += missed
            self.deadlines += total
            if total:
                index = 1.0 - missed / total
        self.fluidity.append(index)

    def add_iterations(self, iterations: list[IterationRecord]) -> None:
        """add_iteration of each, in order, column by column (the same figures:
        integer sums, minima and maxima, the per-iteration values in order)."""
        if iterations:
            self.add_iteration_columns([it.start_s for it in iterations], [it.duration_s for it in iterations],
                                       [it.num_prefill_tokens for it in iterations],
                                       [it.num_decode_tokens for it in iterations],
                                       [it.kv_bytes_read for it in iterations],
                                       [it.token_budget for it in iterations], [it.predicted_s for it in iterations])

    def add_iteration_columns(self, starts: list[float], durations: list[float], prefill: list[int],
                              decode: list[int], kv_bytes_read: list[int], budgets: list[int | None],
                              predicted: list[float | None]) -> None:
        """add_iterations of records given as their columns (one list per
        field, equal lengths, at least one record): what a run merged from
        parts (runtime/sim_split.py) has of its iterations."""
        self.it_duration_s.extend(durations)
        self.num_prefill += sum(prefill)
        self.num_decode += sum(decode)
        self.kv_bytes_read += sum(kv_bytes_read)
        self.most_tokens = max(self.most_tokens, max(map(add, prefill, decode)))
        self.prefill_budgets.extend(b - d if b is not None and p else _NAN for b, d, p in zip(budgets, decode, prefill))
        self.predictor_errors.extend(p / d - 1.0 if p is not None and d > 0 else _NAN
                                     for p, d in zip(predicted, durations))
        self.first_start = min(self.first_start, min(starts))
        self.last_end = max(self.last_end, max(map(add, starts, durations)))

    def add_iteration(self, it: IterationRecord) -> None:
        self.it_duration_s.append(it.duration_s)
        self.num_prefill += it.num_prefill_tokens
        self.num_decode += it.num_decode_tokens
        self.kv_bytes_read += it.kv_bytes_read
        self.most_tokens = max(self.most_tokens, it.num_prefill_tokens + it.num_decode_tokens)
        self.prefill_budgets.append(it.token_budget - it.num_decode_tokens
                                    if it.token_budget is not None and it.num_prefill_tokens else _NAN)
        self.predictor_errors.append(it.predicted_s / it.duration_s - 1.0
                                     if it.predicted_s is not None and it.duration_s > 0 else _NAN)
        self.first_start = min(self.first_start, it.start_s)
        self.last_end = max(self.last_end, it.start_s + it.duration_s)

    # -- the summary ------------------------------------------------------------------
    def span_s(self) -> float:
        """From the first arrival to the last token, finish or iteration end."""
        if self.first_start == math.inf or self.last_end == -math.inf:
            return 0.0
        return max(0.0, self.last_end - self.first_start)

    def summary(self, duration_s: float | None = None) -> dict:
        """The run's summary (`summarize` documents each figure)."""
        done = np.frombuffer(self.finished, dtype=np.int8).astype(bool)
        num_done = int(done.sum())
        n = self.num_requests
        duration = self.span_s() if duration_s is None else duration_s

        def per_s(x: float) -> float:
            return x / duration if duration > 0 else 0.0

        def stats(column: array) -> dict:
            return latency_stats_ms(_kept(column, done))

        fluidity = fluidity_mean = None
        if self.fluidity_on and num_done:
            fluidity = 1.0 - self.missed / self.deadlines if self.deadlines else None
            fluidity_mean = float(np.mean(_kept(self.fluidity, done)))
        summary = {
            "num_requests": n,
            "num_finished": num_done,
            "num_failed": self.counts["failed"],
            "num_aborted": self.counts["aborted"],
            # refused at arrival (mode=kvstore's early rejection): never finished, so goodput misses them
            "num_rejected": self.counts["rejected"],
            "first_error": dict(self.first_errors),     # per status (failed, aborted, rejected) that has one
            "num_preemptions": int(self.num_preemptions),
            "num_single_token": self.num_single_token,
            "duration_s": duration,
            "ttft_ms": stats(self.ttft_s),
            "tbt_ms": latency_stats_ms(self._pooled_gaps()),
            "tpot_ms": stats(self.tpot_s),
            "e2e_ms": stats(self.e2e_s),
            "queue_ms": stats(self.queue_s),
            "throughput": {"requests_per_s": per_s(num_done),
                           "output_tokens_per_s": per_s(self.output_tokens),
                           "total_tokens_per_s": per_s(self.output_tokens + self.prompt_tokens)},
            "slo": {"ttft_ms": self.slo_ttft_ms, "tpot_ms": self.slo_tpot_ms, "tbt_ms": self.slo_tbt_ms},
            "goodput": per_s(self.num_good),
            "slo_attainment": self.num_good / n if n else None,
            "fluidity_index": fluidity,
            "fluidity_index_mean": fluidity_mean,
            "iterations": self._iteration_summary(),
        }
        transfer = self._kv_transfer_summary()
        if transfer is not None:
            summary["kv_transfer"] = transfer
        return summary

    def _pooled_gaps(self) -> np.ndarray:
        """Every finished request's inter-token gaps, pooled in one array."""
        gaps = np.empty(0, dtype=np.float64)
        if self._gaps is not None:
            self._gaps.seek(0)
            gaps = np.frombuffer(self._gaps.read(), dtype=np.float64)
        assert len(gaps) == int(np.frombuffer(self.num_gaps, dtype=np.int64).sum()), "gaps lost"
        return gaps

    def _kv_transfer_summary(self) -> dict | None:
        sent = np.frombuffer(self.sent, dtype=np.int8).astype(bool)
        num_sent = int(sent.sum())
        if not num_sent:
            return None
        durations = _kept(self.transfer_s, sent)
        busy_s = float(sum(durations.tolist()))     # Python's sum, as before
        total_bytes = int(self.kv_bytes_sent)
        return {"num_transfers": num_sent, "bytes": total_bytes,
                "bytes_per_request": total_bytes / num_sent,
                "transfer_ms": latency_stats_ms(durations),
                "exposed_ms": latency_stats_ms(_kept(self.exposed_s, sent)),
                # bytes over the summed per-transfer times: the link rate one transfer saw on average
                "achieved_gb_per_s": total_bytes / busy_s / 1e9 if busy_s > 0 else None}

    def _iteration_summary(self) -> dict:
        out = {"num_iterations": len(self.it_duration_s),
               "duration_ms": latency_stats_ms(np.frombuffer(self.it_duration_s, dtype=np.float64)),
               "num_prefill_tokens": int(self.num_prefill),
               "num_decode_tokens": int(self.num_decode),
               "max_tokens_per_iteration": self.most_tokens,
               "kv_bytes_read": int(self.kv_bytes_read)}
        budgets = _kept(self.prefill_budgets, slice(None))
        if len(budgets):
            out["prefill_budget"] = _distribution(budgets)
        errors = _kept(self.predictor_errors, slice(None))
        if len(errors):
            out["predictor_error"] = _predictor_error(errors)
        return out

    # -- a run's state from its parts' ----------------------------------------------------
    @classmethod
    def merged(cls, parts: list[RunStats], request_places: list[np.ndarray],
               iteration_places: list[np.ndarray]) -> RunStats:
        """The state one RunStats would have had fed every part's records in
        the run's order: part i's k-th request is the run's request_places[i][k]
        (arrival order) and its k-th iteration the run's iteration_places[i][k].
        Counts add up, extremes combine, and every per-request and
        per-iteration value (the pooled gaps included) goes to its place, so
        the summary's means sum in the single run's order."""
        first = parts[0]
        out = cls(first.slo_ttft_ms, first.slo_tpot_ms, first.slo_tbt_ms)
        if any(p.prefix.num_counted for p in parts):
            raise AssertionError("RunStats.merged: prefix-cache counters (mode=kvstore) are not merged")
        for names, places in ((_PER_REQUEST, request_places), (_PER_ITERATION, iteration_places)):
            size = sum(len(p) for p in places)
            for name in names:
                setattr(out, name, _placed([getattr(p, name) for p in parts], places, size))
        for name in _SUMS:
            setattr(out, name, sum(getattr(p, name) for p in parts))
        out.counts = {k: sum(p.counts[k] for p in parts) for k in out.counts}
        out.most_tokens = max(p.most_tokens for p in parts)
        out.first_start = min(p.first_start for p in parts)
        out.last_end = max(p.last_end for p in parts)
        firsts = sorted((int(places[p.first_error_at[status]]), status, p.first_errors[status])
                        for p, places in zip(parts, request_places) for status in p.first_errors)
        for place, status, error in firsts:
            if status not in out.first_errors:
                out.first_errors[status], out.first_error_at[status] = error, place
        out._gather_gaps(parts, request_places)
        return out

    def _gather_gaps(self, parts: list[RunStats], request_places: list[np.ndarray]) -> None:
        """The parts' pooled gaps, each request's run at its place (self.num_gaps is merged)."""
        lengths = np.frombuffer(self.num_gaps, dtype=np.int64)
        if not lengths.sum():
            return
        source_start = np.empty(len(lengths), dtype=np.int64)       # where each request's gaps are in `pooled`
        pooled, base = [], 0
        for part, places in zip(parts, request_places):
            gaps, counts = part._pooled_gaps(), np.frombuffer(part.num_gaps, dtype=np.int64)
            source_start[places] = base + np.cumsum(counts) - counts
            pooled.append(gaps)
            base += len(gaps)
        target_start = np.cumsum(lengths) - lengths
        index = np.repeat(source_start - target_start, lengths) + np.arange(int(lengths.sum()))
        self._gaps = tempfile.TemporaryFile(prefix="testbed-gaps-")
        self._gaps.write(np.concatenate(pooled)[index].tobytes())

    def __getstate__(self) -> dict:
        """Picklable (a part's state goes to the parent): the gaps' file as its bytes."""
        state = dict(self.__dict__)
        state["_gaps"] = None if self._gaps is None else self._pooled_gaps().tobytes()
        return state

    def __setstate__(self, state: dict) -> None:
        gaps = state.pop("_gaps")
        self.__dict__.update(state)
        self._gaps = None
        if gaps is not None:
            self._gaps = tempfile.TemporaryFile(prefix="testbed-gaps-")
            self._gaps.write(gaps)


def summarize(requests: Sequence[RequestRecord], iterations: Iterable[IterationRecord],
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
    stats = RunStats(slo_ttft_ms, slo_tpot_ms, slo_tbt_ms)
    for r in requests:
        stats.add_request(r)
    for it in iterations:
        stats.add_iteration(it)
    return stats.summary(duration_s)


_PER_REQUEST = ("finished", "sent", "num_gaps", "ttft_s", "tpot_s", "e2e_s", "queue_s", "transfer_s", "exposed_s",
                "fluidity")
_PER_ITERATION = ("it_duration_s", "prefill_budgets", "predictor_errors")
_SUMS = ("num_preemptions", "num_single_token", "num_good", "output_tokens", "prompt_tokens", "missed", "deadlines",
         "kv_bytes_sent", "num_prefill", "num_decode", "kv_bytes_read")


def _placed(columns: list[array], places: list[np.ndarray], size: int) -> array:
    """One column of `size` values: columns[i]'s k-th at places[i][k]."""
    typecode = columns[0].typecode
    out = np.empty(size, dtype=typecode)
    filled = 0
    for column, where in zip(columns, places):
        if len(column) != len(where):
            raise AssertionError(f"RunStats.merged: a part has {len(column)} values for {len(where)} places")
        out[where] = np.frombuffer(column, dtype=typecode)
        filled += len(where)
    if filled != size:
        raise AssertionError(f"RunStats.merged: {filled} values for {size} places")
    return array(typecode, out.tobytes())


def _value(v: float | None) -> float:
    return _NAN if v is None else v


def _distribution(a: np.ndarray) -> dict:
    """min, mean, p10/p50/p90 and max of the prefill budgets of iterations that prefilled."""
    return {"min": float(a.min()), "mean": float(a.mean()),
            **{f"p{q}": float(np.percentile(a, q)) for q in (10, 50, 90)}, "max": float(a.max())}


def _predictor_error(e: np.ndarray) -> dict:
    """predicted / measured - 1 per iteration: its mean (the bias), and the
    absolute error's mean and percentiles, overall and over the last half of
    the run (after the self-correction had time to converge)."""
    late = np.abs(e[len(e) // 2:])
    return {"num_iterations": len(e), "bias": float(e.mean()), "abs_mean": float(np.abs(e).mean()),
            **{f"abs_{k}": float(np.percentile(np.abs(e), q)) for k, q in PERCENTILES.items()},
            "abs_mean_second_half": float(late.mean()), "abs_p50_second_half": float(np.percentile(late, 50))}
