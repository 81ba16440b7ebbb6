"""`attention_backend=triton`: the paged-attention Triton kernel
(kernels/triton_attention.py) behind the AttentionBackend interface.

Every layer of a step receives the same AttentionMetadata; the backend turns
it into device tensors and a work list once (the plan) and reuses that plan
for the other layers, so the per-layer cost is one kernel launch. A
DecodeMetadata step (a CUDA graph's) is planned from its device tensors
alone, every layer: no host work to reuse, nothing to sync."""
from __future__ import annotations

import torch

from testbed.kernels.attention import AttentionBackend, AttentionMetadata, DecodeMetadata
from testbed.kernels.triton_attention import (AttentionPlan, TileConfig, paged_attention, plan_attention,
                                            plan_decode)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, tile: TileConfig | None = None) -> None:
        self.tile = tile                          # None: default_tile() per step
        self._planned_for: tuple | None = None
        self._plan: AttentionPlan | None = None

    def plan(self, meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
             device: torch.device) -> AttentionPlan:
        # The same metadata object with the same lengths means the same step
        # (seq_lens grow every step, so a reused object is still noticed).
        key = (num_heads, num_kv_heads, device, list(meta.seq_lens), list(meta.query_start_loc))
        if self._plan is None or self._planned_for is None or self._planned_for[0] is not meta \
                or self._planned_for[1] != key:
            self._plan = plan_attention(meta, num_heads, num_kv_heads, device, self.tile)
            self._planned_for = (meta, key)
        return self._plan

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self.plan(meta, q.shape[1], k_cache.shape[2], q.device)
        return paged_attention(q, k_cache, v_cache, plan, scale)

    def forward_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: DecodeMetadata, scale: float) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, plan_decode(meta, q.shape[1], k_cache.shape[2], self.tile), scale)
