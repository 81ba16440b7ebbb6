"""The `experiment` node of the run config: None for a plain run, else the
settings of the study `testbed run experiment=NAME` runs. Each study's
settings are its own dataclass (a StudyConfig, beside the study's code),
registered with Hydra's ConfigStore as `study/NAME`; conf/experiment/NAME.yaml
takes it as its `experiment` node and only sets values (`NAME-full` is the
long sweep)."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import ClassVar


@dataclass
class StudyConfig:
    name: str                                # the study's key in STUDIES (each subclass sets its own)
    variant: str = "default"                 # default | full | real: which preset ran
    run: ClassVar[str]                       # "module:function(cfg, out_dir, log) -> dict"

    def validate(self) -> None:
        study = next(f.default for f in fields(self) if f.name == "name")
        if self.name != study:
            raise ValueError(f"experiment.name='{self.name}': these are the settings of {type(self).__name__} "
                             f"(the {study} study); choose a study with experiment=NAME")


def at_least(cfg: StudyConfig, least: int, *names: str) -> None:
    """Each named field (a number, or a list of them) is >= least."""
    for f in names:
        v = getattr(cfg, f)
        if any(x < least for x in (v if isinstance(v, list) else [v])):
            what = "every value must be" if isinstance(v, list) else "must be"
            raise ValueError(f"experiment.{f}: {what} >= {least}, got {v}")


def positive(cfg: StudyConfig, *names: str) -> None:
    for f in names:
        if not getattr(cfg, f) > 0:
            raise ValueError(f"experiment.{f}: must be > 0, got {getattr(cfg, f)}")


def fraction(cfg: StudyConfig, name: str) -> None:
    """A search's bracket: a fraction in (0, 1)."""
    if not 0 < getattr(cfg, name) < 1:
        raise ValueError(f"experiment.{name}: a fraction in (0, 1), got {getattr(cfg, name)}")


def parse_split(split: str) -> tuple[int, int]:
    """'2P1D' -> (2, 1): prefill and decode workers of a disaggregated point."""
    m = re.fullmatch(r"(\d+)P(\d+)D", split)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"experiment.disagg_splits: '{split}' is not of the form xPyD with x, y >= 1 (e.g. 1P1D)")
    return int(m[1]), int(m[2])
