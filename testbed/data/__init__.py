"""Installed public datasets, by name (stand-in until the data manager lands).

`dataset_dir(name, needed_by)` is the directory of dataset `name` under
$TESTBED_DATA (default ~/.cache/pd-testbed); MissingDataset says which
dataset is missing and what needs it."""
from __future__ import annotations

import os
from pathlib import Path


class MissingDataset(ValueError):
    pass


def dataset_dir(name: str, needed_by: str, data_dir=None) -> Path:
    root = Path(data_dir or os.environ.get("TESTBED_DATA", "~/.cache/pd-testbed")).expanduser()
    path = root / name
    if not path.is_dir():
        raise MissingDataset(f"{needed_by}: needs the dataset '{name}', not installed in {root}; "
                             f"install it there (or set TESTBED_DATA to a directory holding {name}/)")
    return path
