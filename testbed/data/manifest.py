"""A dataset is a manifest: its name, its files with their sha256, where each
file comes from (a URL at a pinned commit, or in words how it was made), its
licence and citation. The known datasets' manifests ship in manifests/; a
user's own data registered with `testbed data import NAME DIR --as-profile`
(or `--as-trace`) gets a manifest written beside its files in the data
directory (store.py)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFESTS_DIR = Path(__file__).resolve().parent / "manifests"
KINDS = ("trace", "profile")


@dataclass(frozen=True)
class DataFile:
    path: str                  # relative to the dataset's directory, '/'-separated
    sha256: str
    size: int
    url: str | None = None     # a download of exactly these bytes; None: `obtained` says how it was made
    obtained: str | None = None

    def __post_init__(self):
        parts = Path(self.path).parts
        if not parts or Path(self.path).is_absolute() or ".." in parts or self.path.startswith("."):
            raise ValueError(f"dataset file '{self.path}': a manifest path is relative, below the dataset's "
                             "directory and not hidden")


@dataclass(frozen=True)
class Manifest:
    name: str
    title: str
    kind: str                  # trace or profile
    source: str
    licence: str
    citation: str
    files: tuple[DataFile, ...]
    description: str = ""
    registered: bool = field(default=False, compare=False)   # a user's own, not shipped with the package

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def checksum(self) -> str:
        """One sha256 over every file's path and sha256: what derived forms are keyed by."""
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.sha256}\n".encode())
        return h.hexdigest()

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("registered")
        d["files"] = [{k: v for k, v in f.items() if v is not None} for f in d["files"]]
        return json.dumps(d, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, registered: bool = False) -> Manifest:
        d = json.loads(text)
        files = tuple(DataFile(**f) for f in d.pop("files"))
        return cls(files=files, registered=registered, **d)


def known_names() -> list[str]:
    return sorted(p.stem for p in MANIFESTS_DIR.glob("*.json"))


def known_manifest(name: str) -> Manifest | None:
    path = MANIFESTS_DIR / f"{name}.json"
    return Manifest.from_json(path.read_text()) if path.is_file() else None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_of_dir(name: str, kind: str, src: Path) -> Manifest:
    """A user's own profile or trace: every file under `src`, as it is now."""
    files = tuple(DataFile(p.relative_to(src).as_posix(), sha256_of(p), p.stat().st_size,
                           obtained=f"imported from {src.resolve()}")
                  for p in sorted(src.rglob("*")) if p.is_file() and not p.name.startswith("."))
    return Manifest(name=name, title=f"{name} (the user's own {kind})", kind=kind,
                    source=f"imported from {src.resolve()}", licence="the user's", citation="the user's",
                    files=files, registered=True)
