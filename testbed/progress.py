"""Progress of long work: a count, a rate and (with a known total) an ETA on
stderr through tqdm, shown only when stderr is a terminal, so logs, pipes and
tests stay quiet. `testbed run` shows the requests served, `testbed profile`
its measurement passes."""
from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", enabled: bool = True) -> tqdm:
    """tqdm over `iterable` (or a bar to `update()` by hand), disabled unless
    `enabled` and stderr is a terminal; the bar is cleared when it closes."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not (enabled and sys.stderr.isatty()))


def request_counter(total: int | None, enabled: bool = True):
    """A callback `show(done, total)` for the real runtime's finished requests."""
    bar = progress(total=total, desc="requests done", unit="req", enabled=enabled)

    def show(done: int, of: int) -> None:
        if bar.total != of:
            bar.total = of
            bar.refresh()
        bar.update(done - bar.n)
        if done >= of:
            bar.close()
    return show
