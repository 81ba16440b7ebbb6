"""The simulator's KV transport (`runtime=sim`): a prefill worker's KV
hand-off crosses a modeled link (sim/link_model.py) and lands in the decode
worker's inbox as a heap event of the simulated runtime (runtime/sim.py)."""
from __future__ import annotations

from testbed.runtime.kv_port import KVArrival, KVPort
from testbed.runtime.sim_loop import EventLoop
from testbed.sim.link_model import LinkModel


class SimKVPort(KVPort):
    """KV over a modeled link. A prefill worker's egress is one LinkModel, so
    concurrent hand-offs queue behind each other. With tensor or pipeline
    parallelism the KV is sharded over GPUs that each send over their own NIC
    (one per GPU, as in a DGX) at the same time: `shards` links carry it in
    parallel, each 1/shards of the bytes (sim/kv_sharding.py says how many
    when the pools differ); the bytes reported are the whole request's. With
    layer-wise streaming all but the last layer were sent while the final
    chunk computed: only what the link could not hide arrives after the
    first token."""

    def __init__(self, runtime: EventLoop, worker_id: str, link: LinkModel, kv_bytes_per_token: int,
                 num_layers: int, shards: int = 1):
        self.runtime, self.worker_id, self.link = runtime, worker_id, link
        self.kv_bytes_per_token, self.num_layers, self.shards = kv_bytes_per_token, num_layers, shards
        self.inbox: list[KVArrival] = []

    def send(self, request_id, peer, src_block_ids, dst_block_ids, num_tokens, layers, last, meta) -> int:
        now = self.runtime.clock.now()
        per_layer = num_tokens * self.kv_bytes_per_token // self.num_layers
        num_bytes = per_layer * (layers[1] - layers[0])
        per_nic = per_layer / self.shards
        if layers[0] > 0:
            # layer-wise: layers 0..L-2 left during the final iteration, layer i at (i+1)/L of it
            iter_s = meta.get("last_iteration_s", 0.0)
            start = now - iter_s
            for i in range(self.num_layers - 1):
                self.link.reserve(start + (i + 1) * iter_s / self.num_layers, per_nic)
            _, arrive = self.link.reserve(now, per_nic * (layers[1] - layers[0]))
            total = per_layer * self.num_layers
        else:
            _, arrive = self.link.reserve(now, per_nic * (layers[1] - layers[0]))
            total = num_bytes
        if last:
            self.runtime.at(arrive, self.runtime.deliver_kv, (peer, KVArrival(request_id, True, num_bytes=total,
                                                                               meta=meta)))
        return total

    def poll(self) -> list[KVArrival]:
        out, self.inbox = self.inbox, []
        return out
