"""The KV memory a GPU has for `num_kv_blocks=auto`: what one GPU holds after
the weights and the activations at gpu_memory_utilization (vLLM's knob).
RunConfig resolves it once (testbed/config.py, with the hardware's default
token budget) and keeps a line saying which was used for the run's header."""
from __future__ import annotations

from testbed.model.config import ModelConfig
from testbed.sim.config import HardwareConfig, ParallelConfig
from testbed.sim.layer_shapes import LayerShapes, layer_shapes

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


def gpu_memory(model: ModelConfig, shapes: LayerShapes, pp: int, field: str = "parallel") -> tuple[float, float]:
    """(weight bytes, KV bytes per token) on the fullest GPU of a replica whose
    layers (`shapes`: tp-sharded, all layers) are split into `pp` pipeline
    stages: a stage holds ceil(num_layers / pp) layers' weights and KV, and an
    end stage lm_head or the embedding (the other end's is no larger)."""
    if pp == 1:
        return shapes.weight_bytes, shapes.kv_bytes_per_token
    if pp > model.num_layers:
        raise ValueError(f"{field}.pp: {pp} stages for {model.name}'s {model.num_layers} layers; "
                         f"at most {model.num_layers}")
    share = -(-model.num_layers // pp) / model.num_layers
    end = shapes.lm_head.n * shapes.lm_head.k * shapes.dtype_bytes
    layers = shapes.weight_bytes - end - (0 if model.tie_word_embeddings else end)
    return layers * share + end, shapes.kv_bytes_per_token * share


def kv_blocks_from_memory(model: ModelConfig, hardware: HardwareConfig, parallel: ParallelConfig,
                          block_size: int, gpu_memory_utilization: float, max_tokens: int,
                          max_num_seqs: int, field: str = "parallel") -> int:
    """KV blocks of `block_size` tokens that fit beside the weights and the
    activations of iterations of up to `max_tokens` tokens, on the fullest GPU
    of a replica split as `parallel`: tp shards every layer, and pp stages each
    hold ceil(num_layers / pp) layers' weights and KV (plus lm_head or the
    embedding at the ends), so a block's KV is spread over the stages. `field`
    names the config section in the error (a pool's own: prefill.parallel)."""
    weights, kv_per_token = gpu_memory(model, layer_shapes(model, parallel.tp), parallel.pp, field)
    usable = hardware.memory_gib * 2**30 * gpu_memory_utilization
    free = usable - weights - activation_bytes(model, parallel, max_tokens, max_num_seqs)
    if free <= 0:
        split = f"tp={parallel.tp}" + (f" pp={parallel.pp}" if parallel.pp > 1 else "")
        raise ValueError(f"num_kv_blocks=auto: {model.name} at {field} {split} leaves no KV memory on "
                         f"{hardware.name} ({weights / 2**30:.1f} GiB of weights per GPU, "
                         f"{gpu_memory_utilization:.0%} of {hardware.memory_gib} GiB usable); "
                         f"raise {field}.tp or {field}.pp, or give num_kv_blocks")
    return int(free // (kv_per_token * block_size))
