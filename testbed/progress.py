"""Progress of long work: a count, a rate and (with a known total) an ETA on
stderr through tqdm, shown only when stderr is a terminal, so logs, pipes and
tests stay quiet. `testbed run` shows the requests a simulation has reached
or a real run has finished, `testbed profile` its measurement passes."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm

# the real runtime's line; scripts and tests that drive `testbed run` on a
# pseudo-terminal read "DONE/TOTAL requests done" from it
REQUESTS_DONE = "{n}/{total} requests done [{elapsed}<{remaining}, {rate_fmt}]"


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", enabled: bool = True, bar_format: str | None = None, **kw) -> tqdm:
    """tqdm over `iterable` (or a bar to `update()` by hand), disabled unless
    `enabled` and stderr is a terminal; the bar is cleared when it closes
    unless `leave=True`."""
    from tqdm import tqdm      # here: a run without a bar skips its import (~30 ms of start-up)
    sized = _columns() > 0        # a pseudo-terminal of no size: tqdm would trim or hide every line
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, leave=kw.pop("leave", False),
                dynamic_ncols=sized, ncols=None if sized else 100, nrows=None if sized else 24,
                bar_format=bar_format, disable=not (enabled and sys.stderr.isatty()), **kw)


def request_counter(enabled: bool = True):
    """A callback `show(done, total)` for the real runtime's finished requests."""
    bar: tqdm | None = None

    def show(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            # every count shown and the last one kept: a request ends seldom enough
            bar = progress(total=total, unit="req", enabled=enabled, bar_format=REQUESTS_DONE, mininterval=0,
                           leave=True)
        if done != bar.n:
            bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return show
