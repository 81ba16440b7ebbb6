"""Run CPU-bound output work in a forked child while the parent goes on.

A run ends by writing iterations.jsonl (~10^5 records, most of the time spent
formatting floats, ~0.4 µs each) and by summarizing the requests; the GIL keeps
a thread from overlapping the two, and handing the records to a spawned process
would pickle them. A forked child starts with the parent's records already in
its memory (copy-on-write), so `testbed run` (testbed/run.py) writes that file
there while it computes the summary and writes the rest, on a second core.
Where there is no fork (Windows) the work runs inline, with the same result.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable


class Forked:
    """`work()` started in a child process; `wait()` joins it and raises
    RuntimeError naming `what` if it failed (its traceback is on stderr)."""

    def __init__(self, what: str, work: Callable[[], None]):
        self.what = what
        self.pid = None
        if not hasattr(os, "fork"):
            work()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                work()
                status = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                # skip the parent's atexit handlers and buffered output: they are the parent's
                os._exit(status)
        self.pid = pid

    def wait(self) -> None:
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{self.what} failed in its forked writer (exit status "
                               f"{os.waitstatus_to_exitcode(status)}); see the traceback above")
