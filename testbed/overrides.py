"""Checks of command-line overrides that Hydra answers in many lines, said in
one line like every other config error (used by `testbed run` and `testbed
capacity`)."""
from __future__ import annotations

from testbed.model.config import CONF_DIR


def unknown_preset(argv: list[str]) -> str | None:
    """Hydra answers an unknown group choice (`model=nope`) with a dozen lines
    of search paths; say it in one line, like every other config error."""
    for arg in argv:
        group, sep, value = arg.partition("=")
        if not sep or not group.isidentifier() or not (CONF_DIR / group).is_dir():
            continue
        if any(c in value for c in "()[]$*"):
            continue  # sweep syntax (choice(...), range(...), globs): Hydra's to judge
        for choice in value.split(","):
            if choice and choice != "null" and not (CONF_DIR / group / f"{choice}.yaml").exists():
                names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
                return (f"{group}='{choice}' is not a known preset (conf/{group}/); "
                        f"choose one of: {', '.join(names) or '(none yet)'}")
    return None
