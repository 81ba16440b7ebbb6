"""A decision study's files on disk: its rows X.csv (or X.csv.gz, as
experiments/results/decision/full_grid keeps them) with X_summary.json and
X_probes.csv[.gz] beside it; a study's own directory holds decision.csv,
decision_summary.json and decision_probes.csv. Gzip is written with no file
name or time in its header, so the same rows give the same bytes."""
from __future__ import annotations

import csv
import gzip
import io
import shutil
from pathlib import Path


def siblings(rows_path: Path) -> tuple[Path, Path]:
    """(summary, probes) beside a study's rows: X.csv[.gz] -> X_summary.json, X_probes.csv[.gz]."""
    gz = rows_path.name.endswith(".csv.gz")
    stem = rows_path.name[:-len(".csv.gz")] if gz else rows_path.stem
    return (rows_path.with_name(f"{stem}_summary.json"),
            rows_path.with_name(f"{stem}_probes.csv" + (".gz" if gz else "")))


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    """(columns, rows) of a CSV, gzipped or not."""
    with (gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="")) as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as raw:
        if path.suffix != ".gz":
            raw.write(data)
            return
        with gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as g:
            g.write(data)


def write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    """Gzipped where the name ends in .gz."""
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=columns)
    w.writeheader()
    w.writerows(rows)
    _write(path, text.getvalue().encode())


def gzip_copy(src: Path, dst: Path) -> None:
    """src to the gzipped dst (copied as it is when already gzipped)."""
    if src.suffix == ".gz":
        shutil.copyfile(src, dst)
    else:
        _write(dst, src.read_bytes())
