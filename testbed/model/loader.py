"""Builds a LlamaModel: seeded random weights (default) or a local Hugging Face
style checkpoint directory (`model.path=DIR`: config.json + *.safetensors with
Llama / Mistral / Qwen2 tensor names). Nothing is ever downloaded."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from testbed.model.config import ModelConfig
from testbed.model.llama import LlamaModel, init_random_weights

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# HF config.json key -> ModelConfig field
_HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim", "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings",
    "max_position_embeddings": "max_position_embeddings",
}


def config_from_checkpoint(cfg: ModelConfig) -> ModelConfig:
    """The architecture in cfg.path/config.json, keeping cfg's dtype and seed."""
    path = Path(cfg.path)
    if not path.is_dir():
        raise ValueError(f"model.path: checkpoint directory '{path}' does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"model.path: '{path}' has no config.json")
    hf = json.loads(cfg_file.read_text())
    values = {field: hf[key] for key, field in _HF_KEYS.items() if hf.get(key) is not None}
    values.setdefault("num_kv_heads", values.get("num_heads", cfg.num_heads))
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"model.path: model_type '{model_type}' in {cfg_file} is not one of llama, mistral, qwen2")
    # transformers >= 5 writes the rotary base inside rope_parameters, older
    # versions as top-level rope_theta (+ rope_scaling); missing it silently
    # means theta=10000 and wrong logits for every position but the first
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_theta") is not None:
        values["rope_theta"] = rope["rope_theta"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"model.path: rope_type '{rope_type}' in {cfg_file} is not supported; "
                         "the model implements plain rotary embeddings (rope_type 'default') only")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model.path: hidden_act '{hf['hidden_act']}' in {cfg_file} is not supported; "
                         "the MLP is SwiGLU (silu)")
    values["attention_bias"] = bool(hf.get("attention_bias", model_type == "qwen2"))
    return dataclasses.replace(cfg, name=hf.get("_name_or_path") or path.name, **values)


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.path: '{path}' has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except SafetensorError as e:      # a truncated download, say: name the file, not safetensors' internals
            raise ValueError(f"model.path: '{f}' is not a readable safetensors file ({e}); "
                             f"copy the checkpoint again") from e
    return tensors


def _hf_state_dict(model: LlamaModel, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Map HF names onto ours, fusing q/k/v and gate/up. Missing or mis-shaped
    tensors are errors that name the tensor."""
    used: set[str] = set()

    def take(name: str, *shape: int) -> torch.Tensor:
        # each checkpoint tensor is checked on its own: once q|k|v are fused, rows
        # moved from k_proj to q_proj would still give the right total shape
        if name not in tensors:
            raise ValueError(f"model.path: checkpoint '{path}' is missing tensor '{name}'")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"model.path: tensor '{name}' in '{path}' has shape {tuple(tensors[name].shape)}, "
                             f"expected {shape} from config.json")
        used.add(name)
        return tensors[name]

    cfg = model.cfg
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_size, kv_size = cfg.num_heads * cfg.resolved_head_dim, cfg.num_kv_heads * cfg.resolved_head_dim
    proj_rows = {"q": q_size, "k": kv_size, "v": kv_size}
    state: dict[str, torch.Tensor] = {"embed_tokens.weight": take("model.embed_tokens.weight", vocab, hidden),
                                      "norm.weight": take("model.norm.weight", hidden)}
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight", vocab, hidden)
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        state[ours + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(attn + f"{p}_proj.weight", proj_rows[p], hidden) for p in "qkv"], dim=0)
        if cfg.attention_bias:
            state[ours + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(attn + f"{p}_proj.bias", proj_rows[p]) for p in "qkv"])
        state[ours + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight", hidden, q_size)
        state[ours + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(hf + "mlp.gate_proj.weight", inter, hidden), take(hf + "mlp.up_proj.weight", inter, hidden)], dim=0)
        state[ours + "mlp.down_proj.weight"] = take(hf + "mlp.down_proj.weight", hidden, inter)
        state[ours + "input_layernorm.weight"] = take(hf + "input_layernorm.weight", hidden)
        state[ours + "post_attention_layernorm.weight"] = take(hf + "post_attention_layernorm.weight", hidden)
    unexpected = [n for n in tensors if n not in used and "rotary_emb" not in n
                  and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if unexpected:
        raise ValueError(f"model.path: checkpoint '{path}' has unexpected tensor(s) {unexpected[:5]}")
    return state


def load_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> tuple[LlamaModel, ModelConfig]:
    """Returns the model (eval mode, cfg.dtype, on device) and the effective
    config (from config.json when cfg.path is set)."""
    dtype = TORCH_DTYPES[cfg.dtype]
    if cfg.path:
        cfg = config_from_checkpoint(cfg)
        model = LlamaModel(cfg)
        path = Path(cfg.path)
        state = _hf_state_dict(model, _checkpoint_tensors(path), path)
        model.load_state_dict(state, strict=False)  # tied lm_head shares embed_tokens
        return model.to(device=device, dtype=dtype).eval(), cfg
    # random weights are drawn where the model lives, in its dtype: an 8B model
    # never takes 32 GB of host fp32 on its way to a GPU (seeded per device type)
    with torch.device(device):
        model = LlamaModel(cfg).to(dtype)
    init_random_weights(model, cfg.seed)
    return model.eval(), cfg
