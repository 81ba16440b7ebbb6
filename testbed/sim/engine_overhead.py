"""The serving engine's part of an iteration's time (engine_config.py), as
the cost model applies it:

- host time (host_time.py) by the batch's sequences and tokens and TP: added
  to the GPU's time, or with engine.host_overlap run beside it, so that the
  iteration takes max(GPU, host);
- in eager mode, one host launch per kernel (engine.kernel_launch_us): the
  host issues a layer's kernels while the GPU runs earlier ones, so an
  iteration takes at least num_layers · kernels_per_layer launches, and
  small decode batches on a fast GPU are launch-bound;
- with CUDA graphs (engine.cuda_graphs), an iteration of up to
  max(cuda_graph_sizes) tokens (decode-only unless cuda_graph_mixed) replays
  a captured graph: no per-kernel launches, and its token-count terms are
  those of the next captured size (the batch is padded to it);
- a custom all-reduce inside the graph (tp_collective=custom_allreduce)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from testbed.sim.config import ParallelConfig
from testbed.sim.engine_config import EngineConfig
from testbed.sim.host_time import HostSeconds, host_seconds
from testbed.sim.layer_shapes import LayerShapes

# vLLM's default CUDA-graph capture sizes: decode batches of up to 512 sequences
# (the real engine's default cuda_graph_sizes, testbed/model/cuda_graphs.py)
VLLM_CUDA_GRAPH_SIZES = [1, 2, 4] + list(range(8, 513, 8))

# per layer besides its GEMMs: two norms, rope, attention, the activation, the residual add
_OTHER_KERNELS_PER_LAYER = 6


def kernels_per_layer(shapes: LayerShapes, parallel: ParallelConfig) -> int:
    gemms = sum(g.layers for g in shapes.gemms) / shapes.num_layers
    experts = 2 if shapes.experts else 0               # one grouped GEMM each for up and down
    allreduce = 2 if parallel.tp > 1 else 0
    return int(round(gemms)) + experts + allreduce + _OTHER_KERNELS_PER_LAYER


@dataclass(frozen=True)
class EngineOverhead:
    host_s: HostSeconds
    host_overlap: bool
    launches_s: float             # one eager iteration's kernel launches
    graph_sizes: tuple[int, ...]  # () without CUDA graphs
    graph_mixed: bool

    @classmethod
    def of(cls, engine: EngineConfig, shapes: LayerShapes, parallel: ParallelConfig) -> "EngineOverhead":
        launches = shapes.num_layers * kernels_per_layer(shapes, parallel) * engine.kernel_launch_us * 1e-6
        sizes = tuple(engine.cuda_graph_sizes) if engine.cuda_graphs else ()
        return cls(host_seconds(engine, parallel.tp), engine.host_overlap, launches, sizes, engine.cuda_graph_mixed)

    def graph_size(self, num_tokens: float, decode_only: bool) -> int | None:
        """The captured size this iteration replays (its tokens padded up), or None: eager."""
        if not self.graph_sizes or num_tokens > self.graph_sizes[-1] or not (decode_only or self.graph_mixed):
            return None
        return self.graph_sizes[bisect.bisect_left(self.graph_sizes, num_tokens)]

    def launch_bound(self, num_tokens: float, decode_only: bool) -> float:
        """The least time the iteration's kernels can take, set by the host's launches."""
        return 0.0 if self.graph_size(num_tokens, decode_only) is not None else self.launches_s
