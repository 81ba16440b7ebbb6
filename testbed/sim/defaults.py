"""The run knobs whose defaults follow the hardware: the scheduler's
token_budget (hardware.token_budget_default: 256 on this CPU, 2,048 on the
GPU presets, vLLM V1's online-serving value) and num_kv_blocks=auto
(hardware.kv_blocks_default blocks, or where that is 0 the KV memory one GPU
has after the weights and activations at gpu_memory_utilization, vLLM's knob).
An explicit value always wins. RunConfig resolves both once, here, and keeps
a line saying which was used for the run's header."""
from __future__ import annotations

from typing import TYPE_CHECKING

from testbed.sim.layer_shapes import layer_shapes

if TYPE_CHECKING:
    from testbed.config import RunConfig

AUTO = "auto"
_LOGIT_BYTES = 4                   # fp32 logits of the sampled rows


def activation_bytes(cfg: "RunConfig") -> int:
    """Peak activation memory of one forward, per GPU, estimated: the widest
    GEMM output plus four hidden-state buffers (input, residual, attention
    output, norm) for the most tokens an iteration schedules, and fp32 logits
    for max_num_seqs sampled rows."""
    shapes = layer_shapes(cfg.model, cfg.parallel.tp)
    tokens = max(cfg.token_budget or 0, cfg.max_num_batched_tokens)
    widest = max([g.n for g in shapes.gemms] + [cfg.model.hidden_size])
    per_token = (widest + 4 * cfg.model.hidden_size) * shapes.dtype_bytes
    return tokens * per_token + cfg.max_num_seqs * shapes.lm_head.n * _LOGIT_BYTES


def kv_blocks_from_memory(cfg: "RunConfig") -> int:
    shapes = layer_shapes(cfg.model, cfg.parallel.tp)
    usable = cfg.hardware.memory_gib * 2**30 * cfg.gpu_memory_utilization
    free = usable - shapes.weight_bytes - activation_bytes(cfg)
    if free <= 0:
        raise ValueError(f"num_kv_blocks=auto: {cfg.model.name} at tp={cfg.parallel.tp} leaves no KV memory on "
                         f"{cfg.hardware.name} ({shapes.weight_bytes / 2**30:.1f} GiB of weights, "
                         f"{cfg.gpu_memory_utilization:.0%} of {cfg.hardware.memory_gib} GiB usable); "
                         "raise parallel.tp or give num_kv_blocks")
    return int(free // (shapes.kv_bytes_per_token * cfg.block_size))


def resolve_hardware_defaults(cfg: "RunConfig") -> str:
    """Sets cfg.token_budget and cfg.num_kv_blocks where they were left to the
    hardware; returns what was chosen ('' if both were given)."""
    notes = []
    if cfg.token_budget is None:
        cfg.token_budget = cfg.hardware.token_budget_default
        notes.append(f"token_budget={cfg.token_budget} ({cfg.hardware.name}'s default)")
    if cfg.num_kv_blocks == AUTO:
        if cfg.hardware.kv_blocks_default:
            cfg.num_kv_blocks = cfg.hardware.kv_blocks_default
            notes.append(f"num_kv_blocks=auto -> {cfg.num_kv_blocks} ({cfg.hardware.name}'s default)")
        else:
            cfg.num_kv_blocks = kv_blocks_from_memory(cfg)
            notes.append(f"num_kv_blocks=auto -> {cfg.num_kv_blocks} (the KV memory left after weights and "
                         f"activations at gpu_memory_utilization={cfg.gpu_memory_utilization})")
    elif isinstance(cfg.num_kv_blocks, str) or isinstance(cfg.num_kv_blocks, bool):
        raise ValueError(f"num_kv_blocks: expected a number of blocks or 'auto', got '{cfg.num_kv_blocks}'")
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: a fraction in (0, 1], got {cfg.gpu_memory_utilization}")
    return "; ".join(notes)
