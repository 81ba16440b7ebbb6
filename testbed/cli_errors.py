"""One-line errors for command-line overrides that Hydra refuses.

Hydra answers a bad override (`token_budget=abc`, `nope=3`, `model=nope`)
with several lines: its own message, OmegaConf's, the key, the object type,
the config search path, a hint about HYDRA_FULL_ERROR. Every other config
error of this testbed is one line that names the field and says what would be
right. So cli.py first asks `refused_override` (unknown presets, and `+KEY`
for a key the schema lacks, which Hydra would take silently), then runs Hydra
under `hydra_raises()`, which makes Hydra raise instead of printing, and
`override_error` turns what it raised into that one line. Values Hydra accepts
but the testbed does not (`token_budget=-5`) are judged later by
`testbed.config.validate`, also in one line.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from contextlib import contextmanager
from pathlib import Path


def _conf_dir() -> Path:
    from testbed.model.config import CONF_DIR
    return CONF_DIR


def _groups() -> list[str]:
    return sorted(p.name for p in _conf_dir().iterdir() if p.is_dir() and any(p.glob("*.yaml")))


def _root():
    from testbed.config import RunConfig
    return RunConfig


# ---- what the schema knows --------------------------------------------------------

def _hints(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _non_null(hint):
    """`int | None` -> (int, True); `int` -> (int, False)."""
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else hint), True
    return hint, False


def _kind(hint) -> str:
    """What a value of this type is, in words."""
    base, optional = _non_null(hint)
    origin = typing.get_origin(base)
    if base is bool:
        words = "true or false"
    elif base is int:
        words = "a whole number"
    elif base is float:
        words = "a number"
    elif base is str:
        words = "a string"
    elif origin in (list, tuple):
        (item,) = typing.get_args(base)[:1] or (str,)
        words = f"a list of {_kind(item).removeprefix('a ').removeprefix('an ')}s in brackets"
    elif origin is dict:
        words = "a map in braces"
    else:
        words = f"a {getattr(base, '__name__', base)}"
    return f"{words} or null" if optional else words


_TYPICAL = {bool: "true", int: "1", float: "1.0", str: "name"}


def _example(cls, name: str, hint) -> str | None:
    """A value this field takes, as the command line writes it ("=256")."""
    base, _ = _non_null(hint)
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = field.default if field.default is not dataclasses.MISSING else None
    if typing.get_origin(base) in (list, tuple):
        (item,) = typing.get_args(base)[:1] or (str,)
        return "=[" + ",".join([_TYPICAL.get(item, "x")] * 2) + "]"
    if isinstance(default, bool) and base is bool:
        return "=" + str(default).lower()
    if type(default) is base and base in (int, float, str) and default != "":
        return f"={default}"
    return "=" + _TYPICAL[base] if base in _TYPICAL else None


def _section(path: list[str], study=None):
    """The dataclass at `path` below RunConfig, or None where the path leaves
    the dataclasses (a dict or list field holds anything). `experiment` is the
    chosen study's config class (`study`; None: unknown)."""
    cls = _root()
    for i, part in enumerate(path):
        hints = _hints(cls)
        if part not in hints:
            return None
        cls, _ = _non_null(hints[part])
        if i == 0 and part == "experiment":
            cls = study
        if not dataclasses.is_dataclass(cls):
            return None
    return cls


def _study(argv: list[str]):
    """The config class of the study `experiment=PRESET` chooses (PRESET is NAME
    or NAME-VARIANT); None for none or a preset of another name."""
    from testbed.experiments.studies import STUDIES
    presets = [a.partition("=")[2] for a in argv if a.lstrip("+").partition("=")[0] == "experiment"]
    return STUDIES.get(presets[-1].split("-")[0]) if presets else None


# the sections that exist only once chosen (OmegaConf sets no field inside a null), and the choice
_CHOSEN_SECTIONS = {"experiment": "experiment=decision", "adaptive": "scheduler=adaptive"}


