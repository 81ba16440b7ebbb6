"""The GPU presets' engine terms as they were stated before engine presets
(0.3 ms of host time added per iteration, 5 µs per eager launch, CUDA graphs
for decode iterations of up to 512 tokens without padding, the hardware's
all-reduce table and attention kernel): tests that pin down the hardware's
pricing use it, so that they do not move with the default engine."""
from testbed.sim.engine_config import EngineConfig

STATED_ENGINE = EngineConfig(name="stated", overhead_ms=0.3, kernel_launch_us=5.0, cuda_graphs=True,
                             cuda_graph_sizes=list(range(1, 513)))
