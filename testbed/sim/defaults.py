"""The KV memory a GPU has for `num_kv_blocks=auto`: what one GPU holds after
the weights and the activations at gpu_memory_utilization (vLLM's knob).
RunConfig resolves it once (testbed/config.py, with the hardware's default
token budget) and keeps a line saying which was used for the run's header."""
from __future__ import annotations

from testbed.model.config import ModelConfig
from testbed.sim.config import HardwareConfig, ParallelConfig
from testbed.sim.layer_shapes import layer_shapes

_LOGIT_BYTES = 4                   # fp32 logits of the sampled rows


def activation_bytes(model: ModelConfig, parallel: ParallelConfig, max_tokens: int, max_num_seqs: int) -> int:
    """Peak activation memory of one forward, per GPU, estimated: the widest
    GEMM output plus four hidden-state buffers (input, residual, attention
    output, norm) for the most tokens an iteration schedules, and fp32 logits
    for max_num_seqs sampled rows."""
    shapes = layer_shapes(model, parallel.tp)
    widest = max([g.n for g in shapes.gemms] + [model.hidden_size])
    per_token = (widest + 4 * model.hidden_size) * shapes.dtype_bytes
    return max_tokens * per_token + max_num_seqs * shapes.lm_head.n * _LOGIT_BYTES


def kv_blocks_from_memory(model: ModelConfig, hardware: HardwareConfig, parallel: ParallelConfig,
                          block_size: int, gpu_memory_utilization: float, max_tokens: int,
                          max_num_seqs: int) -> int:
    """KV blocks of `block_size` tokens that fit beside the weights and the
    activations of iterations of up to `max_tokens` tokens."""
    shapes = layer_shapes(model, parallel.tp)
    usable = hardware.memory_gib * 2**30 * gpu_memory_utilization
    free = usable - shapes.weight_bytes - activation_bytes(model, parallel, max_tokens, max_num_seqs)
    if free <= 0:
        raise ValueError(f"num_kv_blocks=auto: {model.name} at tp={parallel.tp} leaves no KV memory on "
                         f"{hardware.name} ({shapes.weight_bytes / 2**30:.1f} GiB of weights, "
                         f"{gpu_memory_utilization:.0%} of {hardware.memory_gib} GiB usable); "
                         "raise parallel.tp or give num_kv_blocks")
    return int(free // (shapes.kv_bytes_per_token * block_size))
