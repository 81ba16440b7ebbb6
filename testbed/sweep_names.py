"""W&B names for the points of a Hydra sweep (`testbed run -m ...`): the
group is the sweep (its directory, `hydra.sweep.dir`), and each run is named
by the values its sweep varies, e.g. `mode=disagg,workload.prompt_len=4096`
for `-m runtime=sim mode=colocated,disagg workload.prompt_len=1024,4096`.
The overrides every point shares (`runtime=sim`) stay out of the name; a
`-m` with nothing swept names each run by all its overrides."""
from __future__ import annotations

import hashlib

from hydra.core.override_parser.overrides_parser import OverridesParser

_MAX_GROUP = 128        # W&B's limit on a group's length


def swept_keys(argv: list[str]) -> set[str]:
    """The keys the command line sweeps over (a,b lists, range(), choice(), glob()).
    Hydra's own flags and their values (-m, --config-name NAME) are not overrides: skipped."""
    parser, keys = OverridesParser.create(), set()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            (o,) = parser.parse_overrides([arg])
        except Exception:       # Hydra has accepted the command line; what it parses otherwise is no override
            continue
        if o.is_sweep_override() and not o.key_or_group.startswith("hydra"):
            keys.add(o.key_or_group)
    return keys


def point_name(task_overrides: list[str], swept: set[str]) -> str | None:
    """This point's run name from its own overrides (Hydra's hydra.overrides.task),
    in command-line order; None when it has none."""
    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    chosen = [o for o in parsed if o.key_or_group in swept] or parsed
    return ",".join(f"{o.get_key_element()}={o.get_value_element_as_str()}" for o in chosen) or None


_MAX_DIRNAME = 200      # bytes of a point's directory name from its overrides (Linux allows 255 in all)


def dir_safe(override_dirname: str) -> str:
    """A sweep point's directory name from Hydra's override_dirname: no '/'
    (one directory, not a path), and past _MAX_DIRNAME bytes cut there with a
    hash of the whole (a sweep of many overrides failed with 'File name too
    long'); the point's overrides are in its config.yaml and .hydra/."""
    name = override_dirname.replace("/", "_")
    if len(name.encode()) <= _MAX_DIRNAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return name.encode()[:_MAX_DIRNAME - 11].decode(errors="ignore") + "~" + digest


def sweep_group(sweep_dir: str) -> str:
    """The sweep's directory as Hydra was given it (multirun/DATE/TIME by default), its tail when too long."""
    return str(sweep_dir)[-_MAX_GROUP:]
