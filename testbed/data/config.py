"""DataConfig: the `data:` section of the run config, where datasets are
read from (`data.dir=/path`; testbed/data/store.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from testbed.data.store import ENV


@dataclass
class DataConfig:
    # the data directory; "": $TESTBED_DATA, else ~/.cache/pd-testbed. Given, it wins over $TESTBED_DATA
    dir: str = ""

    def validate(self) -> None:
        path = os.path.expanduser(self.dir)
        if self.dir and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"data.dir: '{self.dir}' is a file, not a directory; name the data directory "
                             f"(`testbed data list --dir DIR` shows what one holds) or leave it unset for ${ENV}")


def use_data_dir(data_dir: str) -> None:
    """Make `data_dir` (a composed config's data.dir) the data directory of
    this process and the processes it starts, before any config object is built."""
    # The hardware and workload presets check their datasets while the config
    # objects are built, before the run config that holds data.dir exists, and
    # worker processes rebuild them from a plain dict: $TESTBED_DATA, set here
    # once and inherited, reaches every one of them without a global of ours.
    if data_dir:
        os.environ[ENV] = os.path.expanduser(data_dir)
