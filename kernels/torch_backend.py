"""`attention_backend=torch`: gather each sequence's blocks and call
scaled_dot_product_attention. The CPU default and the engine's reference path.

Decodes (one query each) are padded into batched SDPA calls, grouped by
length (padding at most doubles a group's work; on the CPU a few MB of KV per
call, so the gathered blocks are still in cache for SDPA); prefill
chunks run one sequence at a time with a bottom-right causal mask. A
DecodeMetadata step (CUDA-graph shape) pads every decode to the block tables'
whole width: memory grows with that width, which suits the CPU tests of the
graph path and short contexts, not a GPU serving long ones."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from testbed.kernels.attention import AttentionBackend, AttentionMetadata, DecodeMetadata
from testbed.kernels.decode_groups import decode_groups


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # gathered K+V per batched-decode SDPA call on the CPU: a few MB stays in
    # L2/L3 between the gather and the attention (measured on a 2-core EPYC,
    # 1 MB L2 per core, 32 MB L3: 4 MB beat both 1 MB and the whole batch)
    cpu_decode_group_bytes = 4 << 20

    def __init__(self) -> None:
        # Gather buffers reused across layers and steps. A fresh multi-MB tensor
        # per gather is a fresh mmap on the CPU, paying a page fault per 4 KiB:
        # that was ~80% of a 32-request decode step, 30x the copy itself.
        self._scratch: dict[int, torch.Tensor] = {}

    def _gather(self, cache: torch.Tensor, idx: torch.Tensor, slot: int) -> torch.Tensor:
        """cache.index_select(0, idx) into scratch buffer `slot` (0: K, 1: V);
        valid until the next _gather into the same slot."""
        shape = (idx.numel(), *cache.shape[1:])
        numel = math.prod(shape)
        buf = self._scratch.get(slot)
        if buf is None or buf.numel() < numel or buf.dtype != cache.dtype or buf.device != cache.device:
            grown = numel if buf is None else max(numel, buf.numel() * 3 // 2)   # decodes grow a block at a time
            buf = self._scratch[slot] = torch.empty(grown, dtype=cache.dtype, device=cache.device)
        return torch.index_select(cache, 0, idx, out=buf[:numel].view(shape))

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        gqa = q.shape[1] != k_cache.shape[2]
        decodes = [b for b in range(meta.num_seqs) if meta.query_len(b) == 1]
        if len(decodes) > 1:
            self._decodes(q, k_cache, v_cache, meta, scale, decodes, out, gqa)
            decodes = set(decodes)
        else:
            decodes = set()
        for b in range(meta.num_seqs):
            if b not in decodes:
                self._one(q, k_cache, v_cache, meta, scale, b, out, gqa)
        return out

    def forward_decode(self, q, k_cache, v_cache, meta: DecodeMetadata, scale: float) -> torch.Tensor:
        num_seqs, width = meta.block_tables.shape
        num_kv_heads, head_dim = k_cache.shape[2:]
        idx = meta.block_tables.reshape(-1).long()
        k = k_cache.index_select(0, idx).view(num_seqs, width * meta.block_size, num_kv_heads, head_dim)
        v = v_cache.index_select(0, idx).view(num_seqs, width * meta.block_size, num_kv_heads, head_dim)
        keys = torch.arange(width * meta.block_size, device=q.device)
        mask = (keys.unsqueeze(0) < meta.seq_lens.unsqueeze(1))[:, None, None, :]       # [B, 1, 1, max_len]
        qd = q.view(num_seqs, num_kv_heads, -1, head_dim)                               # [B, Hkv, group, D]
        o = F.scaled_dot_product_attention(qd, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
        return o.reshape(num_seqs, -1, head_dim)

    def _one(self, q, k_cache, v_cache, meta, scale, b, out, gqa) -> None:
        seq_len = meta.seq_lens[b]
        s, e = meta.query_start_loc[b], meta.query_start_loc[b + 1]
        q_len = e - s
        n = -(-seq_len // meta.block_size)
        idx = torch.tensor(meta.block_tables[b][:n], dtype=torch.long, device=q.device)
        kv_shape = k_cache.shape[2:]
        k = self._gather(k_cache, idx, 0).view(-1, *kv_shape)[:seq_len].transpose(0, 1)  # [Hkv, seq_len, D]
        v = self._gather(v_cache, idx, 1).view(-1, *kv_shape)[:seq_len].transpose(0, 1)
        if q_len == 1:
            mask, causal = None, False
        elif q_len == seq_len:
            mask, causal = None, True
        else:
            # bottom-right causal: query i sits at position seq_len - q_len + i
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            mask, causal = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos, False
        # 4-D inputs: with 3-D ones PyTorch's CPU SDPA falls back to its math path (5x slower)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=gqa)
        out[s:e] = o[0].transpose(0, 1)

    def _decodes(self, q, k_cache, v_cache, meta, scale, decodes, out, gqa) -> None:
        budget = self.cpu_decode_group_bytes if q.device.type == "cpu" else None
        per_token = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()    # K and V
        lens = [meta.seq_lens[b] for b in decodes]
        for group in decode_groups(lens, meta.block_size, None if budget is None else budget // per_token):
            self._decode_group(q, k_cache, v_cache, meta, scale, [decodes[i] for i in group], out)

    def _decode_group(self, q, k_cache, v_cache, meta, scale, decodes, out) -> None:
        """Decodes (one query each) padded into one SDPA call."""
        bs = meta.block_size
        lens = [meta.seq_lens[b] for b in decodes]
        width = -(-max(lens) // bs)
        # pad block tables with block 0: padded keys are masked out below
        table = torch.tensor([meta.block_tables[b][:width] + [0] * (width - len(meta.block_tables[b][:width]))
                              for b in decodes], dtype=torch.long, device=q.device)
        nd, kv_shape, max_len = len(decodes), k_cache.shape[2:], max(lens)
        k = self._gather(k_cache, table.view(-1), 0).view(nd, width * bs, *kv_shape)[:, :max_len].transpose(1, 2)
        v = self._gather(v_cache, table.view(-1), 1).view(nd, width * bs, *kv_shape)[:, :max_len].transpose(1, 2)
        # [nd, Hkv, max_len, D]; keys past a sequence's own length are masked, and
        # when every length is equal there is nothing to mask (SDPA's faster path)
        mask = None
        if min(lens) != max_len:
            mask = (torch.arange(max_len, device=q.device).unsqueeze(0)
                    < torch.tensor(lens, device=q.device).unsqueeze(1))[:, None, None, :]
        rows = torch.tensor([meta.query_start_loc[b] for b in decodes], dtype=torch.long, device=q.device)
        num_kv_heads, head_dim = kv_shape[0], kv_shape[1]
        # fold each KV head's query group into the query axis: no GQA expansion of K/V
        qd = q.index_select(0, rows).view(nd, num_kv_heads, -1, head_dim)            # [nd, Hkv, group, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
        out.index_copy_(0, rows, o.reshape(nd, -1, head_dim))
