"""How long bytes take on a link, for `runtime=sim`: the simulated transport
ships a prefill worker's KV to a decode worker through a LinkModel, the cost
model prices tensor-parallel all-reduces and pipeline hand-offs with one, and
the crossover study (crossover.py) prices the transfer tax with one.

A transfer of n bytes in k messages costs latency + k * per_message + n / bw.
The link carries one transfer at a time: `reserve` queues transfers behind each
other (first come, first served), which is how a busy NIC shared by many
requests delays each of them."""
from __future__ import annotations

from testbed.sim.config import LinkConfig


class LinkModel:
    def __init__(self, link: LinkConfig):
        link.validate()
        self.link = link
        self._s_per_byte = 1.0 / link.bytes_per_s
        self._latency_s = link.latency_us * 1e-6
        self._per_message_s = link.per_message_us * 1e-6
        self.busy_until_s = 0.0

    def occupancy_s(self, nbytes: float, num_messages: int = 1) -> float:
        """How long the transfer holds the link (everything but the latency,
        which overlaps with the next transfer's sending)."""
        return num_messages * self._per_message_s + nbytes * self._s_per_byte

    def transfer_time_s(self, nbytes: float, num_messages: int = 1) -> float:
        """Start of sending to the last byte's arrival, on an idle link."""
        if nbytes < 0 or num_messages < 1:
            raise ValueError(f"transfer: need nbytes >= 0 and num_messages >= 1, got {nbytes}, {num_messages}")
        return self._latency_s + self.occupancy_s(nbytes, num_messages)

    def reserve(self, start_s: float, nbytes: float, num_messages: int = 1) -> tuple[float, float]:
        """Queue a transfer that is ready at `start_s` behind those already
        reserved; returns (when it starts sending, when it has arrived)."""
        start = max(start_s, self.busy_until_s)
        occupancy = self.occupancy_s(nbytes, num_messages)
        self.busy_until_s = start + occupancy
        return start, self.busy_until_s + self._latency_s

    def reset(self) -> None:
        self.busy_until_s = 0.0

    def layerwise_exposed_s(self, per_layer_compute_s: float, per_layer_bytes: float,
                            num_layers: int, messages_per_layer: int = 1) -> float:
        """Transfer time left after the prefill's last layer when each layer's
        KV is sent as soon as that layer is computed (layer-wise streaming).

        Layer i is ready at (i+1)·c; sends queue on the link, each holding it
        for o. The last one arrives at latency + max over i of ((i+1)·c +
        (n-i)·o), so the exposed part is latency + max(o, n·o - (n-1)·c): one
        layer's send when the link keeps up (o <= c), otherwise the whole
        backlog the link could not hide."""
        if num_layers < 1:
            raise ValueError(f"num_layers: must be >= 1, got {num_layers}")
        o = self.occupancy_s(per_layer_bytes, messages_per_layer)
        return self._latency_s + max(o, num_layers * o - (num_layers - 1) * per_layer_compute_s)

    def allreduce_time_s(self, nbytes: float, num_ranks: int) -> float:
        """Ring all-reduce of `nbytes` per rank: one launch (a message), then
        2(r-1) steps that each pay the link latency and move nbytes / r; 0 for
        a single rank."""
        if num_ranks <= 1:
            return 0.0
        steps = 2 * (num_ranks - 1)
        return self._per_message_s + steps * (self._latency_s + nbytes / num_ranks * self._s_per_byte)
