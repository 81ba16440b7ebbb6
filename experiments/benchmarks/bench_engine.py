"""The real engine against a plain dense PyTorch forward of the same weights.

What the paging costs: the engine writes K/V through a slot mapping into
[layers, 2, blocks, block_size, Hkv, D] and gathers each sequence's blocks
before SDPA; the dense baseline (written here, gpt-fast style) keeps a static
[B, Hkv, max_len, D] cache and calls SDPA on slices of it. Both use ex.model's
parameters, the same fused q|k|v and gate|up GEMMs and the same sampling
(argmax of the sampled rows' logits), so the ratio isolates paging and the
engine's per-step bookkeeping (scheduler, metadata, sampling).

  prefill: one 2,048-token prompt, whole (token_budget >= prompt)
  decode:  32 requests at 1,024 tokens of context, one token each per iteration

Figures: ms per iteration, tokens/s, achieved GFLOP/s (2 * linear params *
tokens + 2 * hidden * vocab per sampled row + attention QK^T and PV) and that as
a fraction of this machine's fp32 matmul rate, measured here with torch.mm.
Engine and dense repetitions alternate, so both see the same machine load;
`ratio` compares medians, `best` the fastest repetitions (on a shared, busy
machine the better estimate of what each costs). Use --threads 1 when other
processes keep the cores busy: with 2 threads on 2 contended cores every
parallel region waits for a descheduled thread and the figures mean nothing.

    python experiments/benchmarks/bench_engine.py [--presets tiny mid] [--threads 2] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from testbed.block_manager import BlockManager
from testbed.engine import Engine, WallClock
from testbed.model.config import ModelConfig, load_model_preset
from testbed.model.llama import LlamaModel, apply_rotary
from testbed.model_executor import ModelExecutor
from testbed.request import Request
from testbed.schedulers import SchedulerConfig, make_scheduler

BLOCK_SIZE = 16


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    """Best of `reps` fp32 n x n x n torch.mm calls: this CPU's GEMM ceiling."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- FLOP counts -------------------------------------------------------------------

def linear_params(cfg: ModelConfig) -> int:
    """Parameters every token multiplies through (no embedding, no LM head)."""
    h, d = cfg.hidden_size, cfg.resolved_head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    return cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size)


def step_flops(cfg: ModelConfig, num_tokens: int, num_logit_rows: int, attn_pairs: int) -> float:
    """attn_pairs: query-key pairs scored in one layer, summed over the batch."""
    attn = 4 * cfg.num_heads * cfg.resolved_head_dim * attn_pairs * cfg.num_layers
    return 2 * linear_params(cfg) * num_tokens + 2 * cfg.hidden_size * cfg.vocab_size * num_logit_rows + attn


# ---- the dense baseline --------------------------------------------------------------

