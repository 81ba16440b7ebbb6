"""The KV store as a modeled node (`runtime=sim`, `mode=kvstore`): the very
StoreIndex the real store process runs (capacity, LRU eviction, pins,
counters), holding sizes instead of bytes, behind a link model. The store's
NIC is two LinkModels, one per direction (full duplex): gets queue on its
egress, puts on its ingress, first come first served, so many prefill workers
reading at once delay each other as they would on one real NIC.

A fetch costs a lookup round trip (two latencies and messages), then the
blocks' bytes over the egress; the blocks stay pinned until they have
arrived, and the worker hears of them then (the runtime wakes it). Blocks
only the disk tier holds are read from it first, at kvstore.disk_gb_per_s."""
from __future__ import annotations

from testbed.kv_transfer.store_index import StoreIndex
from testbed.runtime.sim_loop import EventLoop
from testbed.runtime.store_port import Fetched, StorePort
from testbed.sim.config import LinkConfig
from testbed.sim.link_model import LinkModel


class SimStoreNode:
    def __init__(self, capacity_bytes: int | None, block_bytes: int, link: LinkConfig,
                 disk_capacity_bytes: int = 0, disk_gb_per_s: float = 5.0):
        self.index = StoreIndex(capacity_bytes, disk_capacity_bytes)
        self.block_bytes = block_bytes
        self.disk_s_per_byte = 1.0 / (disk_gb_per_s * 1e9)
        self.egress, self.ingress = LinkModel(link), LinkModel(link)

    def stats(self) -> dict:
        return {**self.index.counters.to_dict(), "num_blocks": len(self.index), "used_bytes": self.index.used_bytes,
                "capacity_bytes": self.index.capacity_bytes}


class SimStorePort(StorePort):
    def __init__(self, node: SimStoreNode, runtime: EventLoop, worker_id: str):
        self.node, self.runtime, self.worker_id = node, runtime, worker_id
        self._pending: set[str] = set()

    def fetch(self, request_id, keys, on_done) -> None:
        node, now = self.node, self.runtime.clock.now()
        lookup_s = 2 * node.egress.transfer_time_s(8 * len(keys))
        found = node.index.lookup(keys)
        if not found:
            on_done(Fetched(request_id, 0, [], lookup_s))
            return
        read = keys[:found]
        disk_s = node.index.num_on_disk(read) * node.block_bytes * node.disk_s_per_byte
        node.index.get(read)                  # counted and refreshed as the real store's get
        node.index.pin(read)
        _, arrive = node.egress.reserve(now + lookup_s + disk_s, found * node.block_bytes)
        self._pending.add(request_id)
        self.runtime.at(arrive, self._arrived, (request_id, read, on_done, arrive - now))

    def _arrived(self, arg) -> None:
        request_id, read, on_done, fetch_s = arg
        self.node.index.unpin(read)
        if request_id not in self._pending:
            return                            # the request ended while its blocks were on the way
        self._pending.discard(request_id)
        on_done(Fetched(request_id, len(read), [None] * len(read), fetch_s))
        self.runtime.wake(self.worker_id)

    def write(self, fetched, block_ids) -> None:
        pass                                  # no KV tensors in the simulator

    def publish(self, keys, block_ids) -> int:
        node = self.node
        kept = node.index.put_many(keys, node.block_bytes)
        if kept:
            node.ingress.reserve(self.runtime.clock.now(), kept * node.block_bytes)
        return kept

    def cancel(self, request_id) -> None:
        self._pending.discard(request_id)
