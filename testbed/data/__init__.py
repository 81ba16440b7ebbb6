"""Public datasets by name. None is part of the repository: a user fetches
one (`testbed data fetch NAME`) or imports a local copy (`testbed data import
NAME DIR`) into the data directory (the run config's data.dir, else
$TESTBED_DATA, default ~/.cache/pd-testbed), and a consumer asks for it by
name with `dataset_dir`, which names the preset that needs it and the
commands that bring it when it is missing."""
from testbed.data.store import DataError, MissingDataset, data_root, dataset_dir

__all__ = ["DataError", "MissingDataset", "data_root", "dataset_dir"]
