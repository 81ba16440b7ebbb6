"""Trace readers: a trace file -> a list of TraceRow (lengths, maybe a timestamp,
maybe exact tokens or shared-block ids), in file order.

build.py picks a reader by `workload.trace_format` from READERS. Every reader is
strict: a line it cannot read raises ValueError naming `file:line` and what is
wrong; no row is ever skipped. Blank lines are not rows.
"""
from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from testbed.jsonl import jsonl_objects
from testbed.workloads.config import WorkloadConfig


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
    return int(number)


def _csv_rows(path: Path, columns: tuple[str, ...], limit: int | None):
    """(line number, row dict) for each data row of a CSV with these columns."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{_where(path, 1)}: header {reader.fieldnames} lacks column(s) {missing}; "
                             f"expected {','.join(columns)}")
        for n, row in enumerate(reader):
            if limit is not None and n >= limit:
                return
            where = _where(path, reader.line_num)
            if None in row or any(row[c] is None for c in columns):
                raise ValueError(f"{where}: expected {len(reader.fieldnames)} fields "
                                 f"({','.join(reader.fieldnames)}), got a different number")
            yield reader.line_num, row


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

    def read(self, path: Path, limit: int | None = None) -> list[TraceRow]:
        rows = []
        for line, row in _csv_rows(path, self.columns, limit):
            where = _where(path, line)
            rows.append(TraceRow(line, _count(row["ContextTokens"], "ContextTokens", where),
                                 _count(row["GeneratedTokens"], "GeneratedTokens", where),
                                 arrival_s=_parse_azure_time(row["TIMESTAMP"], where)))
        return rows


class SarathiCsvReader:
    """num_prefill_tokens,num_decode_tokens per row (Sarathi-Serve's
    arXiv-summarization statistics); no timestamps."""
    columns = ("num_prefill_tokens", "num_decode_tokens")

    def read(self, path: Path, limit: int | None = None) -> list[TraceRow]:
        return [TraceRow(line, _count(row["num_prefill_tokens"], "num_prefill_tokens", _where(path, line)),
                         _count(row["num_decode_tokens"], "num_decode_tokens", _where(path, line)))
                for line, row in _csv_rows(path, self.columns, limit)]


class MooncakeReader:
    """Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids
    (one id per `block_size`-token prompt block; equal ids mean equal tokens)."""
    keys = ("timestamp", "input_length", "output_length", "hash_ids")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def read(self, path: Path, limit: int | None = None) -> list[TraceRow]:
        rows = []
        for line, obj in jsonl_objects(path, limit):
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
        return rows


class JsonlReader:
    """One request per line: `prompt_token_ids` (exact tokens) or `prompt_len`,
    `max_tokens`, optional `arrival_s` (seconds)."""
    keys = ("prompt_token_ids", "prompt_len", "max_tokens", "arrival_s")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def read(self, path: Path, limit: int | None = None) -> list[TraceRow]:
        rows = []
        for line, obj in jsonl_objects(path, limit):
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


READERS = {
    "azure": lambda cfg, vocab_size: AzureReader(),
    "mooncake": lambda cfg, vocab_size: MooncakeReader(cfg.hash_block_size),
    "sarathi_csv": lambda cfg, vocab_size: SarathiCsvReader(),
    "jsonl": lambda cfg, vocab_size: JsonlReader(vocab_size),
}


def read_trace(cfg: WorkloadConfig, vocab_size: int) -> list[TraceRow]:
    """The trace's rows, the first `max_requests` of them when that is set."""
    path = cfg.resolved_trace_path()
    if not path.is_file():
        raise ValueError(f"workload.trace_path: {path} does not exist")
    rows = READERS[cfg.trace_format](cfg, vocab_size).read(path, cfg.max_requests)
    if not rows:
        raise ValueError(f"workload.trace_path: {path} holds no requests")
    return rows
