"""Upper bounds on what any scheduler can serve on bench_adaptive_capacity.py's
workloads (llama3-8b on h100-sxm, one replica, its SLOs aside), from the cost
model alone; printed beside the capacities that benchmark measured, and 1.2x
the best fixed budget's (the adaptive study's target).

    python experiments/benchmarks/bench_adaptive_bounds.py

- dense: every prompt token the prefix cache does not hold and every output
  token after the first passes through the dense layers in some iteration,
  and an iteration of M tokens costs at least its terms other than attention
  and lm_head (CostModel.breakdown: GEMMs, elementwise, overhead), which per
  token are cheapest at the largest M. So no policy sustains more than
  (that best rate in tokens/s) / (computed tokens per request) requests/s.
- dense + attention: each request also attends its prompt; priced as one
  whole-prompt slice (the cheapest way to attend it in this model: every
  prompt's chunkings at 64 to 8,192 tokens are checked to cost at least that).
- seats: max_num_seqs decodes at once, at most B / t(B decodes at context 1)
  output tokens/s for B <= max_num_seqs.
The computed prompt tokens come from a run at a low rate (its iterations'
num_prefill_tokens: what the prefix cache did not hold). These are steady-state
bounds: the benchmark's runs are finite (300, 600 and 60 requests), so a
capacity it measures may sit above them while the backlog is still building."""
from __future__ import annotations

import contextlib
import io
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adaptive_capacity import COMMON, WORKLOADS, compose  # noqa: E402

from testbed.run import execute  # noqa: E402
from testbed.sim.cost_model import CostModel  # noqa: E402
from testbed.workloads.build import build_workload  # noqa: E402

# bench_adaptive_capacity.py's capacities (experiments/README.md, "adaptive"), req/s: best fixed, adaptive
MEASURED = {("azure_code", 50): (17.4, 17.4), ("azure_code", 100): (19.0, 19.0), ("chat", 50): (275, 275),
            ("chat", 100): (275, 275), ("long_context", 50): (0.0446, 0.0578), ("long_context", 100): (0.0446, 0.0688)}
DENSE = ("gemm_s", "experts_s", "elementwise_s", "allreduce_s", "pp_transfer_s", "overhead_s")
CHUNKS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def dense_tokens_per_s(cm: CostModel, largest: int = 131072) -> float:
    return max(m / sum(cm.breakdown([(m, m)], 0)[k] for k in DENSE) for m in range(16, largest + 1, 16))


def attention_s(cm: CostModel, prompt: int) -> float:
    """A whole-prompt slice's attention, checked to be the least of the chunkings tried."""
    whole = cm.breakdown([(prompt, prompt)], 0)["attention_s"]
    for c in CHUNKS:
        if c < prompt:
            chunked = sum(cm.breakdown([(min(c, prompt - s), min(s + c, prompt))], 0)["attention_s"]
                          for s in range(0, prompt, c))
            assert chunked >= whole * (1 - 1e-12), (prompt, c, chunked, whole)
    return whole


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-bounds-") as tmp:
        for name, (overrides, _, start_rate) in WORKLOADS.items():
            cfg = compose(COMMON + overrides + ["scheduler=sarathi", "token_budget=2048",
                                                f"workload.rate={start_rate / 10}"])
            requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
            prompts = np.array([r.prompt_len for r in requests])
            outputs = np.array([r.max_tokens for r in requests])
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                summary = execute(cfg, Path(tmp) / name)
            computed = summary["iterations"]["num_prefill_tokens"] / len(requests)
            cm = CostModel(cfg.model, cfg.hardware, cfg.parallel, cfg.engine)
            dense = dense_tokens_per_s(cm)
            per_request = computed + outputs.mean() - 1
            attention = float(np.mean([attention_s(cm, int(p)) for p in prompts]))
            decode = max(b / cm.iteration_time_s([(1, 1)] * b) for b in range(1, cfg.max_num_seqs + 1))
            bounds = {"dense": dense / per_request, "dense+attention": 1 / (per_request / dense + attention),
                      "seats": decode / (outputs.mean() - 1)}
            print(f"{name}: {len(requests)} requests, prompt mean {prompts.mean():.1f} (computed {computed:.1f}), "
                  f"output mean {outputs.mean():.2f}; dense layers at best {dense:,.0f} tokens/s, whole-prompt "
                  f"attention {attention * 1e3:.2f} ms per request, at most {decode:,.0f} decode tokens/s")
            for tbt in (50, 100):
                fixed, adaptive = MEASURED[(name, tbt)]
                rows.append((name, tbt, fixed, adaptive, 1.2 * fixed, *bounds.values(), min(bounds.values())))
    head = ("workload", "TBT SLO ms", "best fixed", "adaptive", "1.2x best fixed", "dense bound",
            "dense+attention bound", "seat bound", "least bound")
    cells = [head] + [tuple(f"{x:.4g}" if isinstance(x, float) else str(x) for x in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for r in cells:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths)))


if __name__ == "__main__":
    main()
