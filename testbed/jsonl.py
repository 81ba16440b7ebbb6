"""JSON Lines, both ways.

Input, shared by the trace readers and the run-record readers: each
non-blank line one JSON object; a bad line is an error naming file:line.
Lines come from text_lines, so an endless or binary line is refused after
reading at most `max_line_bytes` of it.

Output, the run records' lines (testbed/metrics.py write_jsonl, and the
record writer process, testbed/record_writer.py): `jsonl_text` of a chunk of
records given as columns, exactly the lines json.dumps writes for each
record's field dict."""
from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from testbed.text_lines import MAX_LINE_BYTES, text_lines


def _ends_unterminated(path: str | Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            return False
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def jsonl_objects(path: str | Path, limit: int | None = None, max_line_bytes: int = MAX_LINE_BYTES,
                  cut_tail: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, dict) for each non-blank line, at most `limit` of them.
    `cut_tail`: a last line without its line ending that is not whole JSON
    (a writer stopped mid-line: a full disk, a kill) is dropped, not an error."""
    count = 0
    cut: ValueError | None = None          # a bad line, forgiven only if it is the file's unterminated last
    for line_no, text in text_lines(path, max_line_bytes):
        if not text.strip():
            continue
        if cut is not None:
            raise cut
        if limit is not None and count >= limit:
            return
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            error = ValueError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})")
            if cut_tail:
                cut = error
                continue
            raise error from None
        except RecursionError:
            raise ValueError(f"{path}:{line_no}: JSON nested too deeply to be a request") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
        count += 1
        yield line_no, obj
    if cut is not None and not _ends_unterminated(path):
        raise cut


def jsonl_text(names: Sequence[str], columns: Sequence[list]) -> str:
    """The JSON Lines of len(columns[0]) records whose field `names[i]` holds
    `columns[i]`, keys in that order: json.dumps of each record's dict, a line each."""
    # json.dumps per record costs a few µs, a second for a 200K-iteration run:
    # each column is encoded in one call instead, and the lines are joined from
    # the columns and the text between them (a third of the time of filling a
    # %s template per line)
    between = ["{" + json.dumps(names[0]) + ": "] + [f", {json.dumps(name)}: " for name in names[1:]]
    parts = []
    for text, column in zip(between, columns):
        parts += (itertools.repeat(text), _json_column(column))
    parts.append(itertools.repeat("}\n"))
    return "".join(itertools.chain.from_iterable(zip(*parts)))


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
