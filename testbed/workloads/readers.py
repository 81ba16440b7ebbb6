"""Trace readers: a trace file -> a list of TraceRow (lengths, maybe a timestamp,
maybe exact tokens or shared-block ids), in file order.

build.py picks a reader by `workload.trace_format` from READERS. Every reader is
strict: a line it cannot read raises ValueError naming `file:line` and what is
wrong; no row is ever skipped. Blank lines are not rows. Lines are read with a
bounded buffer (testbed/text_lines.py), so a binary file or one endless line is
refused without reading it whole. A length above MAX_TOKENS is refused, and the
production traces (azure, mooncake) must be in time order: their first N rows
are what `max_requests` keeps, so a file out of order was damaged on the way.
"""
from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from testbed.jsonl import jsonl_objects
from testbed.text_lines import MAX_LINE_BYTES, text_lines
from testbed.workloads.config import WorkloadConfig

# The most tokens one request's prompt or output may hold: 16M, far past any
# context this testbed models (1M), and small enough that a corrupted count
# (10**30, a byte offset) is caught here rather than deep inside a run.
MAX_TOKENS = 1 << 24


@dataclass(frozen=True)
class TraceRow:
    line: int                                   # 1-based line in the file, for errors
    prompt_len: int
    output_len: int
    arrival_s: float | None = None              # absolute; build.py makes it relative
    prompt_token_ids: tuple[int, ...] | None = None   # exact prompt (jsonl)
    hash_ids: tuple[int, ...] | None = None     # shared prompt blocks (mooncake)


def _where(path: Path, line: int) -> str:
    return f"{path}:{line}"


def _count(value, what: str, where: str) -> int:
    """A token count >= 1 from an int, an integral float, or their text."""
    try:
        number = float(value) if isinstance(value, str) else value
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not float(number).is_integer():
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {what}={value!r} is not an integer") from None
    if number < 1:
        raise ValueError(f"{where}: {what}={value!r} must be >= 1 (a request needs a prompt token "
                         "and an output token)")
    if number > MAX_TOKENS:
        raise ValueError(f"{where}: {what}={value!r} is above {MAX_TOKENS:,} tokens, more than any request "
                         "holds; is the column a token count?")
    return int(number)


def _csv_rows(path: Path, columns: tuple[str, ...], limit: int | None, max_line_bytes: int):
    """(line number, row dict) for each data row of a CSV with these columns."""
    lines = text_lines(path, max_line_bytes)
    line_no = 0

    def numbered():
        nonlocal line_no
        for line_no, text in lines:
            yield text
    reader = csv.reader(numbered(), strict=True)
    previous = 0                             # the line the last record ended on
    unclosed = "a quoted field runs on past the end of its line; close its quote"
    try:
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{_where(path, 1)}: the file is empty; expected a header line "
                             f"{','.join(columns)}")
        missing = [c for c in columns if c not in header]
        if missing:
            raise ValueError(f"{_where(path, line_no)}: header {header} lacks column(s) {missing}; "
                             f"expected {','.join(columns)}")
        n, previous = 0, line_no
        for fields in reader:
            if line_no > previous + 1:       # token counts and times never hold a line break
                raise ValueError(f"{_where(path, previous + 1)}: {unclosed}")
            previous = line_no
            if not fields:
                continue                     # a blank line
            if limit is not None and n >= limit:
                return
            if len(fields) != len(header):
                raise ValueError(f"{_where(path, line_no)}: expected {len(header)} fields "
                                 f"({','.join(header)}), got {len(fields)}")
            n += 1
            yield line_no, dict(zip(header, fields))
    except csv.Error as e:                   # a stray quote, a field over csv's size limit
        why = unclosed if line_no > previous + 1 or "end of data" in str(e) else f"not a CSV line ({e})"
        raise ValueError(f"{_where(path, previous + 1)}: {why}") from None


def _in_time_order(path: Path, rows: list[TraceRow], column: str, distinct: bool) -> list[TraceRow]:
    """`rows`, after checking that their arrival times never go backwards (nor
    repeat, when `distinct`: a trace whose clock ticks in 100 ns does not log
    two requests at one instant; a repeat is a duplicated row)."""
    for prev, row in zip(rows, rows[1:]):
        if row.arrival_s < prev.arrival_s:
            raise ValueError(f"{_where(path, row.line)}: {column} is {prev.arrival_s - row.arrival_s:.6g} s "
                             f"before line {prev.line}'s; the trace must be in time order (sort it by {column})")
        if distinct and row.arrival_s == prev.arrival_s:
            raise ValueError(f"{_where(path, row.line)}: {column} repeats line {prev.line}'s: a duplicated "
                             "row; remove it")
    return rows


# The layout the Azure traces use: datetime.fromisoformat reads it ~20x faster
# than strptime (~70 ms over the 8,819-row code trace), but it also accepts other
# ISO layouts, so anything else goes through strptime.
_AZURE_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}")


