"""TESTBED_DATA for tests: a temporary data directory whose datasets link to
../shared/data (the public datasets CI lays beside the clone)."""
from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
LINKS = {"vidur-profiles": "vidur-profiles", "blis-h100": "blis-h100"}


@pytest.fixture
def testbed_data(tmp_path, monkeypatch):
    root = tmp_path / "testbed-data"
    root.mkdir()
    for name, folder in LINKS.items():
        (root / name).symlink_to(SHARED / folder)
    monkeypatch.setenv("TESTBED_DATA", str(root))
    return root
