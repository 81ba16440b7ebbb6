import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))     # the tests' own helpers (import_graph)

# CI lays ../shared beside the clone; where a known dataset's copy lies in it
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SHARED_COPIES = {"azure-code-2023": ".", "vidur-profiles": "vidur-profiles", "blis-h100": "blis-h100"}


def pytest_sessionstart(session):
    """Every known dataset imported from ../shared/data into a data directory of
    this session, named by $TESTBED_DATA from before collection (a test module
    may read a dataset to build its parameters) for every test and the
    processes they start. Without ../shared/data the directory stays empty and
    a test that needs a dataset fails with the one-line `testbed data import` hint."""
    from testbed.data.importer import import_dataset
    from testbed.data.manifest import known_names
    holder = tempfile.TemporaryDirectory(prefix="testbed-data-")
    root = Path(holder.name)
    for name in known_names():
        src = SHARED_DATA / SHARED_COPIES.get(name, name)
        if src.is_dir():
            import_dataset(name, src, data_dir=root)
    session.config._testbed_data = (holder, os.environ.get("TESTBED_DATA"))
    os.environ["TESTBED_DATA"] = str(root)


def pytest_sessionfinish(session):
    holder, before = session.config._testbed_data
    if before is None:
        os.environ.pop("TESTBED_DATA", None)
    else:
        os.environ["TESTBED_DATA"] = before
    holder.cleanup()


@pytest.fixture(scope="session", autouse=True)
def data_dir(request) -> Path:
    """The session's data directory (every known dataset imported, $TESTBED_DATA)."""
    return Path(request.config._testbed_data[0].name)
