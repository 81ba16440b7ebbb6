"""One line for a run whose output cannot be written: the run directory's
disk full, a directory that is read-only, missing or under a regular file.
Whatever was written before stays readable (the record readers drop a last
line cut off mid-write, metrics.py), so the line says where it is."""
from __future__ import annotations

import errno
import os
from pathlib import Path

_FULL = {errno.ENOSPC, errno.EDQUOT}
_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}
_NO_DIR = {errno.ENOENT, errno.ENOTDIR}


def named(e: OSError, path: str | os.PathLike) -> OSError:
    """`e` with the file it was writing named (a write's OSError names none)."""
    return e if e.filename else OSError(e.errno, e.strerror, str(path))


def output_fault(e: BaseException, out_dir: str | os.PathLike | None) -> str | None:
    """The line for an OSError writing a run's output; None for any other error."""
    if not isinstance(e, OSError) or e.errno is None:
        return None
    path = e.filename or out_dir or "the run directory"
    kept = ""
    if out_dir and Path(out_dir).is_dir() and any(Path(out_dir).glob("*.jsonl")):
        kept = f"; the records written before it are in {out_dir}"
    if e.errno in _FULL:
        return (f"the disk holding {path} is full ({e.strerror}); free space there or set hydra.run.dir "
                f"(hydra.sweep.dir for -m) to a disk with room{kept}")
    if e.errno in _UNWRITABLE:
        return (f"cannot write {path} ({e.strerror}); set hydra.run.dir (hydra.sweep.dir for -m) to a "
                f"writable directory{kept}")
    if e.errno in _NO_DIR:
        return (f"cannot write {path} ({e.strerror}: a directory on its path is missing or is a file); set "
                f"hydra.run.dir (hydra.sweep.dir for -m) to a directory that can be made{kept}")
    return None
