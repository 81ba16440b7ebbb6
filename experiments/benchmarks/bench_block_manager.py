"""BlockManager overhead per engine step for a batch of running decodes.

Each step does, per request, what the scheduler and engine do around a decode:
`can_allocate` + `allocate` for one more token, then (after the "forward pass",
which here only appends a token) `commit`. Only the BlockManager calls are timed.
Prompt lengths are staggered so that about 1/block_size of the requests cross a
block boundary each step (a new block, a newly full block to hash), as in a
real batch; steps where no request crosses are reported apart.

    python experiments/benchmarks/bench_block_manager.py [--num-requests 256]
"""
from __future__ import annotations

import argparse
import statistics
import time

from testbed.block_manager import BlockManager
from testbed.request import Request


def run(num_requests: int, prompt_len: int, steps: int, block_size: int, stagger: bool) -> list[tuple[int, bool]]:
    """Returns (ns spent in the BlockManager, whether any request crossed a block boundary) per step."""
    max_len = prompt_len + block_size + steps + 1
    bm = BlockManager(num_blocks=num_requests * (-(-max_len // block_size)), block_size=block_size)
    running = []
    for i in range(num_requests):
        # distinct prompts (no prefix hits), lengths staggered across one block
        n = prompt_len + (i % block_size if stagger else 0)
        r = Request(f"r{i}", [(i * 7919 + t) % 32000 for t in range(n)], max_tokens=steps + 2)
        assert bm.allocate(r, n)
        r.num_computed_tokens = n
        bm.commit(r)
        r.output_token_ids.append(1)  # the prefill's sampled token
        running.append(r)
    results = []
    clock = time.perf_counter_ns
    for _ in range(steps):
        crossed = any(r.num_tokens % block_size in (0, 1) for r in running)
        t0 = clock()
        for r in running:
            n = r.num_computed_tokens + 1
            if not bm.can_allocate(r, n) or not bm.allocate(r, n):
                raise RuntimeError("benchmark sized the cache too small")
        t1 = clock()
        for r in running:  # the forward pass: the KV of one token, one sampled token
            r.num_computed_tokens += 1
            r.output_token_ids.append(2)
        t2 = clock()
        for r in running:
            bm.commit(r)
        t3 = clock()
        results.append((t1 - t0 + t3 - t2, crossed))
    for r in running:
        bm.free(r.request_id)
    bm.check_invariants()
    assert bm.all_free()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    staggered = run(args.num_requests, args.prompt_len, args.steps, args.block_size, stagger=True)
    aligned = run(args.num_requests, args.prompt_len, args.steps, args.block_size, stagger=False)
    quiet = [ns for ns, crossed in aligned if not crossed]
    boundary = [ns for ns, crossed in aligned if crossed]
    all_steps = [ns for ns, _ in staggered]
    n = args.num_requests
    print(f"BlockManager work per step, {n} running decodes, prompt {args.prompt_len}, "
          f"block {args.block_size}, {args.steps} steps")
    print(f"  no block boundary crossed : median {statistics.median(quiet) / 1e3:8.1f} us/step "
          f"({statistics.median(quiet) / n:6.0f} ns/request)")
    print(f"  all requests cross at once: median {statistics.median(boundary) / 1e3:8.1f} us/step "
          f"({statistics.median(boundary) / n:6.0f} ns/request: allocate a block + hash a full one)")
    print(f"  staggered (realistic mix) : mean   {statistics.fmean(all_steps) / 1e3:8.1f} us/step, "
          f"median {statistics.median(all_steps) / 1e3:8.1f} us/step")


if __name__ == "__main__":
    main()
