"""The engine's time outside the GPU's kernels on a GPU preset, as stated
terms (no fit to serving numbers; each preset says where its values come
from):

- per iteration, the host's scheduling, input preparation and sampling
  (hardware.overhead_ms), which the GPU waits for;
- in eager mode, one host launch per kernel (hardware.kernel_launch_us): the
  host issues a layer's kernels while the GPU runs earlier ones, so an
  iteration takes at least num_layers · kernels_per_layer launches, and
  small decode batches on a fast GPU are launch-bound;
- with CUDA graphs (hardware.cuda_graphs), decode iterations of up to
  cuda_graph_max_tokens tokens replay one captured graph: no per-kernel
  launches (vLLM captures decode batch sizes up to 512 by default); prefills
  and larger batches run eagerly."""
from __future__ import annotations

from dataclasses import dataclass

from testbed.sim.config import HardwareConfig, ParallelConfig
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
    per_iteration_s: float
    launches_s: float             # one eager iteration's kernel launches
    cuda_graphs: bool
    cuda_graph_max_tokens: int

    @classmethod
    def of(cls, hardware: HardwareConfig, shapes: LayerShapes, parallel: ParallelConfig) -> "EngineOverhead":
        launches = shapes.num_layers * kernels_per_layer(shapes, parallel) * hardware.kernel_launch_us * 1e-6
        return cls(hardware.overhead_ms * 1e-3, launches, hardware.cuda_graphs, hardware.cuda_graph_max_tokens)

    def launch_bound(self, num_tokens: float, decode_only: bool) -> float:
        """The least time the iteration's kernels can take, set by the host's launches."""
        if self.cuda_graphs and decode_only and num_tokens <= self.cuda_graph_max_tokens:
            return 0.0
        return self.launches_s
