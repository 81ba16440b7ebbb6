"""The data directory: where datasets live once fetched or imported, one
directory per dataset name (the files at their manifest paths, plus the
manifest as `.manifest.json`), and `derived/` for what is computed from them.

A dataset is installed whole or not at all: its files are gathered into a
hidden staging directory, each checked against its sha256, and the staging
directory is renamed into place only when all of them match. A consumer asks
`dataset_dir(name, needed_by)`, which checks the installed files again (a file
altered or truncated after import fails in one line) and otherwise names the
commands that bring the dataset."""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

from testbed.data.manifest import Manifest, known_manifest, known_names, sha256_of

ENV = "TESTBED_DATA"
DEFAULT_DIR = "~/.cache/pd-testbed"
MANIFEST_FILE = ".manifest.json"


class DataError(RuntimeError):
    """A dataset problem, said in one line (the command line prints it as `error: ...`)."""


class MissingDataset(DataError):
    """A dataset a preset needs is not in the data directory."""


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory: `data_dir`, else $TESTBED_DATA, else ~/.cache/pd-testbed."""
    chosen = data_dir if data_dir not in (None, "") else os.environ.get(ENV) or DEFAULT_DIR
    return Path(chosen).expanduser()


def bring_commands(name: str) -> str:
    return f"`testbed data fetch {name}` or, from a local copy, `testbed data import {name} DIR`"


def installed_manifest(name: str, root: Path) -> Manifest | None:
    """The manifest an installed dataset is checked against: the package's for
    a known name (a copy in the data directory cannot loosen it), else the
    one registered with the user's own files."""
    marker = root / name / MANIFEST_FILE
    if not marker.is_file():
        return None
    return known_manifest(name) or Manifest.from_json(marker.read_text(), registered=True)


# (path, size, mtime_ns) -> sha256: a process checks each file once while it is unchanged
_checked: dict[tuple[str, int, int], str] = {}


def altered_file(manifest: Manifest, directory: Path) -> str | None:
    """The first file of an installed dataset that is missing or no longer
    matches its sha256, said in words; None when all match."""
    for f in manifest.files:
        path = directory / f.path
        try:
            st = path.stat()
        except OSError:
            return f"{path} is missing"
        if st.st_size != f.size:
            return f"{path} has {st.st_size} bytes, its manifest {f.size} (truncated or altered after import)"
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in _checked:
            _checked[key] = sha256_of(path)
        if _checked[key] != f.sha256:
            return f"{path} does not match its sha256 (altered after import)"
    return None


def dataset_dir(name: str, needed_by: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The directory of an installed dataset, its files checked; MissingDataset
    (one line naming `needed_by`, the dataset and the commands) otherwise."""
    root = data_root(data_dir)
    manifest = installed_manifest(name, root)
    if manifest is None:
        if known_manifest(name) is None:
            raise MissingDataset(f"{needed_by} needs the dataset '{name}', which is neither known "
                                 f"({', '.join(known_names())}) nor registered in the data directory {root}; "
                                 f"register your own with `testbed data import {name} DIR --as-profile` "
                                 "(or --as-trace)")
        raise MissingDataset(f"{needed_by} needs the dataset '{name}', not in the data directory {root} "
                             f"(data.dir or ${ENV}, default {DEFAULT_DIR}); bring it with {bring_commands(name)}")
    bad = altered_file(manifest, root / name)
    if bad:
        raise DataError(f"dataset '{name}' (needed by {needed_by}): {bad}; bring it again with "
                        f"{bring_commands(name)}")
    return root / name


def disk_error(e: OSError, where: Path) -> DataError:
    if e.errno == errno.ENOSPC:
        return DataError(f"the data directory's disk is full ({where}); free space there or set ${ENV} "
                         "to a directory with room")
    if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOTDIR):
        return DataError(f"cannot write the data directory ({e.filename or where}: {e.strerror}); set ${ENV} "
                         "to a writable directory")
    return DataError(f"cannot write the data directory ({e.filename or where}: {e.strerror})")


def install(manifest: Manifest, root: Path, put_file) -> Path:
    """Install `manifest`'s files into root/NAME: `put_file(entry, dest)`
    writes one file (a copy, a link, a download). Each is checked against its
    sha256 before the dataset is renamed into place; on any failure nothing
    of it is left in the data directory, and an earlier install stays."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".staging-{manifest.name}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    except OSError as e:
        raise disk_error(e, root) from None
    try:
        for f in manifest.files:
            dest = staging / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            put_file(f, dest)
            got = sha256_of(dest)
            if got != f.sha256:
                raise DataError(f"dataset '{manifest.name}': {f.path} has sha256 {got[:12]}..., its manifest "
                                f"{f.sha256[:12]}... (a different or damaged copy); nothing was installed")
        (staging / MANIFEST_FILE).write_text(manifest.to_json())
        final = root / manifest.name
        if final.exists():
            old = root / f".old-{manifest.name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
            staging.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(final)
        return final
    except OSError as e:
        raise disk_error(e, root) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
