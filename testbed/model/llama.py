"""A Llama-family decoder (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP) that runs one flat batch of tokens against a paged KV cache.

All tokens of a step (decodes and prefill chunks of different requests) go
through the linear layers together as one [num_tokens, hidden] matrix (Orca's
selective batching); only attention looks at request boundaries, through
`AttentionMetadata` and the chosen `AttentionBackend`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from testbed.kernels.attention import AttentionBackend, AttentionMetadata, DecodeMetadata
from testbed.kernels.kv_ops import write_kv
from testbed.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 like the HF implementation, whatever the model dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self._inv_freq: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        # kept in fp32 and out of the module's buffers: .to(bfloat16) must not round it
        if self._inv_freq is None or self._inv_freq.device != device:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
            self._inv_freq = 1.0 / (self.theta ** exponents)
        return self._inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq(positions.device).unsqueeze(0)  # [num_tokens, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                                # [num_tokens, head_dim]
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; the rotate-half convention of HF Llama."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.resolved_head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v as one GEMM; the loader splices HF's q_proj/k_proj/v_proj in
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x, cos, sin, kv_layer: torch.Tensor, meta: AttentionMetadata | DecodeMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_layer[0], kv_layer[1]                     # [num_blocks, block_size, Hkv, D]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attend = backend.forward_decode if isinstance(meta, DecodeMetadata) else backend.forward
        out = attend(q, k_cache, v_cache, meta, self.scale)             # [num_tokens, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_layer, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.attention != "gqa" or cfg.num_experts or not cfg.gated_mlp or cfg.norm != "rms_norm" \
                or cfg.parallel_block or cfg.resolved_weight_dtype != cfg.dtype:
            raise ValueError(f"model '{cfg.name}': the real engine runs dense Llama-style GQA/MHA models with "
                             f"weights in model.dtype; attention={cfg.attention}, num_experts={cfg.num_experts}, "
                             f"gated_mlp={cfg.gated_mlp}, norm={cfg.norm}, parallel_block={cfg.parallel_block}, "
                             f"weight_dtype={cfg.weight_dtype} only run with runtime=sim")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.resolved_head_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata | DecodeMetadata, backend: AttentionBackend,
                on_layer_done=None) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_cache: [num_layers, 2, num_blocks,
        block_size, Hkv, D]. Returns the final-normed hidden states [num_tokens, hidden].
        `on_layer_done(layer_index)` runs after each layer wrote its KV (layer-wise
        KV streaming hooks in there)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i], meta, backend)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def init_random_weights(model: LlamaModel, seed: int) -> None:
    """Seeded weights scaled so that activations keep unit size through the
    layers and the logits are peaked: greedy decoding then has clear top-2
    margins, so exact-token comparisons do not hinge on fp32 rounding."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape):   # drawn in fp32, so a CPU model's weights do not depend on its dtype
        return torch.randn(shape, generator=gen, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.copy_(randn(p.shape) * 0.1)
            elif name == "embed_tokens.weight":
                p.copy_(randn(p.shape))
            elif name == "lm_head.weight":
                p.copy_(randn(p.shape) * (4.0 / math.sqrt(p.shape[1])))
            else:
                p.copy_(randn(p.shape) / math.sqrt(p.shape[1]))
