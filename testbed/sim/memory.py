"""The KV footprint of a run: bytes one token's KV takes, how many tokens a
worker's `num_kv_blocks` hold, and how many the accelerator could hold after
the model's weights (CostModel.kv_capacity_tokens). The simulator prints it at
start-up; a configuration whose KV memory exceeds the accelerator's is
flagged there (it still runs: num_kv_blocks is the modeled memory)."""
from __future__ import annotations

from dataclasses import dataclass

from testbed.sim.cost_model import CostModel
from testbed.sim.defaults import gpu_memory


@dataclass
class KVFootprint:
    model: str
    hardware: str
    tp: int
    pp: int
    kv_bytes_per_token: float         # one token, its layers on the fullest GPU of the replica
    block_size: int
    num_kv_blocks: int
    capacity_tokens: int              # num_kv_blocks * block_size, per worker
    weight_gib: float                 # per GPU
    gpu_capacity_tokens: int | None   # what the accelerator holds after weights; None: weights do not fit
    note: str | None = None
    defaults: str = ""                # which knobs followed the hardware (sim/defaults.py)

    @property
    def kv_gib(self) -> float:
        return self.capacity_tokens * self.kv_bytes_per_token / 2**30


def kv_footprint(cost: CostModel, num_kv_blocks: int, block_size: int, defaults: str = "") -> KVFootprint:
    """`defaults`: the run's line on which knobs followed the hardware."""
    try:
        gpu_tokens, note = cost.kv_capacity_tokens(), None
    except ValueError as e:
        gpu_tokens, note = None, str(e)
    capacity = num_kv_blocks * block_size
    if gpu_tokens is not None and capacity > gpu_tokens:
        note = (f"num_kv_blocks={num_kv_blocks} holds {capacity} tokens, more than {cost.hardware.name} "
                f"can ({gpu_tokens} after weights); the simulation assumes memory the GPU does not have")
    weights, kv_per_token = gpu_memory(cost.model, cost.shapes, cost.parallel.pp)
    return KVFootprint(cost.model.name, cost.hardware.name, cost.parallel.tp, cost.parallel.pp, kv_per_token,
                       block_size, num_kv_blocks, capacity, weights / 2**30, gpu_tokens, note, defaults)


def format_footprint(f: KVFootprint) -> str:
    gpu = "n/a" if f.gpu_capacity_tokens is None else f"{f.gpu_capacity_tokens:,}"
    split = f"tp={f.tp}" + (f" pp={f.pp}" if f.pp > 1 else "")
    line = (f"KV footprint: {f.kv_bytes_per_token:,.0f} B/token ({f.model}, {split}); num_kv_blocks="
            f"{f.num_kv_blocks} x {f.block_size} = {f.capacity_tokens:,} tokens/worker ({f.kv_gib:.1f} GiB); "
            f"{f.hardware} holds {gpu} tokens after {f.weight_gib:.1f} GiB of weights")
    if f.defaults:
        line = f"{line}\n  defaults: {f.defaults}"
    return line if f.note is None else f"{line}\n  warning: {f.note}"
