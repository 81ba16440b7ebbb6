"""Launchers by name (`launcher=NAME`): where worker processes run."""
from __future__ import annotations

from testbed.launchers.base import Launcher, WorkerSpec

LAUNCHERS: dict[str, str] = {"local": "testbed.launchers.local:LocalLauncher",   # imported on use
                             "ray": "testbed.launchers.ray:RayLauncher"}


def make_launcher(name: str, cfg) -> Launcher:
    """`cfg`: the RunConfig (a launcher reads its own section, e.g. `ray`)."""
    if name not in LAUNCHERS:
        raise ValueError(f"launcher='{name}' is not known; choose one of: {', '.join(sorted(LAUNCHERS))}")
    import importlib
    module, cls = LAUNCHERS[name].split(":")
    return getattr(importlib.import_module(module), cls)(cfg)


__all__ = ["LAUNCHERS", "Launcher", "WorkerSpec", "make_launcher"]
