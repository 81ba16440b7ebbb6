"""Forms computed from a dataset (condensed tables, fitted curves), made on
first use and cached in the data directory under derived/DATASET/FORM/KEY,
KEY being the dataset's checksum and the version of the code that makes the
form: new data or new code give a new entry, never a stale one. Nothing
derived is committed to the repository."""
from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from testbed.data.store import disk_error, data_root, dataset_dir, installed_manifest

COMPLETE = ".complete"


def code_version(*sources: Path) -> str:
    """The version of the code that makes a form: a hash of its source files."""
    h = hashlib.sha256()
    for path in sources:
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def derived_dir(dataset: str, form: str, version: str, make: Callable[[Path, Path], None], needed_by: str,
                data_dir: str | os.PathLike | None = None) -> Path:
    """The directory of `form` derived from `dataset`: `make(source_dir,
    dest_dir)` writes it the first time; later calls find it."""
    src = dataset_dir(dataset, needed_by, data_dir)
    root = data_root(data_dir)
    manifest = installed_manifest(dataset, root)
    final = root / "derived" / dataset / form / f"{manifest.checksum[:16]}-{version}"
    if (final / COMPLETE).is_file():
        return final
    staging = final.parent / f".staging-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(parents=True)
        make(src, staging)
        (staging / COMPLETE).write_text("")
        try:
            staging.rename(final)
        except OSError:
            if not (final / COMPLETE).is_file():     # not another process's finished copy
                raise
        return final
    except OSError as e:
        raise disk_error(e, final.parent) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
