"""KV cache data movement: write new tokens into their slots, and gather/scatter
a request's blocks to/from one contiguous buffer (the unit the transports send).
Torch indexing here; kernels/triton_kv.py provides the GPU kernels."""
from __future__ import annotations

import torch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v: [num_tokens, num_kv_heads, head_dim] -> caches [num_blocks, block_size, H, D]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dim: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """cache.index_select(dim, block_ids), into `out` when given (preallocated
    staging buffers avoid page faults on fresh memory)."""
    if out is None:
        return cache.index_select(dim, block_ids)
    return torch.index_select(cache, dim, block_ids, out=out)


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor, dim: int = 0) -> None:
    """cache[..., block_ids, ...] = data along `dim`."""
    cache.index_copy_(dim, block_ids, data)
