"""`testbed data import NAME DIR`: a dataset from a local copy (an offline
machine, a mirror, the test suite's copy), checked against the same sha256 as
a download, then copied (or linked) into the data directory."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from testbed.data.manifest import KINDS, known_manifest, known_names, manifest_of_dir
from testbed.data.store import DataError, data_root, install


def import_dataset(name: str, src: str | os.PathLike, data_dir: str | os.PathLike | None = None,
                   as_kind: str | None = None, link: bool = False) -> Path:
    """Install dataset `name` from the directory `src`; `as_kind` ('profile'
    or 'trace') registers a user's own files under a new name."""
    src = Path(src).expanduser()
    if not src.is_dir():
        raise DataError(f"import {name}: {src} is not a directory; give the folder that holds the dataset's files")
    manifest = known_manifest(name)
    if as_kind is not None:
        if as_kind not in KINDS:
            raise DataError(f"import {name}: --as-{as_kind} is not a kind; use --as-profile or --as-trace")
        if manifest is not None:
            raise DataError(f"import {name}: '{name}' is a known dataset's name; register your own under another name")
        manifest = manifest_of_dir(name, as_kind, src)
        if not manifest.files:
            raise DataError(f"import {name}: {src} holds no files")
    elif manifest is None:
        raise DataError(f"import {name}: not a known dataset ({', '.join(known_names())}); register your own "
                        f"files with `testbed data import {name} DIR --as-profile` (or --as-trace)")
    missing = [f.path for f in manifest.files if not (src / f.path).is_file()]
    if missing:
        raise DataError(f"import {name}: {src / missing[0]} is missing ({len(missing)} of {len(manifest.files)} "
                        "files); give the folder that holds the dataset's files at their paths")

    def put(entry, dest: Path) -> None:
        if link:
            dest.symlink_to((src / entry.path).resolve())
        else:
            shutil.copyfile(src / entry.path, dest)

    return install(manifest, data_root(data_dir), put)
