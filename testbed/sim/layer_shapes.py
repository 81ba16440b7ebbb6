"""What one GPU of a model replica has to compute and stream, derived once from
a ModelConfig and the tensor-parallel degree: the GEMMs of every layer, the
routed experts, the attention geometry and the elementwise traffic. The cost
model (cost_model.py) prices these shapes; the profiler (profile.py) measures
the same shapes so that measured and modeled costs line up.

Architectures: MHA/GQA, MLA (DeepSeek-V2: latent KV, q_lora_rank unset), MoE
(routed experts, optional shared experts and leading dense layers), gated
(SwiGLU) or plain (GELU) MLPs. Megatron TP splits heads, the MLP's
intermediate dimension (every expert's, too) and the vocabulary; KV heads are
replicated when there are fewer of them than GPUs, and MLA's latent KV is
replicated on every GPU."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from testbed.model.config import ModelConfig


@dataclass(frozen=True)
class Gemm:
    """y[m, n] = x[m, k] @ W[k, n] on one GPU, present in `layers` layers."""
    name: str
    n: int
    k: int
    layers: int = 1


@dataclass(frozen=True)
class ExpertsShape:
    """Routed experts of the MoE layers, per GPU."""
    layers: int
    num_experts: int
    top_k: int
    expert_params: int            # weight elements of one expert on this GPU
    act_elems_per_routed_token: int   # activations its GEMMs read and write per routed token


@dataclass(frozen=True)
class AttentionShape:
    """Attention of one layer on one GPU. A slice of q new tokens whose context
    (prefix plus themselves) is ctx attends causally: q·(ctx-q) + q(q+1)/2
    query-key pairs, and reads the KV of all ctx tokens."""
    num_heads: int                # query heads on this GPU
    qk_dim: int
    v_dim: int
    kv_bytes_per_token: int       # KV of one token in one layer on this GPU
    io_bytes_per_token: int       # q read and output written, per new token
    mla_rank: int = 0             # MLA latent rank; 0 for MHA/GQA
    rope_dim: int = 0

    def flops(self, q: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """Per slice; q and ctx are arrays, or floats for one slice."""
        pairs = q * (ctx - 0.5 * q + 0.5)                  # q·(ctx - q) + q(q+1)/2
        plain = (2 * self.num_heads * (self.qk_dim + self.v_dim)) * pairs
        if not self.mla_rank:
            return plain
        # MLA: decodes attend in latent space with the up-projections absorbed
        # (width 2·rank + rope per pair); prefills decompress the cached prefix
        # to full heads first. Engines pick the cheaper one per slice; so do we.
        absorbed = (2 * self.num_heads * (2 * self.mla_rank + self.rope_dim)) * pairs
        decompress = (2 * self.mla_rank * self.num_heads * (self.qk_dim - self.rope_dim + self.v_dim)) * (ctx - q)
        if isinstance(absorbed, np.ndarray):
            return np.minimum(absorbed, plain + decompress)
        return min(absorbed, plain + decompress)

    def masked_flops(self, q: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """FLOPs of the torch backend's SDPA on CPU for one slice: a chunk on a
        cached prefix (1 < q < ctx) goes through an explicit bottom-right mask,
        which computes the whole q x ctx score rectangle; a decode (q = 1) or a
        whole prompt (q = ctx, is_causal, which skips the masked half) costs
        `flops`, and counts 0 here."""
        chunk = (q > 1) & (q < ctx)
        return (2 * self.num_heads * (self.qk_dim + self.v_dim)) * q * ctx * chunk

    def bytes(self, q: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        return self.kv_bytes_per_token * ctx + self.io_bytes_per_token * q


@dataclass(frozen=True)
class LayerShapes:
    num_layers: int
    dtype_bytes: int                      # activations, KV, embedding and lm_head
    weight_dtype_bytes: int               # the layers' GEMM weights (and, W8A8, their inputs)
    gemms: tuple[Gemm, ...]               # over every token of the batch
    lm_head: Gemm                         # over the sampled rows only
    experts: ExpertsShape | None
    attention: AttentionShape
    elementwise_bytes_per_token: int      # norms, residuals, rope, activations, embedding; all layers
    hidden_bytes_per_token: int           # one token's hidden state: all-reduce and stage hand-off payload
    weight_bytes: int                     # on this GPU
    kv_bytes_per_token: int               # on this GPU, all layers


def _split(n: int, tp: int) -> int:
    return -(-n // tp)


def layer_shapes(model: ModelConfig, tp: int = 1) -> LayerShapes:
    h, d, b, L = model.hidden_size, model.resolved_head_dim, model.dtype_bytes, model.num_layers
    if model.num_heads % tp:
        raise ValueError(f"parallel.tp: {tp} must divide model.num_heads={model.num_heads}")
    heads = model.num_heads // tp
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ValueError(f"parallel.tp: {tp} and model.num_kv_heads={model.num_kv_heads} must divide one another")
    kv_heads = max(1, model.num_kv_heads // tp)       # replicated when fewer KV heads than GPUs

    if model.attention == "mla":
        rank, rope = model.kv_lora_rank, model.qk_rope_head_dim
        attn_gemms = [Gemm("q_proj", heads * (d + rope), h, L),
                      Gemm("kv_a_proj", rank + rope, h, L),          # replicated
                      Gemm("kv_b_proj", heads * 2 * d, rank, L),
                      Gemm("o_proj", h, heads * d, L)]
        attention = AttentionShape(heads, d + rope, d, (rank + rope) * b, heads * (2 * d + rope) * b, rank, rope)
        rope_elems = (heads + 1) * rope
    else:
        attn_gemms = [Gemm("qkv_proj", (heads + 2 * kv_heads) * d, h, L), Gemm("o_proj", h, heads * d, L)]
        attention = AttentionShape(heads, d, d, 2 * kv_heads * d * b, 2 * heads * d * b)
        rope_elems = (heads + kv_heads) * d

    gated = model.gated_mlp
    up_width = 2 if gated else 1

    def mlp(width: int, layers: int, prefix: str) -> list[Gemm]:
        return [Gemm(f"{prefix}up_proj", up_width * width, h, layers), Gemm(f"{prefix}down_proj", h, width, layers)]

    experts = None
    if model.num_experts:
        dense_layers = min(L, model.first_dense_layers)
        moe_layers = L - dense_layers
        im = _split(model.moe_intermediate_size or model.intermediate_size, tp)
        shared = model.num_shared_experts
        mlp_gemms = mlp(_split(model.intermediate_size, tp), dense_layers, "") if dense_layers else []
        mlp_gemms.append(Gemm("router", model.num_experts, h, moe_layers))
        if shared:
            mlp_gemms += mlp(shared * im, moe_layers, "shared_")
        experts = ExpertsShape(moe_layers, model.num_experts, model.num_experts_per_tok,
                               (up_width + 1) * h * im, 2 * h + (up_width + 1) * im)
        act_elems = (dense_layers * (up_width + 1) * _split(model.intermediate_size, tp)
                     + moe_layers * (up_width + 1) * im * (model.num_experts_per_tok + shared))
    else:
        inter = _split(model.intermediate_size, tp)
        mlp_gemms = mlp(inter, L, "")
        act_elems = L * (up_width + 1) * inter

    vocab = _split(model.vocab_size, tp)
    lm_head = Gemm("lm_head", vocab, h, 1)
    gemms = tuple(attn_gemms + mlp_gemms)
    # Fused add+RMSNorm twice a layer reads and writes x and the residual (8h);
    # rope rewrites q and k; the activation reads its inputs and writes its output.
    elementwise = (L * (8 * h + 2 * rope_elems) + act_elems + h) * b
    embedding = 0 if model.tie_word_embeddings else vocab * h
    weights = sum(g.n * g.k * g.layers for g in gemms)
    if experts:
        weights += experts.layers * experts.num_experts * experts.expert_params
    weights = weights * model.weight_dtype_bytes + (lm_head.n * lm_head.k + embedding) * b
    return LayerShapes(
        num_layers=L, dtype_bytes=b, weight_dtype_bytes=model.weight_dtype_bytes, gemms=gemms, lm_head=lm_head,
        experts=experts, attention=attention,
        elementwise_bytes_per_token=elementwise, hidden_bytes_per_token=h * b,
        weight_bytes=weights, kv_bytes_per_token=attention.kv_bytes_per_token * L)


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Distinct experts a batch of tokens routes to, if each token picks its
    top_k experts uniformly at random: E·(1 - (1 - k/E)^m). Real routers are
    skewed, so this is an upper estimate of the weight traffic."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


