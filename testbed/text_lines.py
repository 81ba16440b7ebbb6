"""text_lines: the lines of a text file, each read with a bounded buffer.

The trace readers and the run-record readers take files a user hands them.
Iterating a file object reads a whole line, however long, so one 2 GB line
would be 2 GB of memory before any check ran. Here each line is read with a
limit of `max_line_bytes` (+2 for its line ending): a longer line is an error
naming file:line, raised after reading only that much of it. A line that is
not UTF-8 or holds a NUL byte (a binary file, a truncated download) is an
error too.
"""
from __future__ import annotations

import gzip

from collections.abc import Iterator
from pathlib import Path

MiB = 1 << 20

# A trace line is one request: 1M exact prompt token ids are ~7 MiB of JSON,
# a run record with a timestamp per token of a 1M-token output ~20 MiB.
MAX_LINE_BYTES = 64 * MiB


def text_lines(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str]]:
    """(1-based line number, text without its line ending) for each line;
    a file whose name ends in .gz is read through gzip."""
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        line_no = 0
        while True:
            raw = f.readline(max_line_bytes + 2)    # + 2: room for the line's own \r\n
            if not raw:
                return
            line_no += 1
            body = raw.rstrip(b"\r\n")
            if len(body) > max_line_bytes or (len(raw) == max_line_bytes + 2 and not raw.endswith(b"\n")):
                raise ValueError(f"{path}:{line_no}: line is longer than {max_line_bytes:,} bytes (the most a "
                                 "line may hold); is this the right file? A trace holds one request per line")
            nul = body.find(b"\0")
            if nul >= 0:
                raise ValueError(f"{path}:{line_no}: holds a NUL byte at column {nul + 1}: "
                                 "a binary file, not text; give a text trace (CSV or JSON Lines)")
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no}: byte {body[e.start]:#04x} at column {e.start + 1} is not "
                                 "UTF-8 text: a binary or mis-encoded file; save the trace as UTF-8") from None
            yield line_no, text
