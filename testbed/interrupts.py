"""How a run stops on a signal: SIGTERM (a job scheduler, `kill`) means what
Ctrl-C means — stop serving, abort what is left, stop the workers, write what
was measured — and a signal arriving while the workers are being stopped is
ignored, so the bounded shutdown finishes instead of leaving
processes behind. Only the main thread can install handlers: elsewhere (a Ray
actor, a thread pool) these are no-ops."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class Interrupts:
    """Which signal interrupted the run (None: none did)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports it (130 for Ctrl-C, 143 for SIGTERM)."""
        return 128 + (self.signum or signal.SIGINT)

    @contextmanager
    def terminate_as_interrupt(self):
        """Within: SIGINT and SIGTERM raise KeyboardInterrupt, and are remembered."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def interrupt(signum, frame):
            self.signum = signum
            raise KeyboardInterrupt(signal.Signals(signum).name)
        previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


@contextmanager
def deferred():
    """Within: SIGINT and SIGTERM are ignored (the caller is already stopping,
    within its own bound, or starting a process: SIG_IGN is inherited through
    exec, so a worker is born ignoring the process group's Ctrl-C, which its
    frontend handles); on leaving, the previous handlers come back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
