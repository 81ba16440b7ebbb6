"""One atheris fuzzing campaign: run a decoder's check on every input libFuzzer
makes, for a set time; count executions; record each distinct crash (by
exception type and line), save its input, and keep fuzzing, so one run reports
every crash it met. Shared by the fuzz scripts of this folder.

A check decodes one input and raises for a broken promise; it returns the
decoded value (None for an input refused with the decoder's own error), which
`verify`, unmeasured, may check further (a round trip through the encoder,
whose buffers are not the decoder's allocations). Python
allocations while checking must stay under 100x the input's bytes plus 64 KiB
(measured on every 64th input, tracemalloc being slow; an input over the limit
is measured again, and only a second excess is a crash)."""
from __future__ import annotations

import hashlib
import os
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable


class Campaign:
    def __init__(self, name: str, crash_dir: Path, seconds: float, check: Callable[[bytes], Any],
                 verify: Callable[[Any], None] | None = None) -> None:
        self.name, self.crash_dir, self.check, self.verify = name, crash_dir, check, verify
        self.executions = 0
        self.crashes: dict[str, Path] = {}      # signature -> saved input
        self.t0 = time.monotonic()
        self.deadline = self.t0 + seconds

    def warm(self, directory: Path) -> None:
        """Check the seed inputs once, unmeasured: a decoder's first message of a
        kind builds its cached checkers, which is not a per-input allocation."""
        for path in sorted(directory.iterdir()):
            try:
                result = self.check(path.read_bytes())
                if self.verify is not None and result is not None:
                    self.verify(result)
            except Exception as e:
                self._record(e, path.read_bytes())

    def one_input(self, data: bytes) -> None:
        self.executions += 1
        if self.executions % 1024 == 0 and time.monotonic() >= self.deadline:
            # libFuzzer's own -max_total_time leaves by _exit, skipping atexit: report here
            self.report()
            os._exit(1 if self.crashes else 0)
        try:
            if self.executions % 64:
                result = self.check(data)
            else:
                limit = 100 * len(data) + (64 << 10)
                result, peak = self._measured(data)
                # over the limit twice: a first pass can build a decoder's caches (a new error path's text)
                if peak > limit and (peak := self._measured(data)[1]) > limit:
                    raise AssertionError(f"decoding {len(data)} bytes allocated {peak} bytes")
            if self.verify is not None and result is not None:
                self.verify(result)
        except Exception as e:      # a crash: record it and keep fuzzing
            self._record(e, data)

    def _measured(self, data: bytes) -> tuple[Any, int]:
        """The check's result on `data` and its peak Python allocation in bytes."""
        tracemalloc.start()
        try:
            return self.check(data), tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def _record(self, e: Exception, data: bytes) -> None:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
        signature = f"{type(e).__name__} at {where}"
        if signature in self.crashes:
            return
        self.crash_dir.mkdir(parents=True, exist_ok=True)
        path = self.crash_dir / f"crash-{hashlib.sha1(data).hexdigest()[:16]}"
        path.write_bytes(data)
        self.crashes[signature] = path
        print(f"\nCRASH {signature}: {str(e)[:300]} (input: {path})", file=sys.stderr, flush=True)

    def report(self) -> None:
        elapsed = time.monotonic() - self.t0
        print(f"\n{self.name}: {self.executions:,} executions in {elapsed:.0f} s "
              f"({self.executions / max(elapsed, 1e-9):,.0f}/s), {len(self.crashes)} distinct crash(es)",
              flush=True)
        for signature, path in self.crashes.items():
            print(f"  {signature}  input: {path}", flush=True)


def printable_error(message: str) -> None:
    """A decoder's refusal must read as one short printable line."""
    if not message.isprintable() or len(message) > 1000:
        raise AssertionError(f"unprintable or long error: {message[:200]!r}")
