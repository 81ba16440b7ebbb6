"""`attention_backend=torch`: gather each sequence's blocks and call
scaled_dot_product_attention. The CPU default and the engine's reference path."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from testbed.kernels.attention import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = meta.block_size
        kv_shape = k_cache.shape[2:]
        gqa = q.shape[1] != k_cache.shape[2]
        for b, seq_len in enumerate(meta.seq_lens):
            s, e = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            q_len = e - s
            table = meta.block_tables[b]
            n = (seq_len + block_size - 1) // block_size
            idx = torch.tensor(table[:n], dtype=torch.long)
            k = k_cache.index_select(0, idx).view(-1, *kv_shape)[:seq_len]   # [seq_len, Hkv, D]
            v = v_cache.index_select(0, idx).view(-1, *kv_shape)[:seq_len]
            qb = q[s:e].transpose(0, 1)                                     # [Hq, q_len, D]
            kb, vb = k.transpose(0, 1), v.transpose(0, 1)                   # [Hkv, seq_len, D]
            if q_len == 1:
                mask, causal = None, False
            elif q_len == seq_len:
                mask, causal = None, True
            else:
                # bottom-right causal: query i sits at position seq_len - q_len + i
                q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
                mask, causal = torch.arange(seq_len).unsqueeze(0) <= q_pos, False
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=causal,
                                               scale=scale, enable_gqa=gqa)
            out[s:e] = o.transpose(0, 1)
        return out