class DenseLlama:
    """A straightforward Llama forward over ex.model's parameters with a static
    KV cache [layers, 2, B, Hkv, max_len, D]: no blocks, no slot mapping, no gathers."""

    def __init__(self, model: LlamaModel, batch: int, max_len: int, fold_gqa: bool):
        cfg = model.cfg
        self.m, self.cfg = model, cfg
        self.h, self.d = cfg.num_heads, cfg.resolved_head_dim
        self.hkv = cfg.num_kv_heads
        self.fold_gqa = fold_gqa     # GQA as [B, Hkv, group*q_len, D] queries, or SDPA's enable_gqa
        dtype = model.embed_tokens.weight.dtype
        self.cache = torch.randn(cfg.num_layers, 2, batch, self.hkv, max_len, self.d, dtype=dtype)

    def _attention(self, q, k_all, v_all, causal: bool):
        """q [B, H, q_len, D], k_all/v_all [B, Hkv, L, D] -> [B, q_len, H*D]."""
        b, _, q_len, d = q.shape
        if self.fold_gqa and q_len == 1:
            o = F.scaled_dot_product_attention(q.view(b, self.hkv, -1, d), k_all, v_all)
        else:
            o = F.scaled_dot_product_attention(q, k_all, v_all, is_causal=causal, enable_gqa=self.h != self.hkv)
        return o.view(b, self.h, q_len, d).transpose(1, 2).reshape(b, q_len, self.h * d)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int) -> torch.Tensor:
        """input_ids [B, q_len] at positions start..start+q_len-1 of every
        sequence; returns the last position's logits [B, vocab]."""
        m, d = self.m, self.d
        b, q_len = input_ids.shape
        end = start + q_len
        x = m.embed_tokens(input_ids)                                         # [B, q_len, hidden]
        cos, sin = m.rotary.cos_sin(torch.arange(start, end), x.dtype)        # [q_len, 1, D]
        cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)                   # [1, q_len, D] for [B, H, q_len, D]
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            hn = layer.input_layernorm(x)
            q, k, v = attn.qkv_proj(hn).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q = apply_rotary(q.view(b, q_len, self.h, d).transpose(1, 2), cos, sin)      # [B, H, q_len, D]
            k = apply_rotary(k.view(b, q_len, self.hkv, d).transpose(1, 2), cos, sin)    # [B, Hkv, q_len, D]
            v = v.view(b, q_len, self.hkv, d).transpose(1, 2)
            kc, vc = self.cache[i, 0], self.cache[i, 1]
            kc[:, :, start:end] = k
            vc[:, :, start:end] = v
            o = self._attention(q, kc[:, :, :end], vc[:, :, :end], causal=q_len > 1)
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.compute_logits(m.norm(x[:, -1]))


# ---- the engine side ----------------------------------------------------------------

def build_engine(cfg: ModelConfig, num_blocks: int, token_budget: int) -> tuple[Engine, BlockManager, ModelExecutor]:
    bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    sched = make_scheduler("sarathi", SchedulerConfig(token_budget=token_budget, max_num_seqs=64,
                                                      max_num_batched_tokens=token_budget), bm)
    ex = ModelExecutor(cfg, num_blocks, BLOCK_SIZE, bm.block_table)
    return Engine(sched, ex, WallClock()), bm, ex


