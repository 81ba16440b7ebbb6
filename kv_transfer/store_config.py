"""KVStoreConfig: the `kvstore:` section of the run config, read by
`mode=kvstore` (modes/kvstore.py), the store process (store_service.py), the
prefill workers' store clients and the simulator's modeled store node.
Plain types only, so Hydra can set every field."""
from __future__ import annotations

from dataclasses import dataclass

from testbed.kv_transfer.config import timeout_problem

GiB = 1 << 30


@dataclass
class KVStoreConfig:
    capacity_bytes: int | None = 64 * GiB   # DRAM tier; null: unbounded
    # a second tier for what DRAM evicts: a directory of block files (runtime=real), modeled on
    # runtime=sim at disk_gb_per_s; off while disk_capacity_bytes is 0
    disk_capacity_bytes: int = 0
    disk_path: str | None = None
    disk_gb_per_s: float = 5.0              # an NVMe drive's read rate (sim)
    # the prefill pool's router under mode=kvstore (disagg's is `prefill_router`)
    prefill_router: str = "cache_aware"
    # Mooncake's early rejection: refuse a request at arrival when its predicted TTFT would
    # break slo.ttft_ms, or no decode worker has room for it
    early_rejection: bool = False
    timeout_s: float = 2.0          # one store round trip; past it the store counts as down
    retry_s: float = 1.0            # how long a worker leaves a store that timed out alone
    # fault injection for tests: corrupt the n-th block the store serves (1-based); 0 never
    fault_corrupt_nth_get: int = 0

    def validate(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"kvstore.{field}: {why}")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise bad("capacity_bytes", f"must be >= 0 or null (unbounded), got {self.capacity_bytes}")
        if self.disk_capacity_bytes < 0:
            raise bad("disk_capacity_bytes", f"must be >= 0 (0: no disk tier), got {self.disk_capacity_bytes}")
        if self.disk_capacity_bytes and self.disk_path is None:
            raise bad("disk_path", "the disk tier (disk_capacity_bytes > 0) needs a directory for its files")
        if not self.disk_gb_per_s > 0:
            raise bad("disk_gb_per_s", f"must be > 0, got {self.disk_gb_per_s}")
        if problem := timeout_problem(self.timeout_s):
            raise bad("timeout_s", problem)
        if not self.retry_s >= 0:
            raise bad("retry_s", f"must be >= 0, got {self.retry_s}")
        if self.fault_corrupt_nth_get < 0:
            raise bad("fault_corrupt_nth_get", f"must be >= 0 (0 disables), got {self.fault_corrupt_nth_get}")
