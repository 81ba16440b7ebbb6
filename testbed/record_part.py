"""A run's records written in parts and merged (runtime/sim_split.py).

Each part of a split simulation writes a part directory with a PartLog:
requests.jsonl and iterations.jsonl as any run's (a part's requests in
their order of arrival, its iterations in the order its frontend received
them), and beside them
- iterations.keys: per iteration line, the instant the frontend received it
  and its worker's index in the run's worker order (ITERATION_KEYS rows);
- requests.index: per request line, its place among the run's arrivals
  (int64, written by the part's runtime).
Its RunStats (the part's summary state) goes to the parent as it is.

`merge_parts` appends the parts' lines to the run's RecordLog in the single
run's order (requests by arrival; iterations by received instant, ties in
worker order, one worker's in their order: IterationOrder's order) and
gives it the RunStats merged from the parts' with every record at its place
(RunStats.merged), so the merged files and summary are the single-process
run's. The lines are copied as they are, never parsed (a 12K-request run
has ~2.4M iteration lines); memory holds a window of rows per part, and
the places of the iterations (8 bytes each, as the RunStats holds).
"""
from __future__ import annotations

from itertools import islice
from pathlib import Path

import numpy as np

from testbed.metrics import IterationRecord
from testbed.record_log import ITERATIONS_FILE, REQUESTS_FILE, RecordLog
from testbed.run_stats import RunStats

KEYS_FILE, INDEX_FILE = "iterations.keys", "requests.index"
ITERATION_KEYS = np.dtype([("received_s", "<f8"), ("worker", "<i4")])
WINDOW = 65_536        # rows read from a part at a time


class PartLog(RecordLog):
    """A RecordLog that also writes iterations.keys (every iteration comes
    with the instant it was received: IterationOrder's extend_iterations)."""

    def __init__(self, stats: RunStats, part_dir: str | Path, worker_index: dict[str, int], **kwargs):
        super().__init__(stats, part_dir, **kwargs)
        self._worker_index = worker_index
        self._received: list[float] = []            # of the pending iterations
        self._keys = open(Path(part_dir) / KEYS_FILE, "wb")

    def iteration(self, record: IterationRecord) -> None:
        raise AssertionError("a part's iterations come with their received instants (extend_iterations)")

    def extend_iterations(self, records: list[IterationRecord], received_s: list[float] | None = None) -> None:
        if received_s is None or len(received_s) != len(records):
            raise AssertionError("a part's iterations come with their received instants, one each")
        self._received += received_s
        super().extend_iterations(records)

    def flush(self) -> None:
        iterations = self._pending["iterations"]
        if iterations:
            self._keys.write(_keys_of(iterations, self._received, self._worker_index).tobytes())
            self._received.clear()
        super().flush()

    def close(self) -> None:
        super().close()
        self._keys.close()


def _keys_of(records: list[IterationRecord], received_s: list[float], worker_index: dict[str, int]) -> np.ndarray:
    keys = np.empty(len(records), ITERATION_KEYS)
    keys["received_s"] = received_s
    keys["worker"] = [worker_index[it.worker] for it in records]
    return keys


def merge_parts(part_dirs: list[Path], part_stats: list[RunStats], log: RecordLog) -> None:
    """The parts' records into `log` (a fresh log with a run directory), in
    the single run's order, and their RunStats merged into its."""
    request_places = _merge_requests(part_dirs, log)
    iteration_places = _merge_iterations(part_dirs, log)
    log.stats = RunStats.merged(part_stats, request_places, iteration_places)


