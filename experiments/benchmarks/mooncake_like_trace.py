"""A Mooncake-format trace with the statistics of Mooncake's conversation
trace (mean input ~12K tokens, max ~126K, 512-token hash blocks, ~37% of
blocks seen before, ~3.3 requests/s, mean output ~340), for simulator speed
runs: `bench_kvstore.py speed`. Reused blocks are a prefix of an earlier
request's (hash ids name prefixes, as in Mooncake's traces).

    python experiments/benchmarks/mooncake_like_trace.py OUT.jsonl [--requests 12000] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import random

BLOCK = 512


def make_trace(n: int, seed: int, reuse_p: float = 0.5, mean_input: float = 10_200, max_input: int = 126_000,
               rate: float = 3.3) -> list[dict]:
    """`mean_input` is the first turns' lognormal mean; later turns, which
    carry a conversation's history, raise the trace's mean to ~12K."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    rows, next_id, t = [], 0, 0.0
    sigma = 1.0
    mu = __import__("math").log(mean_input) - sigma ** 2 / 2
    for _ in range(n):
        length = min(max_input, max(BLOCK, int(rng.lognormvariate(mu, sigma))))
        blocks = -(-length // BLOCK)
        ids: list[int] = []
        if prompts and rng.random() < reuse_p:
            # a later turn of a recent conversation: its whole prompt (or most of it) and then new text
            parent = prompts[rng.randrange(max(0, len(prompts) - 400), len(prompts))]
            ids = parent[:min(len(parent), max_input // BLOCK - 1, rng.randint(len(parent) // 2, len(parent)))]
            blocks = min(max_input // BLOCK, len(ids) + max(1, blocks // 2))
            length = min(max_input, blocks * BLOCK - rng.randrange(BLOCK))
        fresh = blocks - len(ids)
        ids = ids + list(range(next_id, next_id + fresh))
        next_id += fresh
        prompts.append(ids)
        t += rng.expovariate(rate)
        rows.append({"timestamp": int(t * 1000), "input_length": length,
                     "output_length": max(1, min(2000, int(rng.expovariate(1 / 340)))), "hash_ids": ids})
    return rows


def reused_block_fraction(rows: list[dict]) -> float:
    seen: set[int] = set()
    reused = total = 0
    for r in rows:
        reused += sum(h in seen for h in r["hash_ids"])
        total += len(r["hash_ids"])
        seen.update(r["hash_ids"])
    return reused / total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--requests", type=int, default=12_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = make_trace(args.requests, args.seed)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lens = [r["input_length"] for r in rows]
    print(f"{len(rows)} requests, mean input {sum(lens) / len(lens):,.0f}, max {max(lens):,}, "
          f"{reused_block_fraction(rows):.1%} of blocks seen before, span {rows[-1]['timestamp'] / 1000:,.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
