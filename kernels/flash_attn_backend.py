"""`attention_backend=flash_attn`: FlashAttention-2's varlen kernel over the
paged KV cache. Importing this module without the flash-attn package raises
ModuleNotFoundError, which the backend registry (kernels/attention.py) turns
into an error naming the package.

Upstream flash-attn reads paged KV directly (`block_table`) only when a block
holds a multiple of 256 tokens; with smaller blocks (the engine's usual 16)
each step first gathers every sequence's KV into one contiguous varlen
buffer, a copy the timings then include. Both paths use flash-attn's causal
mask, which is bottom-right aligned like AttentionMetadata's. A DecodeMetadata
step (a CUDA graph's) calls flash_attn_with_kvcache on the block tables
directly, which needs the same block multiple."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from testbed.kernels.attention import AttentionBackend, AttentionMetadata, DecodeMetadata

PAGED_BLOCK_MULTIPLE = 256     # flash-attn 2.x: "Paged KV cache block size must be divisible by 256"


@dataclass
class _VarlenPlan:
    cu_seqlens_q: torch.Tensor          # [B + 1] int32
    cu_seqlens_k: torch.Tensor          # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor | None    # [B, max_blocks] int32 (paged path)
    slots: torch.Tensor | None          # [sum(seq_lens)] int64 cache slots (gather path)


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self) -> None:
        self._reads_pages = "block_table" in inspect.signature(flash_attn_varlen_func).parameters
        self._planned_for: tuple | None = None
        self._plan: _VarlenPlan | None = None

    def plan(self, meta: AttentionMetadata, device: torch.device) -> _VarlenPlan:
        key = (device, list(meta.seq_lens), list(meta.query_start_loc))
        if self._plan is not None and self._planned_for is not None and self._planned_for[0] is meta \
                and self._planned_for[1] == key:
            return self._plan
        cu_k = [0]
        for s in meta.seq_lens:
            cu_k.append(cu_k[-1] + s)
        q_lens = [meta.query_len(b) for b in range(meta.num_seqs)]
        paged = self._reads_pages and meta.block_size % PAGED_BLOCK_MULTIPLE == 0
        slots = None
        if not paged:
            bs = meta.block_size
            within = torch.arange(bs)
            slots = torch.cat([(torch.tensor(t, dtype=torch.int64)[:, None] * bs + within).flatten()[:s]
                               for t, s in zip(meta.block_tables, meta.seq_lens)]).to(device)
        self._plan = _VarlenPlan(
            torch.tensor(meta.query_start_loc, dtype=torch.int32).to(device),
            torch.tensor(cu_k, dtype=torch.int32).to(device), max(q_lens), max(meta.seq_lens),
            meta.padded_block_tables(device) if paged else None, slots)
        self._planned_for = (meta, key)
        return self._plan

    @staticmethod
    def _check(q: torch.Tensor) -> None:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention_backend=flash_attn needs CUDA float16/bfloat16 tensors, got {q.dtype} "
                             f"on {q.device}; choose attention_backend=triton or torch")

    def forward_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: DecodeMetadata, scale: float) -> torch.Tensor:
        self._check(q)
        if meta.block_size % PAGED_BLOCK_MULTIPLE:
            raise ValueError(f"block_size={meta.block_size}: CUDA-graph decodes with attention_backend=flash_attn "
                             f"need a multiple of {PAGED_BLOCK_MULTIPLE}; choose attention_backend=triton "
                             f"or cuda_graphs=false")
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                      block_table=meta.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)                                              # [B, Hq, D]

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self._check(q)
        p = self.plan(meta, q.device)
        if p.block_table is not None:
            k, v = k_cache, v_cache
        else:
            k = k_cache.reshape(-1, *k_cache.shape[2:]).index_select(0, p.slots)   # [sum(seq_lens), Hkv, D]
            v = v_cache.reshape(-1, *v_cache.shape[2:]).index_select(0, p.slots)
        extra = {"block_table": p.block_table} if p.block_table is not None else {}
        return flash_attn_varlen_func(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k,
                                      softmax_scale=scale, causal=True, **extra)