def _parse_azure_time(text: str, where: str) -> float:
    """'2023-11-16 18:17:03.9799600' -> seconds since the epoch. The fraction has
    7 digits, more than datetime parses, so it is read separately."""
    main, _, frac = text.strip().partition(".")
    try:
        dt = (datetime.fromisoformat(main) if _AZURE_TIME.fullmatch(main)
              else datetime.strptime(main, "%Y-%m-%d %H:%M:%S")).replace(tzinfo=timezone.utc)
        if frac and not frac.isdigit():
            raise ValueError
    except ValueError:
        raise ValueError(f"{where}: TIMESTAMP={text!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]'") from None
    return dt.timestamp() + (float("0." + frac) if frac else 0.0)


class AzureReader:
    """Azure LLM inference trace CSV: TIMESTAMP,ContextTokens,GeneratedTokens."""
    columns = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

    def read(self, path: Path, limit: int | None = None, max_line_bytes: int = MAX_LINE_BYTES) -> list[TraceRow]:
        rows = []
        for line, row in _csv_rows(path, self.columns, limit, max_line_bytes):
            where = _where(path, line)
            rows.append(TraceRow(line, _count(row["ContextTokens"], "ContextTokens", where),
                                 _count(row["GeneratedTokens"], "GeneratedTokens", where),
                                 arrival_s=_parse_azure_time(row["TIMESTAMP"], where)))
        return _in_time_order(path, rows, "TIMESTAMP", distinct=True)


class SarathiCsvReader:
    """num_prefill_tokens,num_decode_tokens per row (Sarathi-Serve's
    arXiv-summarization statistics); no timestamps."""
    columns = ("num_prefill_tokens", "num_decode_tokens")

    def read(self, path: Path, limit: int | None = None, max_line_bytes: int = MAX_LINE_BYTES) -> list[TraceRow]:
        return [TraceRow(line, _count(row["num_prefill_tokens"], "num_prefill_tokens", _where(path, line)),
                         _count(row["num_decode_tokens"], "num_decode_tokens", _where(path, line)))
                for line, row in _csv_rows(path, self.columns, limit, max_line_bytes)]


class MooncakeReader:
    """Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids
    (one id per `block_size`-token prompt block; equal ids mean equal tokens)."""
    keys = ("timestamp", "input_length", "output_length", "hash_ids")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def read(self, path: Path, limit: int | None = None, max_line_bytes: int = MAX_LINE_BYTES) -> list[TraceRow]:
        rows = []
        for line, obj in jsonl_objects(path, limit, max_line_bytes):
            where = _where(path, line)
            missing = [k for k in self.keys if k not in obj]
            if missing:
                raise ValueError(f"{where}: missing key(s) {missing}; a Mooncake line has {list(self.keys)}")
            ts = obj["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                raise ValueError(f"{where}: timestamp={ts!r} is not a number of milliseconds")
            prompt_len = _count(obj["input_length"], "input_length", where)
            hash_ids = obj["hash_ids"]
            if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                         for h in hash_ids):
                raise ValueError(f"{where}: hash_ids must be a list of integers")
            needed = -(-prompt_len // self.block_size)
            if len(hash_ids) != needed:
                raise ValueError(f"{where}: input_length={prompt_len} spans {needed} blocks of "
                                 f"{self.block_size} tokens but hash_ids has {len(hash_ids)}; "
                                 "check workload.hash_block_size")
            rows.append(TraceRow(line, prompt_len, _count(obj["output_length"], "output_length", where),
                                 arrival_s=ts / 1000.0, hash_ids=tuple(hash_ids)))
        # Mooncake logs milliseconds: requests arriving in the same one are common
        return _in_time_order(path, rows, "timestamp", distinct=False)


class JsonlReader:
    """One request per line: `prompt_token_ids` (exact tokens) or `prompt_len`,
    `max_tokens`, optional `arrival_s` (seconds)."""
    keys = ("prompt_token_ids", "prompt_len", "max_tokens", "arrival_s")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def read(self, path: Path, limit: int | None = None, max_line_bytes: int = MAX_LINE_BYTES) -> list[TraceRow]:
        rows = []       # in any order: build.py sorts by arrival_s; a burst shares one time
        for line, obj in jsonl_objects(path, limit, max_line_bytes):
            where = _where(path, line)
            unknown = sorted(set(obj) - set(self.keys))
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {list(self.keys)}")
            if "max_tokens" not in obj:
                raise ValueError(f"{where}: missing 'max_tokens'")
            tokens = obj.get("prompt_token_ids")
            if tokens is not None:
                tokens = self._tokens(tokens, where)
                if "prompt_len" in obj and _count(obj["prompt_len"], "prompt_len", where) != len(tokens):
                    raise ValueError(f"{where}: prompt_len={obj['prompt_len']} disagrees with "
                                     f"{len(tokens)} prompt_token_ids; give one of them")
                prompt_len = len(tokens)
            elif "prompt_len" in obj:
                prompt_len = _count(obj["prompt_len"], "prompt_len", where)
            else:
                raise ValueError(f"{where}: give 'prompt_token_ids' or 'prompt_len'")
            arrival = obj.get("arrival_s")
            if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, (int, float))
                                        or not math.isfinite(arrival) or arrival < 0):
                raise ValueError(f"{where}: arrival_s={arrival!r} must be a number of seconds >= 0")
            rows.append(TraceRow(line, prompt_len, _count(obj["max_tokens"], "max_tokens", where),
                                 arrival_s=None if arrival is None else float(arrival),
                                 prompt_token_ids=tokens))
        return rows

    def _tokens(self, tokens, where: str) -> tuple[int, ...]:
        if not isinstance(tokens, list) or not tokens:
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of integers")
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{where}: prompt_token_ids[{i}]={t!r} is not a token id in "
                                 f"[0, {self.vocab_size}) (the model's vocab_size)")
        return tuple(tokens)


