"""JSON Lines input shared by the trace readers and the run-record readers:
each non-blank line one JSON object; a bad line is an error naming file:line.
Lines come from text_lines, so an endless or binary line is refused after
reading at most `max_line_bytes` of it."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from testbed.text_lines import MAX_LINE_BYTES, text_lines


def jsonl_objects(path: str | Path, limit: int | None = None,
                  max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, dict]]:
    """(line number, dict) for each non-blank line, at most `limit` of them."""
    count = 0
    for line_no, text in text_lines(path, max_line_bytes):
        if not text.strip():
            continue
        if limit is not None and count >= limit:
            return
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise ValueError(f"{path}:{line_no}: JSON nested too deeply to be a request") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
        count += 1
        yield line_no, obj
