"""Token sampling: greedy, or temperature / top-p with a per-request seeded
generator, so a request samples the same tokens whatever batch it lands in."""
from __future__ import annotations

import torch
import xxhash

from testbed.request import SamplingParams


def _generator(params: SamplingParams, request_id: str, token_index: int) -> torch.Generator:
    # a fresh stream per (request, position): independent of batch composition
    # and of how many other requests were sampled before
    key = xxhash.xxh3_64_intdigest(f"{params.seed}:{request_id}:{token_index}".encode()) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator().manual_seed(key)


def sample_one(logits: torch.Tensor, params: SamplingParams, request_id: str, token_index: int) -> int:
    """logits: [vocab] float32."""
    if params.temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p   # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=_generator(params, request_id, token_index)))


def sample(logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
           token_indices: list[int]) -> list[int]:
    """logits: [num_rows, vocab]. Greedy rows are argmax'ed together."""
    if all(p.temperature <= 0.0 for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [sample_one(logits[i], p, rid, ti)
            for i, (p, rid, ti) in enumerate(zip(params, request_ids, token_indices))]
