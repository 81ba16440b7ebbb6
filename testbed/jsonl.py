"""JSON Lines input shared by the trace readers and the run-record readers:
each non-blank line one JSON object; a bad line is an error naming file:line."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def jsonl_objects(path: str | Path, limit: int | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, dict) for each non-blank line, at most `limit` of them."""
    count = 0
    with open(path) as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            if limit is not None and count >= limit:
                return
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
            count += 1
            yield line_no, obj