def bench_prefill(cfg: ModelConfig, prompt_len: int, reps: int) -> dict:
    engine, bm, ex = build_engine(cfg, -(-prompt_len // BLOCK_SIZE) + 1, prompt_len)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    dense = DenseLlama(ex.model, 1, prompt_len, fold_gqa=False)
    ids = torch.tensor([prompt])

    def engine_once(i: int) -> int:
        req = Request(f"p{i}", prompt, max_tokens=1)
        engine.add_request(req)
        out = engine.step()
        assert out.iteration.num_prefill_tokens == prompt_len and req.num_output_tokens == 1
        assert bm.all_free()
        return req.output_token_ids[0]

    def dense_once() -> int:
        return int(dense.forward(ids, 0).argmax(-1))

    assert engine_once(-1) == dense_once(), "engine and dense baseline disagree on the first token"
    t_engine, t_dense = [], []
    for i in range(reps):
        t_engine.append(_timed(lambda: engine_once(i)))
        t_dense.append(_timed(dense_once))
    flops = step_flops(cfg, prompt_len, 1, prompt_len * (prompt_len + 1) // 2)
    return _result(f"prefill {prompt_len}", prompt_len, flops, t_engine, t_dense, "dense causal SDPA")


def bench_decode(cfg: ModelConfig, batch: int, context: int, steps: int) -> dict:
    """`batch` requests whose first `context` tokens already have KV (random
    values written into their blocks, as a decode worker receives them), each
    with one sampled token to feed: every iteration is `batch` decodes."""
    max_len = context + steps + 2
    blocks_per_req = -(-max_len // BLOCK_SIZE)
    engine, bm, ex = build_engine(cfg, batch * blocks_per_req, batch)
    gen = torch.Generator().manual_seed(1)
    ex.kv_cache.copy_(torch.randn(ex.kv_cache.shape, generator=gen))
    for i in range(batch):
        req = Request(f"d{i}", torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist(),
                      max_tokens=steps + 10)
        assert bm.allocate(req, context)
        req.output_token_ids.append(int(torch.randint(0, cfg.vocab_size, (1,), generator=gen)))
        engine.add_prefilled(req)
    denses = {fold: DenseLlama(ex.model, batch, max_len, fold) for fold in (False, True)}
    next_ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)

    def engine_step() -> None:
        out = engine.step()
        assert out.iteration.num_decode_tokens == batch and out.iteration.num_prefill_tokens == 0

    t_engine, t_dense = [], {False: [], True: []}
    engine_step()                                           # warm-up
    for fold in denses:
        denses[fold].forward(next_ids, context)
    for s in range(steps):
        t_engine.append(_timed(engine_step))
        for fold, dense in denses.items():
            pos = context + s
            t_dense[fold].append(_timed(lambda: dense.forward(next_ids, pos).argmax(-1)))
    # the faster of the two straightforward GQA formulations is the baseline
    fold = min(t_dense, key=lambda f: statistics.median(t_dense[f]))
    flops = step_flops(cfg, batch, batch, batch * (context + steps // 2))
    name = "dense SDPA q_len=1, " + ("GQA group folded into queries" if fold else "enable_gqa")
    return _result(f"decode b{batch} ctx{context}", batch, flops, t_engine, t_dense[fold], name)


def _result(phase: str, tokens: int, flops: float, t_engine: list[float], t_dense: list[float], baseline: str) -> dict:
    e, d = statistics.median(t_engine), statistics.median(t_dense)
    return dict(phase=phase, tokens=tokens, flops=flops, engine_s=e, dense_s=d, baseline=baseline,
                engine_spread=(min(t_engine), max(t_engine)), dense_spread=(min(t_dense), max(t_dense)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "mid"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="prefill repetitions (median reported)")
    ap.add_argument("--decode-steps", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    peak = matmul_gflops()
    print(f"fp32 torch.mm 2048^3: {peak:.1f} GFLOP/s\n")
    head = (f"{'model':6} {'phase':20} {'engine ms':>10} {'dense ms':>9} {'engine tok/s':>12} {'dense tok/s':>11} "
            f"{'ratio':>6} {'best':>6} {'target':>6} {'GFLOP/s':>8} {'of mm':>6}")
    rows = []
    for name in args.presets:
        cfg = load_model_preset(name)
        params = linear_params(cfg) + 2 * cfg.vocab_size * cfg.hidden_size
        print(f"{name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, GQA {cfg.num_heads}:{cfg.num_kv_heads}, "
              f"{params / 1e6:.1f}M params")
        rows.append((name, bench_prefill(cfg, args.prompt_len, args.reps), 0.85))
        rows.append((name, bench_decode(cfg, args.batch, args.context, args.decode_steps), 0.70))
    print("\n" + head)
    for name, r, target in rows:
        ratio = r["dense_s"] / r["engine_s"]      # engine throughput as a fraction of dense (medians)
        best = r["dense_spread"][0] / r["engine_spread"][0]   # the same from the fastest repetitions
        gflops = r["flops"] / r["engine_s"] / 1e9
        print(f"{name:6} {r['phase']:20} {r['engine_s'] * 1e3:10.1f} {r['dense_s'] * 1e3:9.1f} "
              f"{r['tokens'] / r['engine_s']:12.0f} {r['tokens'] / r['dense_s']:11.0f} {ratio:6.0%} {best:6.0%} "
              f"{target:6.0%} {gflops:8.1f} {gflops / peak:6.0%}" + ("" if ratio >= target else "  MISSED"))
    print("\nbaselines: " + "; ".join(sorted({f"{r['phase'].split()[0]}: {r['baseline']}" for _, r, _ in rows})))
    print("spreads (min-max ms): " + "; ".join(
        f"{n} {r['phase']}: engine {r['engine_spread'][0] * 1e3:.0f}-{r['engine_spread'][1] * 1e3:.0f}, "
        f"dense {r['dense_spread'][0] * 1e3:.0f}-{r['dense_spread'][1] * 1e3:.0f}" for n, r, _ in rows))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
