import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))     # the tests' own helpers (import_graph)


def pytest_sessionstart(session):
    """Without $TESTBED_DATA, the datasets the GPU presets' engines read at
    first use (data_fixture.LINKS) come from ../shared/data through a
    temporary data directory."""
    import os
    import tempfile
    if "TESTBED_DATA" in os.environ:
        return
    from data_fixture import LINKS, SHARED
    root = Path(tempfile.mkdtemp(prefix="testbed-data-"))
    for name, folder in LINKS.items():
        (root / name).symlink_to(SHARED / folder)
    os.environ["TESTBED_DATA"] = str(root)
    session.config.stash_testbed_data = root


def pytest_sessionfinish(session):
    import os
    import shutil
    root = getattr(session.config, "stash_testbed_data", None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
        os.environ.pop("TESTBED_DATA", None)
