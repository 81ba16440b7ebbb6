"""RecordLog: where a run's records go the moment they exist.

The mode controller (modes/base.py) hands it each request's record when the
request is terminal (finished, failed, aborted, rejected), with the request's
place among the run's arrivals, and each iteration's record as the
iteration's event arrives. It appends them to requests.jsonl and
iterations.jsonl in the run directory, in write_jsonl's line format, a chunk
of records at a time and at least every `flush_s`, and feeds RunStats
(testbed/run_stats.py), which keeps a few numbers per request for the
summary.

When the caller gave no run directory (capacity searches, studies and
calibration read `RunResult.records` in-process) the records stay in memory
as the objects the controller made: a capacity probe's records used to take
about a seventh of its time to encode, write and parse back. A run that
passes `memory_iterations` iteration records spills everything to a
temporary directory and streams on from there, as a run with a directory
does, so that a long run's memory stays bounded.

requests.jsonl stays in arrival order, as when a run wrote its records at
the end (readers and tests compare it line by line, and a simulated run's
file is the same every time): a record that ends before an earlier arrival's
waits here for it. So what this holds is the records of requests that ended
while an earlier one was still in flight: bounded by the requests in flight
over the longest request's lifetime, not by the run's length.

Once a run has written `writer_after` iteration records it hands the
encoding and writing to a process of its own (testbed/record_writer.py), on
another core: the same bytes, off the simulation's critical path.
"""
from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from testbed.metrics import IterationRecord, RequestRecord, iter_iterations, iter_requests, record_columns
from testbed.record_writer import InlineWriter, RecordWriter
from testbed.run_stats import RunStats

REQUESTS_FILE, ITERATIONS_FILE = "requests.jsonl", "iterations.jsonl"


class RecordSink(Protocol):
    """What a mode controller hands its records to."""

    def request(self, record: RequestRecord, arrival_index: int) -> None: ...

    def iteration(self, record: IterationRecord) -> None: ...