def _unchosen(arg: str, argv: list[str]) -> str | None:
    """The one line for `arg` setting a field of a section nothing in argv
    chose; None where its section was chosen (or may be, by a preset)."""
    key = arg.lstrip("+").partition("=")[0]
    section = key.split(".")[0]
    if "." not in key or section not in _CHOSEN_SECTIONS:
        return None
    if section == "experiment" and _study(argv) is None and \
            not any(a.lstrip("+").partition("=")[0] == "experiment" for a in argv):
        from testbed.experiments.studies import STUDIES
        return (f"{key}: a plain run has no experiment section; choose a study with experiment=NAME "
                f"({', '.join(STUDIES)}), e.g. {_CHOSEN_SECTIONS[section]} {arg}")
    if section == "adaptive" and "scheduler=adaptive" not in argv:
        return (f"{key}: the adaptive section comes with the adaptive scheduler; choose it, "
                f"e.g. {_CHOSEN_SECTIONS[section]} {arg}")
    return None


def _no_such_field(full_key: str, cls) -> str:
    parent, _, key = full_key.rpartition(".")
    from testbed.experiments.config import StudyConfig
    if parent == "experiment" and isinstance(cls, type) and issubclass(cls, StudyConfig):
        from testbed.experiments.studies import renamed
        if message := renamed(cls, key):
            return message
    from testbed.sim.config import HardwareConfig, moved_field_error
    if cls is HardwareConfig and (moved := moved_field_error(parent, key)):
        return moved
    names = [f.name for f in dataclasses.fields(cls)]
    where = f"{parent} ({cls.__name__})" if parent else "the run config"
    candidates = names + (_groups() if not parent else [])
    close = difflib.get_close_matches(key, candidates, n=1)
    hint = f"did you mean {(parent + '.') if parent else ''}{close[0]}? " if close else ""
    groups = f"; preset groups: {', '.join(g + '=' for g in _groups())}" if not parent else ""
    return f"{full_key}: no such field in {where}; {hint}fields: {', '.join(names)}{groups}"


def _bad_value(full_key: str, value, cls, name: str) -> str:
    hint = _hints(cls).get(name)
    section, _ = _non_null(hint)
    if dataclasses.is_dataclass(section):
        first = dataclasses.fields(section)[0]
        example = _example(section, first.name, _hints(section)[first.name]) or "=..."
        return (f"{full_key} is a group of fields ({section.__name__}), not one value; set a field of it, "
                f"e.g. {full_key}.{first.name}{example}")
    shown = "null" if value is None else repr(value) if isinstance(value, str) else str(value)
    example = _example(cls, name, hint)
    fix = f"; write it as e.g. {full_key}{example}" if example else ""
    return f"{full_key}={shown} is not {_kind(hint)}{fix}"


# ---- before Hydra ---------------------------------------------------------------

def unknown_preset(argv: list[str]) -> str | None:
    """Hydra answers an unknown group choice (`model=nope`) with a dozen lines
    of search paths; say it in one line, like every other config error."""
    conf = _conf_dir()
    for arg in argv:
        group, sep, value = arg.lstrip("+").partition("=")
        if not sep or not group.isidentifier() or not (conf / group).is_dir():
            continue
        if any(c in value for c in "()[]$*"):
            continue  # sweep syntax (choice(...), range(...), globs): Hydra's to judge
        for choice in value.split(","):
            if choice and choice != "null" and not (conf / group / f"{choice}.yaml").exists():
                names = sorted(p.stem for p in (conf / group).glob("*.yaml"))
                return (f"{group}='{choice}' is not a known preset (conf/{group}/); "
                        f"choose one of: {', '.join(names) or '(none yet)'}")
    return None


