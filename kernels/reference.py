"""Plain PyTorch references that every kernel test compares against. Slow and
obvious on purpose: explicit softmax in float32, one sequence at a time."""
from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """[num_blocks, block_size, H, D] -> [seq_len, H, D] for one sequence."""
    blocks = cache[torch.as_tensor(block_table, dtype=torch.long)]   # [n, block_size, H, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def ref_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: list[int], seq_lens: list[int],
                        block_tables: list[list[int]], scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]. Causal within each
    sequence's new tokens, full over its cached prefix. Returns [T, Hq, D] in q's dtype."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for b, seq_len in enumerate(seq_lens):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        q_len = e - s
        k = gather_kv(k_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        qb = q[s:e].float()                                               # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale             # [Hq, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def ref_write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write new tokens' k/v [T, Hkv, D] into the caches at slot_mapping [T]."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]


def ref_gather_blocks(cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Copy blocks [num_blocks, ...] -> one contiguous [len(block_ids), ...] buffer."""
    return torch.stack([cache[i] for i in block_ids]) if block_ids else cache[:0].clone()


def ref_scatter_blocks(cache: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    """Inverse of ref_gather_blocks: data[i] goes to cache[block_ids[i]]."""
    for i, b in enumerate(block_ids):
        cache[b] = data[i]