class RecordLog:
    def __init__(self, stats: RunStats, run_dir: str | Path | None = None, chunk: int = 1024,
                 flush_s: float = 1.0, writer_after: int | None = None, memory_iterations: int = 200_000):
        """writer_after: iteration records written before a writer process takes over (None:
        never; runtime.record_writer_after, 100K by default: below that its start, ~0.1 s,
        costs about what it saves). memory_iterations: without `run_dir`, the iteration
        records kept in memory before the log spills to a temporary directory (~250 bytes
        each)."""
        self.stats, self.chunk, self.flush_s, self.writer_after = stats, chunk, flush_s, writer_after
        self.memory_iterations = memory_iterations
        self._tmp = None
        self.dir: Path | None = None                     # None: the records are in memory
        self._kept: dict[str, list] = {"requests": [], "iterations": []}
        self._writer: InlineWriter | RecordWriter | None = None
        if run_dir is not None:
            self._open_files(Path(run_dir))
        self._pending: dict[str, list] = {"requests": [], "iterations": []}
        self.waiting: dict[int, RequestRecord] = {}      # arrival index -> a record ended before an earlier one
        self._next = 0                                   # the arrival index requests.jsonl takes next
        self._flushed_at = time.monotonic()
        self._iterations_written = 0
        self._closed = False

    def _open_files(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.requests_path, self.iterations_path = self.dir / REQUESTS_FILE, self.dir / ITERATIONS_FILE
        self._paths = {"requests": str(self.requests_path), "iterations": str(self.iterations_path)}
        for path in self._paths.values():
            open(path, "w").close()                      # a run starts its files empty
        self._writer = InlineWriter(self._paths)

    def _spill(self) -> None:
        """Past memory_iterations: what is in memory goes to a temporary directory
        (removed with this object; RunResult holds it) and the run streams on from there."""
        self._tmp = tempfile.TemporaryDirectory(prefix="testbed-records-")
        self._open_files(Path(self._tmp.name))
        for kind, kept in self._kept.items():
            if kept:
                self._writer.write(kind, record_columns(kept))
        self._kept = {"requests": [], "iterations": []}

    @property
    def in_memory(self) -> bool:
        return self.dir is None

    # -- written as the run goes -----------------------------------------------------
    def request(self, record: RequestRecord, arrival_index: int) -> None:
        """A terminal request's record; `arrival_index` (0, 1, ...) its place among the run's arrivals."""
        if arrival_index != self._next:
            self.waiting[arrival_index] = record
            return
        self._take(record)
        while self._next in self.waiting:
            self._take(self.waiting.pop(self._next))

    def _take(self, record: RequestRecord) -> None:
        self._next += 1
        self.stats.add_request(record)
        self._add("requests", record)

    def iteration(self, record: IterationRecord) -> None:
        self._add("iterations", record)       # (RunStats counts them as they are written)

    def extend_iterations(self, records: list[IterationRecord], received_s: list[float] | None = None) -> None:
        """iteration() of each, in order; `received_s`, the instants the
        frontend received them (the simulator's), is for a log that keeps
        them (runtime/sim_split.py's parts)."""
        pending = self._pending["iterations"]
        pending += records
        if len(pending) >= self.chunk or time.monotonic() - self._flushed_at >= self.flush_s:
            self.flush()

    def append_lines(self, kind: str, data: bytes) -> None:
        """Records of `kind` already encoded in write_jsonl's line format (a
        run merged from parts: runtime/sim_split.py), appended as they are.
        The caller feeds `stats` (RunStats) the same records, in the same order."""
        if self.in_memory or not isinstance(self._writer, InlineWriter):
            raise AssertionError("append_lines: only for a log that writes its run directory itself")
        self._writer.write_bytes(kind, data)

    def _add(self, kind: str, record) -> None:
        pending = self._pending[kind]
        pending.append(record)
        if len(pending) >= self.chunk or time.monotonic() - self._flushed_at >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        iterations = self._pending["iterations"]
        self.stats.add_iterations(iterations)
        self._iterations_written += len(iterations)
        if self.in_memory and self._iterations_written > self.memory_iterations:
            self._spill()
        if self.in_memory:
            for kind, pending in self._pending.items():
                self._kept[kind] += pending
                pending.clear()
            self._flushed_at = time.monotonic()
            return
        if isinstance(self._writer, InlineWriter) and self.writer_after is not None \
                and self._iterations_written >= self.writer_after:
            self._writer.close()                   # what is written so far stays; the process appends
            self._writer = RecordWriter(self._paths)
        for kind, pending in self._pending.items():
            if pending:
                self._writer.write(kind, record_columns(pending))
                pending.clear()
        self._writer.flush()
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        """Everything on disk; safe to call twice."""
        if not self._closed:
            self._closed = True
            for index in sorted(self.waiting):     # an arrival that never ended (none when a runtime ends its run)
                self._take(self.waiting.pop(index))
            self.flush()
            if self._writer is not None:
                self._writer.close()

    # -- read back, once the run is over ----------------------------------------------
    def requests(self) -> list[RequestRecord]:
        """Every request's record, in arrival order."""
        return list(self.iter_requests())

    def iterations(self) -> list[IterationRecord]:
        return list(self.iter_iterations())

    def iter_requests(self) -> Iterator[RequestRecord]:
        """requests() one record at a time (from the file: a long run's are never all in memory)."""
        self.close()
        return iter(self._kept["requests"]) if self.in_memory else iter_requests(self.requests_path)

    def iter_iterations(self) -> Iterator[IterationRecord]:
        self.close()
        return iter(self._kept["iterations"]) if self.in_memory else iter_iterations(self.iterations_path)

    def summary(self, duration_s: float | None = None) -> dict:
        """summary.json's figures, from what was streamed."""
        self.close()
        return self.stats.summary(duration_s)


class RecordList:
    """A controller's records in memory: the default where no runtime gave a
    RecordLog (unit tests that drive a controller by hand)."""

    def __init__(self) -> None:
        self.requests: list[RequestRecord] = []
        self.iterations: list[IterationRecord] = []

    def request(self, record: RequestRecord, arrival_index: int) -> None:
        self.requests.append(record)

    def iteration(self, record: IterationRecord) -> None:
        self.iterations.append(record)

    def by_id(self) -> dict[str, RequestRecord]:
        return {r.request_id: r for r in self.requests}
