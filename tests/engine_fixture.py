"""The GPU presets' engine terms as they were stated before engine presets
(conf/engine/stated.yaml): tests that pin down the hardware's pricing use it,
so that they do not move with the default engine."""
from testbed.sim.engine_config import load_engine_preset

STATED_ENGINE = load_engine_preset("stated")