class OtelReader:
    """A vLLM server's OpenTelemetry trace (vLLM's --otlp-traces-endpoint,
    exported as OTLP JSON, one export per line, optionally gzipped): each
    `llm_request` span is one request arriving at the span's start, with
    `gen_ai.usage.prompt_tokens` prompt tokens and `gen_ai.request.max_tokens`
    output tokens (a replay runs with ignore_eos, as the calibration runs did).
    Replaying a server's own trace on `runtime=sim` is how an engine preset is
    checked against it (experiments/benchmarks/bench_engine_presets.py)."""

    def read(self, path: Path, limit: int | None = None, max_line_bytes: int = 1 << 24) -> list[TraceRow]:
        rows = []
        for line, obj in jsonl_objects(path, None, max(max_line_bytes, MAX_LINE_BYTES)):
            where = _where(path, line)
            for span in _otel_spans(obj, where):
                if not isinstance(span, dict) or span.get("name") != OTEL_SPAN:
                    continue
                attrs = _otel_attributes(span, where)
                missing = [k for k in (OTEL_PROMPT, OTEL_OUTPUT) if k not in attrs]
                if missing:
                    raise ValueError(f"{where}: an {OTEL_SPAN} span lacks {missing}; vLLM writes both")
                start = span.get("startTimeUnixNano")
                try:
                    start_ns = int(start)
                except (TypeError, ValueError):
                    raise ValueError(f"{where}: startTimeUnixNano={start!r} is not an integer of nanoseconds") \
                        from None
                rows.append((start_ns, TraceRow(line, _count(attrs[OTEL_PROMPT], OTEL_PROMPT, where),
                                                _count(attrs[OTEL_OUTPUT], OTEL_OUTPUT, where))))
        rows.sort(key=lambda r: r[0])         # export batches end in any order; arrivals are the spans' starts
        if not rows:
            return []
        first = rows[0][0]
        # relative to the first start in integer ns: the absolute time as a float would round to 0.2 µs
        kept = [TraceRow(r.line, r.prompt_len, r.output_len, arrival_s=(ns - first) * 1e-9) for ns, r in rows]
        return kept if limit is None else kept[:limit]


OTEL_SPAN = "llm_request"
OTEL_PROMPT, OTEL_OUTPUT = "gen_ai.usage.prompt_tokens", "gen_ai.request.max_tokens"


def _otel_attributes(span: dict, where: str) -> dict:
    out = {}
    for a in span.get("attributes", []):
        if not isinstance(a, dict) or "key" not in a or not isinstance(a.get("value"), dict) or not a["value"]:
            raise ValueError(f"{where}: a span attribute is not {{key, value: {{...Value}}}}: {str(a)[:80]}")
        out[a["key"]] = next(iter(a["value"].values()))
    return out


def _otel_spans(obj: dict, where: str):
    resource_spans = obj.get("resourceSpans")
    if not isinstance(resource_spans, list):
        raise ValueError(f"{where}: not an OTLP JSON export (no resourceSpans list); give the trace that "
                         "vLLM's --otlp-traces-endpoint collector wrote")
    for rs in resource_spans:
        for ss in rs.get("scopeSpans", []) if isinstance(rs, dict) else []:
            yield from (ss.get("spans", []) if isinstance(ss, dict) else [])


READERS = {
    "azure": lambda cfg, vocab_size: AzureReader(),
    "mooncake": lambda cfg, vocab_size: MooncakeReader(cfg.hash_block_size),
    "sarathi_csv": lambda cfg, vocab_size: SarathiCsvReader(),
    "jsonl": lambda cfg, vocab_size: JsonlReader(vocab_size),
    "otel": lambda cfg, vocab_size: OtelReader(),
}


def read_trace(cfg: WorkloadConfig, vocab_size: int) -> list[TraceRow]:
    """The trace's rows, the first `max_requests` of them when that is set."""
    path = cfg.resolved_trace_path()
    if not path.is_file():
        raise ValueError(f"workload.trace_path: {path} does not exist")
    try:
        rows = READERS[cfg.trace_format](cfg, vocab_size).read(path, cfg.max_requests)
    except OSError as e:
        raise ValueError(f"workload.trace_path: cannot read {path} ({e.strerror or e}); check the file's "
                         "permissions") from None
    if not rows:
        raise ValueError(f"workload.trace_path: {path} holds no requests (no line after the header); "
                         "give a trace with at least one request")
    return rows