def unknown_appended_key(argv: list[str]) -> str | None:
    """`+foo=1` and `++workload.foo=1` add a key the schema lacks: Hydra takes
    them and nothing ever reads them, so a typo would pass unnoticed."""
    for arg in argv:
        if not arg.startswith("+") or "=" not in arg:
            continue
        key = arg.lstrip("+").partition("=")[0]
        path = key.split(".")
        if path[0] == "hydra" or "/" in key or (not path[1:] and path[0] in _groups()):
            continue                    # Hydra's own settings; a group added to the defaults list
        if path[0] == "experiment" and (unchosen := _unchosen(arg, argv)):
            return unchosen
        for depth in range(len(path)):
            cls = _section(path[:depth], _study(argv))
            if cls is None:
                break                   # inside a dict or list field: any key is the user's
            if path[depth] not in _hints(cls):
                return _no_such_field(".".join(path[:depth + 1]), cls) + f" (in '{arg}')"
    return None


def refused_override(argv: list[str]) -> str | None:
    """The first override the testbed refuses before Hydra runs, in one line."""
    return unknown_preset(argv) or unknown_appended_key(argv)


@contextmanager
def hydra_raises():
    """Hydra raises what it would otherwise print (HYDRA_FULL_ERROR), for
    the duration of one run; the variable is restored after it."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


# ---- after Hydra ----------------------------------------------------------------

def _one_line(text: str) -> str:
    lines = [ln.strip().rstrip(".") for ln in str(text).splitlines()]
    return "; ".join(ln for ln in lines if ln and not ln.startswith("See https://hydra.cc"))


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc` (Hydra's log set-up wraps one in a ValueError)."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def override_error(exc: BaseException, task_started: bool, argv: list[str] | None = None) -> str | None:
    """One line for what Hydra or OmegaConf raised while composing the config;
    None for an error of the run itself (it keeps its traceback)."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    if isinstance(cause, OmegaConfBaseException) and isinstance(cause.object_type, type) \
            and dataclasses.is_dataclass(cause.object_type) and cause.full_key:
        if isinstance(cause, (ConfigKeyError, AttributeError)) and "not in" in str(cause):
            return _no_such_field(cause.full_key, cause.object_type)
        if isinstance(cause, ValidationError) and cause.key in _hints(cause.object_type):
            return _bad_value(cause.full_key, cause.value, cause.object_type, str(cause.key))
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, choice = exc.missing_cfg_file.rpartition("/")
        return (f"{group}='{choice}' is not a known preset; choose one of: "
                f"{', '.join(exc.options or []) or '(none)'}")
    if isinstance(exc, OverrideParseException):
        return (f"cannot read the override '{exc.override}' ({_one_line(exc.message)}); write KEY=VALUE, "
                "e.g. token_budget=512, and quote a value holding spaces, commas or brackets")
    if isinstance(exc, (HydraException, OmegaConfBaseException)):
        message = _one_line(exc)
        if isinstance(exc.__cause__, OmegaConfBaseException):
            message += f": {_one_line(exc.__cause__)}"
        if "No match in the defaults list" in message or "Could not override" in message:
            message += f"; preset groups are {', '.join(_groups())} (and hydra/...)"
        return message
    cause = _os_error(exc)
    if cause is not None and cause.filename and not task_started:
        # Hydra makes the output directory and its log file before the task: a name too long, a read-only place
        what = "write" if Path(cause.filename).suffix else "create the output directory"     # a log file, or a directory
        return (f"cannot {what} '{cause.filename}' ({cause.strerror}); set hydra.run.dir "
                "(hydra.sweep.dir for -m) to a writable path whose names are each at most 255 bytes")
    if isinstance(exc, AssertionError) and "NoneType" in str(exc):
        # OmegaConf cannot set a field inside a null section
        unchosen = [m for m in (_unchosen(a, argv or []) for a in argv or []) if m]
        if unchosen:
            return unchosen[0]
    if not task_started:
        # raised by Hydra's override parser before any config existed (e.g. `=3`)
        return f"the overrides were refused ({_one_line(exc)}); each is KEY=VALUE, e.g. token_budget=512"
    return None
