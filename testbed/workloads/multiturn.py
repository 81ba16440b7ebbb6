"""A synthetic multi-turn chat workload with a chosen prefix reuse
(`workload.conversation_turns` > 0): the workload prefix caching and the KV
store (mode=kvstore) are for.

Conversations start by the configured arrival process (`rate` is
conversations per second); the first turn's prompt and every turn's answer
length come from the configured length distributions. Each later turn's
prompt is the previous prompt, plus its answer, plus new user text, so its
reused fraction is the previous prompt's share of it: the answer and the text
together are `(1 - reuse_fraction) / reuse_fraction` of the previous prompt.
A turn arrives a think time after the previous one (uniform in 0.5-1.5 x
`think_time_s`, counted from the previous turn's arrival, answer included:
never next to nothing, so a turn rarely arrives before its previous prompt
was prefilled). A conversation ends after `conversation_turns` turns, or
before a turn that would pass `max_prompt_len` (when set). The workload is
every turn of ceil(num_requests / conversation_turns) conversations (fewer
requests when max_prompt_len ends some early), the same at any rate.

Prompts are Mooncake-style block ids (`hash_block_size` tokens each; equal
ids, equal tokens): a turn's ids are the previous turn's plus fresh ones, so
its prompt extends the previous one token for token (a partial last block
grows into the same block), and `block_reuse` computes the expected reuse
from the ids alone. The answer's tokens in the next prompt are the workload's,
not the model's output: the history is given, as in a replayed trace."""
from __future__ import annotations


import itertools

import numpy as np

from testbed.workloads.arrivals import make_arrivals
from testbed.workloads.config import WorkloadConfig
from testbed.workloads.lengths import make_lengths
from testbed.workloads.readers import TraceRow


def multiturn_rows(cfg: WorkloadConfig, rngs: list[np.random.Generator]) -> list[TraceRow]:
    """The conversations' turns as trace rows (arrival_s, lengths, hash_ids), in arrival order."""
    n = cfg.num_requests if cfg.max_requests is None else min(cfg.num_requests, cfg.max_requests)
    arrival_rng, prompt_rng, output_rng = rngs
    # whole conversations, whatever the rate: a faster rate packs the same requests closer
    num_conversations = -(-n // cfg.conversation_turns)
    starts = make_arrivals(cfg).times(arrival_rng, num_conversations)
    first_lens = make_lengths(cfg, "prompt").sample(prompt_rng, num_conversations)
    bs, grow = cfg.hash_block_size, (1.0 - cfg.reuse_fraction) / cfg.reuse_fraction
    next_id = itertools.count()
    rows: list[TraceRow] = []
    for conv, (start, length) in enumerate(zip(starts.tolist(), first_lens.tolist())):
        ids = [next(next_id) for _ in range(-(-int(length) // bs))]
        t = start
        for turn in range(cfg.conversation_turns):
            if turn:
                length = length + max(1, round(length * grow))
                if cfg.max_prompt_len is not None and length > cfg.max_prompt_len:
                    break
                ids += [next(next_id) for _ in range(-(-length // bs) - len(ids))]
                t += float(arrival_rng.uniform(0.5, 1.5)) * cfg.think_time_s
            output = int(make_lengths(cfg, "output").sample(output_rng, 1)[0])
            rows.append(TraceRow(len(rows) + 1, int(length), output, arrival_s=t, hash_ids=tuple(ids)))
    rows.sort(key=lambda r: r.arrival_s)
    return rows


def block_reuse(rows: list[TraceRow], block_size: int) -> float:
    """The fraction of prompt tokens in full blocks seen before, in arrival
    order: the prefix hit rate of an unbounded cache that holds every full
    prompt block once its request has been prefilled. (Block ids name
    prefixes here, as in Mooncake's traces, so a seen block's prefix was seen.)"""
    seen: set[int] = set()
    reused = total = 0
    for r in sorted(rows, key=lambda r: r.arrival_s):
        full = r.prompt_len // block_size
        usable = (r.prompt_len - 1) // block_size      # never the last token's block
        hit = 0
        for i in range(usable):
            if r.hash_ids[i] not in seen:
                break
            hit += 1
        reused += hit * block_size
        total += r.prompt_len
        seen.update(r.hash_ids[:full])
    return reused / total if total else 0.0



