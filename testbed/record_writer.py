"""RecordWriter: a run's JSON Lines encoded and written by a process of its own.

Encoding the records is a fixed cost per record (a float's repr is ~0.5-1 µs
on the CPUs this runs on), which a long simulated run pays for millions of
iteration lines and token times: about a sixth of its time. The RecordLog
(testbed/record_log.py) hands that work to this child process once a run has
written enough records to repay its start (~0.1 s), so that it runs on
another core beside the simulation; the files are byte for byte the ones
write_jsonl writes.

The parent takes each chunk's columns (testbed/metrics.py record_columns) and
sends them down the child's stdin as msgpack (floats travel as their 8 bytes,
so nothing is rounded); a chunk msgpack cannot carry (an int past 64 bits, a
string that is not UTF-8) is encoded in the parent and goes as its text. The
child appends each chunk's lines to the file named for its kind, flushing
after each, and exits at the end of its input, which is when the parent
closes the pipe or dies. A full pipe blocks the parent: the records in flight
stay bounded. A child that dies early is reported by the next write or by
close, with what it printed. The child runs in a session of its own and
ignores SIGINT and SIGTERM: a Ctrl-C or a kill of the run's process group
stops the run, which then writes what it measured through the child and
closes the pipe (the child's end).

    python -m testbed.record_writer KIND=PATH ...      (the child; appends to each PATH)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable

import msgpack

from testbed.jsonl import jsonl_text
from testbed.output_faults import named

_OS_ERROR = 3                   # the child's exit code when its file refused a write
_COLUMNS, _TEXT = 0, 1          # a frame: [_COLUMNS, kind, names, columns] or [_TEXT, kind, ascii bytes]


class InlineWriter:
    """RecordWriter's interface in this process: each chunk encoded and appended here
    (a run's first records, and every record of a short run)."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._files = {kind: open(path, "a") for kind, path in paths.items()}

    def write(self, kind: str, chunks: Iterable[tuple[list[str], list[list]]]) -> None:
        f = self._files[kind]
        try:
            for names, columns in chunks:
                f.write(jsonl_text(names, columns))
        except OSError as e:
            raise named(e, f.name) from None

    def write_bytes(self, kind: str, data: bytes) -> None:
        """Append lines already encoded (ASCII, as jsonl_text writes them)."""
        f = self._files[kind]
        try:
            f.flush()
            f.buffer.write(data)
        except OSError as e:
            raise named(e, f.name) from None

    def flush(self) -> None:
        for f in self._files.values():
            try:
                f.flush()
            except OSError as e:
                raise named(e, f.name) from None

    def close(self) -> None:
        for f in self._files.values():
            f.close()


class RecordWriterError(RuntimeError):
    """The writer process is gone or failed: the records after its death were not written."""


class RecordWriter:
    def __init__(self, paths: dict[str, str]) -> None:
        """paths: kind -> file the child appends that kind's lines to."""
        self._proc = subprocess.Popen([sys.executable, "-m", "testbed.record_writer",
                                       *(f"{kind}={path}" for kind, path in paths.items())],
                                      stdin=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._packer = msgpack.Packer(use_bin_type=True)

    def write(self, kind: str, chunks: Iterable[tuple[list[str], list[list]]]) -> None:
        """Append `kind`'s (names, columns) chunks (metrics.record_columns) to its file."""
        for names, columns in chunks:
            try:
                frame = self._packer.pack([_COLUMNS, kind, names, columns])
            except (OverflowError, TypeError, ValueError, UnicodeEncodeError):
                frame = self._packer.pack([_TEXT, kind, jsonl_text(names, columns).encode("ascii")])
            self._send(frame)

    def _send(self, frame: bytes) -> None:
        try:
            self._proc.stdin.write(frame)
        except (BrokenPipeError, ValueError):
            raise self._died() from None

    def flush(self) -> None:
        """What was written so far on its way to the child (it writes each chunk out as it comes)."""
        try:
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise self._died() from None

    def close(self) -> None:
        """Every record on disk; raises RecordWriterError if the child failed. Safe to call twice."""
        if self._proc.stdin.closed:
            return
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        if self._proc.wait() != 0:
            raise self._died()

    def _died(self) -> Exception:
        """RecordWriterError, or the OSError the child's file raised (a full disk)."""
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        rc = self._proc.wait()
        said = self._proc.stderr.read().decode(errors="replace").strip().splitlines()[-5:]
        if rc == _OS_ERROR and said:
            code, _, path = said[-1].partition(" ")
            return OSError(int(code), os.strerror(int(code)), path)      # the run's output fault, named
        return RecordWriterError(f"the record writer process (pid {self._proc.pid}) exited with {rc}"
                                 + (f": {' | '.join(said)}" if said else "") + "; the run's records are incomplete")


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):      # the parent ends it, by closing the pipe
        signal.signal(sig, signal.SIG_IGN)
    files = {}
    for arg in argv:
        kind, _, path = arg.partition("=")
        files[kind] = open(path, "a")
    # unbuffered: each read returns what has come, so a chunk is written as soon as it is whole
    unpacker = msgpack.Unpacker(open(0, "rb", buffering=0, closefd=False), raw=False, strict_map_key=False,
                                max_buffer_size=1 << 30)
    for frame in unpacker:
        if frame[0] == _COLUMNS:
            _, kind, names, columns = frame
            text = jsonl_text(names, columns)
        else:
            _, kind, data = frame
            text = data.decode("ascii")
        f = files[kind]
        try:
            f.write(text)
            f.flush()
        except OSError as e:           # told to the parent as "ERRNO PATH" (a full disk, a file gone read-only)
            print(f"{e.errno} {f.name}", file=sys.stderr, flush=True)
            return _OS_ERROR
    for f in files.values():
        f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
