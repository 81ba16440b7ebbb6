"""The attention-backend interface: one call computes attention for a whole
mixed batch (decodes and prefill chunks) against the paged KV cache.

Data flow: the model layer writes the new tokens' K/V into the cache through
`slot_mapping` (kernels/kv_ops.py), then calls `backend.forward`. Backends are
policies chosen by name (`attention_backend=torch|triton|flash_attn`).

A decode-only step replayed as a CUDA graph (testbed/model/cuda_graphs.py)
comes as `DecodeMetadata` instead: device tensors of a fixed batch size that
the graph's static buffers hold, read by `backend.forward_decode` without a
host sync or a shape that depends on the step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Per step, shared by every layer.

    Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1]; those
    queries are the last q_len of its seq_lens[b] tokens (causal: query i sees
    keys 0 .. seq_len - q_len + i). Its KV lives in blocks block_tables[b]."""
    query_start_loc: list[int]          # [B + 1], cu_seqlens_q
    seq_lens: list[int]                 # [B], context length including this step's tokens
    block_tables: list[list[int]]       # [B][ceil(seq_len / block_size)]
    slot_mapping: torch.Tensor          # [num_tokens] int64: block_id * block_size + offset
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, b: int) -> int:
        return self.query_start_loc[b + 1] - self.query_start_loc[b]

    def padded_block_table_array(self) -> np.ndarray:
        """[B, max_blocks] int32 on the host, padded with 0 (never read past seq_len). Row by row
        through numpy: a 64K-token chunk beside 128 decodes pads to 0.5M entries, which a Python
        list of ints took ~40 ms to build every step."""
        width = max(len(t) for t in self.block_tables)
        out = np.zeros((len(self.block_tables), width), dtype=np.int32)
        for b, t in enumerate(self.block_tables):
            out[b, : len(t)] = t
        return out

    def padded_block_tables(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[B, max_blocks] int32, padded with 0 (never read past seq_len)."""
        return torch.from_numpy(self.padded_block_table_array()).to(device)


@dataclass
class DecodeMetadata:
    """A decode-only step of a fixed batch size as device tensors: one query
    per sequence (row b of q is sequence b). Padding rows (a batch padded up to
    a captured size) have seq_len 1 and a block table of the scratch block, so
    they read and write nothing a request owns."""
    seq_lens: torch.Tensor          # [B] int32, context length including this step's token
    block_tables: torch.Tensor      # [B, max_blocks] int32
    slot_mapping: torch.Tensor      # [B] int64
    query_start_loc: torch.Tensor   # [B + 1] int32: 0, 1, ..., B
    first_query: torch.Tensor       # [B] int32 zeros: each sequence's one query is its first
    block_size: int

    @property
    def max_seq_len(self) -> int:
        """A static bound on every seq_len (the block tables' width in tokens): kernels size by it."""
        return self.block_tables.shape[1] * self.block_size


class AttentionBackend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k_cache/v_cache: [num_blocks,
        block_size, num_kv_heads, head_dim]; returns [num_tokens, num_heads, head_dim]."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: DecodeMetadata, scale: float) -> torch.Tensor:
        """forward() of a decode-only step given as DecodeMetadata, safe to capture
        in a CUDA graph: no host sync, no shape taken from the tensors' values."""


_BACKENDS: dict[str, str] = {
    # name -> "module:Class", imported on demand so that a missing optional
    # package (triton, flash-attn) only matters when that backend is chosen.
    "torch": "testbed.kernels.torch_backend:TorchAttentionBackend",
    "triton": "testbed.kernels.triton_backend:TritonAttentionBackend",
    "flash_attn": "testbed.kernels.flash_attn_backend:FlashAttnBackend",
}


def attention_backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend='{name}' is not known; choose one of: {', '.join(attention_backend_names())}")
    import importlib
    module, cls = _BACKENDS[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ValueError(f"attention_backend='{name}' needs the package '{e.name}', which is not installed "
                         f"(pip install pd-testbed[gpu]), or choose attention_backend=torch") from e
    return getattr(mod, cls)()
