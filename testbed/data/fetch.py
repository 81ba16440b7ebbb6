"""`testbed data fetch NAME`: a dataset from its public home (a source
repository's raw files at a pinned commit, or its published URL), each file
checked against the manifest's sha256 before the dataset is installed
(store.install: whole or not at all). A file with no download of exactly its
bytes (one gzipped or assembled locally) is refused up front, pointing to
`import`; so is every network failure, in one line."""
from __future__ import annotations

import http.client
import os
import urllib.error
import urllib.request
from pathlib import Path

from testbed.data.manifest import DataFile, Manifest, known_manifest, known_names
from testbed.data.store import DataError, data_root, install

TIMEOUT_S = 60.0
CHUNK = 1 << 16


def _import_hint(name: str) -> str:
    return f"bring it from a local copy with `testbed data import {name} DIR`"


def _download(manifest: Manifest, entry: DataFile, dest: Path, timeout_s: float) -> None:
    name, url = manifest.name, entry.url
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, dest.open("wb") as out:
            expected = response.headers.get("Content-Length")
            got = 0
            while chunk := response.read(CHUNK):
                out.write(chunk)
                got += len(chunk)
    except urllib.error.HTTPError as e:
        raise DataError(f"fetch {name}: {url} answered HTTP {e.code} {e.reason} (the file is not at its source); "
                        f"{_import_hint(name)}") from None
    except urllib.error.URLError as e:
        reason = getattr(e.reason, "strerror", None) or e.reason
        raise DataError(f"fetch {name}: cannot reach {url} ({reason}); without network, {_import_hint(name)}") from None
    except (TimeoutError, ConnectionError, http.client.HTTPException) as e:
        raise DataError(f"fetch {name}: the download of {url} failed ({type(e).__name__}: {e}); run fetch again, "
                        f"or {_import_hint(name)}; nothing was installed") from None
    if expected is not None and got != int(expected):
        raise DataError(f"fetch {name}: the download of {url} ended after {got} of {expected} bytes (truncated); "
                        f"run fetch again, or {_import_hint(name)}; nothing was installed")


def fetch_manifest(manifest: Manifest, data_dir: str | os.PathLike | None = None,
                   timeout_s: float = TIMEOUT_S) -> Path:
    """Download and install every file of `manifest`."""
    local = [f for f in manifest.files if not f.url]
    if local:
        raise DataError(f"fetch {manifest.name}: {local[0].path} has no download of its own "
                        f"({local[0].obtained or 'no source given'}); {_import_hint(manifest.name)}")
    return install(manifest, data_root(data_dir), lambda entry, dest: _download(manifest, entry, dest, timeout_s))


def fetch_dataset(name: str, data_dir: str | os.PathLike | None = None, timeout_s: float = TIMEOUT_S) -> Path:
    manifest = known_manifest(name)
    if manifest is None:
        raise DataError(f"fetch {name}: not a known dataset; choose one of: {', '.join(known_names())}")
    return fetch_manifest(manifest, data_dir, timeout_s)