def _merge_requests(part_dirs: list[Path], log: RecordLog) -> list[np.ndarray]:
    """Request lines in arrival order; each part's places."""
    places = [np.fromfile(d / INDEX_FILE, dtype=np.int64) for d in part_dirs]
    total = sum(len(p) for p in places)
    owner = np.full(total, -1, dtype=np.int64)
    for part, p in enumerate(places):
        if len(p) and (p.min() < 0 or p.max() >= total or (np.diff(p) <= 0).any()):
            raise AssertionError(f"part {part}'s arrivals are not an increasing set of places below {total}")
        owner[p] = part
    if (owner < 0).any():
        raise AssertionError(f"arrival {int(np.argmin(owner))} is in no part")
    files = [open(d / REQUESTS_FILE, "rb") for d in part_dirs]
    try:
        chunk: list[bytes] = []
        for part in owner.tolist():
            line = files[part].readline()
            if not line:
                raise AssertionError(f"part {part} has fewer request lines than arrivals")
            chunk.append(line)
            if len(chunk) == 1024:
                log.append_lines("requests", b"".join(chunk))
                chunk.clear()
        log.append_lines("requests", b"".join(chunk))
        if any(f.read(1) for f in files):
            raise AssertionError("a part has more request lines than arrivals")
    finally:
        for f in files:
            f.close()
    return places


class _Rows:
    """One part's iteration rows and lines, a window at a time."""

    def __init__(self, part_dir: Path, part: int):
        self.part = part
        self._keys = open(part_dir / KEYS_FILE, "rb")
        self._lines = open(part_dir / ITERATIONS_FILE, "rb")
        self.keys = np.empty(0, ITERATION_KEYS)
        self.lines: list[bytes] = []
        self.more = True            # rows left unread

    def read(self) -> None:
        keys = np.fromfile(self._keys, dtype=ITERATION_KEYS, count=WINDOW)
        lines = list(islice(self._lines, len(keys)))
        if len(lines) != len(keys):
            raise AssertionError(f"part {self.part}: fewer iteration lines than keys")
        if len(keys) < WINDOW:
            self.more = False
            if self._lines.read(1):
                raise AssertionError(f"part {self.part}: more iteration lines than keys")
        self.keys = np.concatenate([self.keys, keys]) if len(self.keys) else keys
        self.lines += lines

    def take(self, n: int) -> tuple[np.ndarray, list[bytes]]:
        keys, lines = self.keys[:n], self.lines[:n]
        self.keys, self.lines = self.keys[n:], self.lines[n:]
        return keys, lines

    def close(self) -> None:
        self._keys.close()
        self._lines.close()


def _merge_iterations(part_dirs: list[Path], log: RecordLog) -> list[np.ndarray]:
    """Iteration lines in the run's order; each part's places. Each part's
    rows are in (received instant, worker) order; the rows before the least
    of the parts' last read instants (every unread row is at or after it)
    go next, merged by that key."""
    parts = [_Rows(d, i) for i, d in enumerate(part_dirs)]
    places: list[list[np.ndarray]] = [[] for _ in parts]
    written = 0
    try:
        while True:
            for p in parts:
                if p.more and not len(p.keys):
                    p.read()
            held = [p for p in parts if len(p.keys)]
            if not held:
                return [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in places]
            bound = min((p.keys["received_s"][-1] for p in parts if p.more), default=float("inf"))
            counts = [int(np.searchsorted(p.keys["received_s"], bound, side="left")) for p in held]
            if not any(counts):
                # every row held is at the bound: read on where it was the last read
                for p in held:
                    if p.more and p.keys["received_s"][-1] == bound:
                        p.read()
                continue
            taken = [(p, *p.take(n)) for p, n in zip(held, counts) if n]
            total = sum(counts)
            if len(taken) == 1:
                p, _, lines = taken[0]
                places[p.part].append(np.arange(written, written + total))
            else:
                # a stable sort: one worker's rows keep their order
                keys = np.concatenate([k for _, k, _ in taken])
                order = np.lexsort((keys["worker"], keys["received_s"]))
                lines = [line for _, _, ls in taken for line in ls]
                lines = list(map(lines.__getitem__, order.tolist()))
                place = np.empty(total, dtype=np.int64)
                place[order] = np.arange(written, written + total)
                start = 0
                for p, k, _ in taken:
                    places[p.part].append(place[start:start + len(k)])
                    start += len(k)
            log.append_lines("iterations", b"".join(lines))
            written += total
    finally:
        for p in parts:
            p.close()
