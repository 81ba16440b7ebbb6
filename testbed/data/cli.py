"""`testbed data list|fetch|import`: the known datasets and the user's own,
whether each is in the data directory, and the two ways to bring one."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from testbed.data.manifest import Manifest, known_manifest, known_names
from testbed.data.store import ENV, MANIFEST_FILE, DataError, altered_file, data_root, installed_manifest

USAGE = """testbed data list                           the known datasets: present or not, where, size, licence, citation
  testbed data fetch NAME                   download one by name into the data directory
  testbed data import NAME DIR [--link]     install one from a local copy (same checksums)
  testbed data import NAME DIR --as-profile|--as-trace   register your own files under a new name
  (--dir D: the data directory; default $TESTBED_DATA, else ~/.cache/pd-testbed)"""


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def list_lines(root: Path) -> list[str]:
    registered = sorted(p.parent.name for p in root.glob(f"*/{MANIFEST_FILE}") if known_manifest(p.parent.name) is None)
    lines = [f"data directory: {root}"]
    for name in known_names() + registered:
        manifest: Manifest = installed_manifest(name, root) or known_manifest(name)
        if installed_manifest(name, root) is None:
            state = f"absent; `testbed data fetch {name}` or `testbed data import {name} DIR`"
        else:
            bad = altered_file(manifest, root / name)
            state = f"ALTERED: {bad}" if bad else f"present, {root / name}"
        mine = ", registered" if manifest.registered else ""
        files = f"{len(manifest.files)} file" + ("s" if len(manifest.files) != 1 else "")
        lines += [f"{name} ({manifest.kind}{mine}, {files}, {_size(manifest.size)}): {state}",
                  f"  {manifest.title}",
                  f"  licence: {manifest.licence}",
                  f"  cite: {manifest.citation}"]
    return lines


def data_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="testbed data", usage=USAGE)
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd in ("list", "fetch", "import"):
        s = sub.add_parser(cmd)
        s.add_argument("--dir", default=None, help=f"the data directory (default ${ENV}, else ~/.cache/pd-testbed)")
        if cmd != "list":
            s.add_argument("name")
        if cmd == "import":
            s.add_argument("src", metavar="DIR")
            s.add_argument("--link", action="store_true", help="link the files instead of copying them")
            kind = s.add_mutually_exclusive_group()
            kind.add_argument("--as-profile", dest="as_kind", action="store_const", const="profile")
            kind.add_argument("--as-trace", dest="as_kind", action="store_const", const="trace")
    args = p.parse_args(argv)
    try:
        if args.cmd == "list":
            print("\n".join(list_lines(data_root(args.dir))))
        elif args.cmd == "fetch":
            from testbed.data.fetch import fetch_dataset
            print(f"{args.name}: installed in {fetch_dataset(args.name, args.dir)}")
        else:
            from testbed.data.importer import import_dataset
            where = import_dataset(args.name, args.src, args.dir, as_kind=args.as_kind, link=args.link)
            print(f"{args.name}: installed in {where}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
