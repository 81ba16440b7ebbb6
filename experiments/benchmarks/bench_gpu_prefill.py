"""Whole vs chunked prefill on the real engine path: the chunk re-read tax
(experiments/README.md, "crossover") measured on one GPU with llama3-8b's architecture in bf16 and
random weights.

For each attention backend, prompt length L and chunk size C (0 = the whole
prompt in one step) one request is prefilled through ModelExecutor.execute,
one Batch per chunk, exactly as the sarathi scheduler would slice it alone on
the GPU; the last chunk samples the first token. Reported: the summed step
times (TTFT without queueing), the slowdown against the whole prompt, and the
KV bytes attention read (the re-read accounting the executor reports).

    python experiments/benchmarks/bench_gpu_prefill.py --out DIR [--budget-s 170]
    python experiments/benchmarks/bench_gpu_prefill.py --out DIR --device cpu --model tiny --prompts 256,512 \
        --chunks 0,128 --backends torch                                     # smoke check here

writes DIR/prefill.csv, one row after each measurement so that a timeout
keeps what ran. Prompts run shortest first; a measurement predicted to
overrun the budget (from the last one at the same chunk, scaled by L^2) is
written as skipped instead of run."""
from __future__ import annotations

import argparse
import csv
import random
import sys
import time
from pathlib import Path

import torch

from testbed.batch import Batch, ScheduledSlice
from testbed.kernels.attention import get_attention_backend
from testbed.model.config import load_model_preset
from testbed.model_executor import ModelExecutor
from testbed.request import Request

FIELDS = ["model", "backend", "prompt_len", "chunk", "num_steps", "ttft_s", "slowdown_vs_whole",
          "mean_step_ms", "kv_read_GB", "prefill_tok_per_s", "first_token", "status"]


def prefill(executor: ModelExecutor, tables: dict[str, list[int]], prompt_len: int, chunk: int,
            rid: str) -> dict:
    prompt = random.Random(prompt_len).choices(range(executor.model_cfg.vocab_size), k=prompt_len)
    req = Request(rid, prompt, max_tokens=1)
    blocks = -(-prompt_len // executor.block_size)
    tables[rid] = random.Random(7).sample(range(executor.kv_cache.shape[2]), blocks)   # fragmented, as after a while
    step = chunk or prompt_len
    durations, kv_read, token = [], 0, None
    while req.num_computed_tokens < prompt_len:
        n = min(step, prompt_len - req.num_computed_tokens)
        result = executor.execute(Batch([ScheduledSlice(req, n)]))
        durations.append(result.duration_s)
        kv_read += result.kv_bytes_read
        req.num_computed_tokens += n
        token = result.sampled.get(rid, token)
    del tables[rid]
    total = sum(durations)
    return {"num_steps": len(durations), "ttft_s": round(total, 4), "mean_step_ms": round(1e3 * total / len(durations), 2),
            "kv_read_GB": round(kv_read / 1e9, 2), "prefill_tok_per_s": round(prompt_len / total),
            "first_token": token, "status": "ok"}


def parse_backends(spec: str) -> list[tuple[str, int]]:
    """'triton,torch:32768' -> [('triton', huge), ('torch', 32768)]: a cap on the prompt length per backend."""
    out = []
    for item in filter(None, spec.split(",")):
        name, _, cap = item.partition(":")
        out.append((name, int(cap) if cap else 1 << 40))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--prompts", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--chunks", default="0,2048,512", help="0 is the whole prompt in one step")
    ap.add_argument("--backends", default="triton,flash_attn,torch:32768",
                    help="NAME[:MAX_PROMPT],...; backends that cannot load (flash_attn missing) are skipped")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=170.0, help="measurement time, model build excluded")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_gpu_prefill: --device cuda needs a CUDA GPU (use --device cpu --model tiny for a smoke check)")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = sorted(int(x) for x in args.prompts.split(","))
    chunks = [int(x) for x in args.chunks.split(",")]

    cfg = load_model_preset(args.model, dtype="bfloat16" if args.device.startswith("cuda") else "float32")
    num_blocks = -(-max(prompts) // args.block_size) + 16
    tables: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    executor = ModelExecutor(cfg, num_blocks, args.block_size, tables.__getitem__, "torch", args.device)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{cfg.name}: built on {where} in {time.perf_counter() - t0:.1f}s; KV cache "
          f"{executor.kv_cache.numel() * executor.kv_cache.element_size() / 2**30:.1f} GiB "
          f"({num_blocks} blocks of {args.block_size})", flush=True)

    rows: list[dict] = []
    out_csv = args.out / "prefill.csv"

    def write() -> None:
        with out_csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)

    start = time.perf_counter()
    for backend_name, cap in parse_backends(args.backends):
        try:
            executor.backend = get_attention_backend(backend_name)
        except ValueError as e:
            print(f"skip {backend_name}: {e}", flush=True)
            continue
        for c in chunks:                                   # compile kernels / pick cuBLAS algorithms off the clock
            prefill(executor, tables, min(4096, prompts[0]), c, "warmup")
        last: dict[int, tuple[int, float]] = {}            # chunk -> (prompt_len, seconds) of the last run
        whole: dict[int, float] = {}
        for L in prompts:
            for c in chunks:
                row = {"model": cfg.name, "backend": backend_name, "prompt_len": L, "chunk": c}
                predicted = last[c][1] * (L / last[c][0]) ** 2 if c in last else 0.0
                elapsed = time.perf_counter() - start
                if L > cap:
                    row["status"] = f"skipped: over this backend's cap {cap}"
                elif c >= L:
                    row["status"] = "skipped: chunk >= prompt"
                elif elapsed + predicted > args.budget_s:
                    row["status"] = f"skipped: predicted {predicted:.0f}s, {args.budget_s - elapsed:.0f}s of budget left"
                else:
                    try:
                        row.update(prefill(executor, tables, L, c, f"{backend_name}-{L}-{c}"))
                    except torch.cuda.OutOfMemoryError as e:
                        row["status"] = f"out of memory: {str(e)[:120]}"
                        tables.clear()
                        torch.cuda.empty_cache()
                if row.get("status") == "ok":
                    last[c] = (L, row["ttft_s"])
                    if c == 0:
                        whole[L] = row["ttft_s"]
                    if L in whole:
                        row["slowdown_vs_whole"] = round(row["ttft_s"] / whole[L], 3)
                rows.append(row)
                print("  ".join(f"{k}={row.get(k, '')}" for k in FIELDS), flush=True)
                write()
    write()


if __name__ == "__main__":
    main()
