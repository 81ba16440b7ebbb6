"""ModelConfig: the architecture of a Llama-family decoder, shared by the real
executor (which builds the model) and the cost model (which only counts its
FLOPs and bytes). Presets are YAML files in conf/model/."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from testbed.preset_yaml import load_yaml

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 0                     # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # Qwen2 has q/k/v biases
    max_position_embeddings: int = 1_048_576
    dtype: str = "float32"                # activations, KV cache, embedding and lm_head
    weight_dtype: str = ""                # the linear layers' weights and inputs (W8A8); "": dtype
    path: str | None = None               # HF-style checkpoint dir; None: seeded random weights
    seed: int = 0
    # Architecture variants the cost model understands (the real engine runs GQA/MHA).
    attention: str = "gqa"                # gqa | mla
    kv_lora_rank: int = 0                 # MLA: latent KV rank
    qk_rope_head_dim: int = 0             # MLA: decoupled rope key dim
    num_experts: int = 0                  # MoE: 0 means dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0           # MoE: experts every token uses (DeepSeek)
    first_dense_layers: int = 0           # MoE: leading layers with a dense MLP (DeepSeek)
    gated_mlp: bool = True                # SwiGLU (3 matrices); False: a plain 2-matrix MLP (Falcon)
    norm: str = "rms_norm"                # rms_norm | layer_norm (Falcon, phi-2)
    parallel_block: bool = False          # attention and MLP read the same input, one add (Falcon, phi-2)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def resolved_weight_dtype(self) -> str:
        return self.weight_dtype or self.dtype

    @property
    def weight_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.resolved_weight_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token occupies over all layers."""
        if self.attention == "mla":
            per_layer = (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes
        else:
            per_layer = 2 * self.num_kv_heads * self.resolved_head_dim * self.dtype_bytes
        return per_layer * self.num_layers

    def validate(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"model.{field}: {why}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, f) < 1:
                raise bad(f, f"must be >= 1, got {getattr(self, f)}")
        for f in ("head_dim", "kv_lora_rank", "qk_rope_head_dim", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "num_shared_experts", "first_dense_layers"):
            if getattr(self, f) < 0:
                raise bad(f, f"must be >= 0 (0: not used), got {getattr(self, f)}")
        for f in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, f) > 0:
                raise bad(f, f"must be > 0, got {getattr(self, f)}")
        if self.max_position_embeddings < 1:
            raise bad("max_position_embeddings", f"must be >= 1, got {self.max_position_embeddings}")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_kv_heads", f"{self.num_kv_heads} must divide num_heads={self.num_heads} "
                      "(grouped-query attention shares each KV head among a whole group of query heads)")
        if not self.head_dim and self.hidden_size % self.num_heads:
            raise bad("head_dim", f"hidden_size={self.hidden_size} is not a multiple of num_heads="
                      f"{self.num_heads}; set head_dim explicitly")
        if self.dtype not in DTYPE_BYTES:
            raise bad("dtype", f"'{self.dtype}' is not one of {sorted(DTYPE_BYTES)}")
        if self.weight_dtype and self.weight_dtype not in DTYPE_BYTES:
            raise bad("weight_dtype", f"'{self.weight_dtype}' is not one of {sorted(DTYPE_BYTES)} "
                      "('' keeps the weights in dtype)")
        if self.attention not in ("gqa", "mla"):
            raise bad("attention", f"'{self.attention}' is not one of gqa, mla")
        if self.norm not in ("rms_norm", "layer_norm"):
            raise bad("norm", f"'{self.norm}' is not one of rms_norm, layer_norm")
        if self.attention == "mla" and self.kv_lora_rank < 1:
            raise bad("kv_lora_rank", "MLA needs kv_lora_rank >= 1")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise bad("num_experts_per_tok", f"must be in 1..num_experts={self.num_experts}")


def model_preset_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def load_model_preset(name: str, **overrides) -> ModelConfig:
    """The preset conf/model/NAME.yaml as a ModelConfig (outside Hydra: tests,
    benchmarks, the cost model)."""
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"model='{name}' is not a known preset; choose one of: {', '.join(model_preset_names())}")
    raw = load_yaml(path)
    raw.update(overrides)
    known = {f.name for f in fields(ModelConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"conf/model/{name}.yaml: unknown field(s) {sorted(unknown)}")
    return ModelConfig(**raw)
