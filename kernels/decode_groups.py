"""How the torch backend splits one forward into SDPA calls, in plain Python
(no torch), so that the cost model (testbed/sim/timers.py) counts exactly
what kernels/torch_backend.py runs, and the simulator's start-up stays
torch-free."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def decode_groups(lens: Sequence[int], block_size: int, budget_tokens: int | None) -> list[list[int]]:
    """How the backend batches decodes of these context lengths: indices into
    `lens`, sorted by length, one list per SDPA call. Padding to a group's
    longest context at most doubles its work: 8 short decodes beside 2 of 1K
    tokens would otherwise all pay for 1K (2.3x the step on `tiny`). On the
    CPU a group also holds at most `budget_tokens` padded tokens (cache
    blocking: each gathered K/V is still in cache when SDPA reads it; one
    gather of the whole batch, 17 MB per layer for 32 x 1K tokens of `tiny`,
    goes through DRAM twice more than the attention itself needs). The cost
    model counts the calls with it (attention_calls, testbed/sim/timers.py)."""
    groups: list[list[int]] = []
    group: list[int] = []
    first_len = 0
    for i in sorted(range(len(lens)), key=lens.__getitem__):
        tokens = -(-lens[i] // block_size) * block_size      # the padded width with this decode
        if group and (tokens > 2 * first_len
                      or (budget_tokens is not None and (len(group) + 1) * tokens > budget_tokens)):
            groups.append(group)
            group = []
        if not group:
            first_len = tokens
        group.append(i)
    if group:
        groups.append(group)
    return groups


class AttentionCalls(NamedTuple):
    """The SDPA calls of one forward, as the cost model prices them."""
    single: int            # on one sequence: a prompt, a chunk, a lone decode
    batched: int           # on a group of decodes (decode_groups)
    masked: int            # of the batched: lengths differ, so a key mask (SDPA's slower path)
    padding: int           # key positions the batched calls compute past their decodes' contexts


def attention_calls(slices: Sequence[tuple[int, int]], block_size: int, budget_tokens: int | None) -> AttentionCalls:
    """SDPA calls of one forward over (new tokens, context) slices: one per
    prefill slice, and the decodes (one query each) batched by decode_groups
    when there are two or more (a lone decode runs on its own). The kinds cost
    differently: a batched call also builds the padded table and the row
    index, and one of unlike lengths pads every decode to the longest and
    masks the padding."""
    decodes = [ctx for q, ctx in slices if q == 1]
    if len(decodes) < 2:
        return AttentionCalls(len(slices), 0, 0, 0)
    groups = [[decodes[i] for i in g] for g in decode_groups(decodes, block_size, budget_tokens)]
    masked = sum(min(g) != max(g) for g in groups)
    padding = sum(len(g) * max(g) - sum(g) for g in groups)
    return AttentionCalls(len(slices) - len(decodes), len(groups), masked, padding)
