import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))     # the tests' own helpers (import_graph)

# CI lays ../shared beside the clone; where a known dataset's copy lies in it
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SHARED_COPIES = {"azure-code-2023": ".", "vidur-profiles": "vidur-profiles", "blis-h100": "blis-h100"}


@pytest.fixture(scope="session", autouse=True)
def data_dir(tmp_path_factory) -> Path:
    """Every known dataset imported from ../shared/data into a data directory of
    this session, named by $TESTBED_DATA for every test and the processes they
    start. Without ../shared/data the directory stays empty and a test that
    needs a dataset fails with the one-line `testbed data import` hint."""
    from testbed.data.importer import import_dataset
    from testbed.data.manifest import known_names
    root = tmp_path_factory.mktemp("testbed-data")
    for name in known_names():
        src = SHARED_DATA / SHARED_COPIES.get(name, name)
        if src.is_dir():
            import_dataset(name, src, data_dir=root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESTBED_DATA", str(root))
        yield root
