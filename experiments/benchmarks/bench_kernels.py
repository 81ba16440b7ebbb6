"""Attention kernels on one GPU: the Triton paged kernel against PyTorch SDPA
and flash-attn (when installed) on the shapes the crossover study meets, and
the Triton KV gather/scatter against torch indexing.

Figures: TFLOP/s for prefill chunks (causal pairs only), GB/s of KV read for
decodes, each also as a fraction of this GPU's measured peak (a large
device-to-device copy; an 8192^3 bf16 matmul). The baselines read contiguous
K/V (their best case); the Triton kernel reads the paged cache through shuffled
16-token block tables, as the engine does.

    python experiments/benchmarks/bench_kernels.py --out DIR [--sweep]

writes DIR/kernels.csv (one row per case and implementation, the measured
peaks first), DIR/targets.csv (the issue's two targets, pass/fail) and with
--sweep DIR/tile_sweep.csv (launch shapes tried on the two target cases)."""
from __future__ import annotations

import argparse
import csv
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from testbed.kernels import kv_ops
from testbed.kernels.attention import AttentionMetadata
from testbed.kernels.triton_attention import TileConfig, paged_attention, plan_attention
from testbed.kernels.triton_kv import gather_blocks, scatter_blocks

try:
    from flash_attn import flash_attn_func, flash_attn_with_kvcache
except ImportError:          # optional: the baselines it provides are skipped
    flash_attn_func = flash_attn_with_kvcache = None

try:
    from torch.nn.attention.bias import causal_lower_right
except ImportError:
    causal_lower_right = None

# llama3-8b attention: 32 query heads over 8 KV heads of 128, bf16, 16-token blocks
HQ, HKV, D, BLOCK, DTYPE = 32, 8, 128, 16, torch.bfloat16


@dataclass
class Case:
    name: str
    q_lens: list[int]
    seq_lens: list[int]

    @property
    def is_decode(self) -> bool:
        return max(self.q_lens) == 1

    def flops(self) -> float:
        """QK^T and PV over the causal (bottom-right) pairs only."""
        pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(self.q_lens, self.seq_lens))
        return 4.0 * D * HQ * pairs

    def kv_bytes(self) -> float:
        return 2.0 * sum(self.seq_lens) * HKV * D * torch.finfo(DTYPE).bits / 8


CASES = [
    Case("decode_64x4k", [1] * 64, [4096] * 64),                 # target: >= 70% of copy bandwidth
    Case("decode_256x1k", [1] * 256, [1024] * 256),
    Case("decode_8x32k", [1] * 8, [32768] * 8),
    Case("decode_1x128k", [1], [131072]),
    Case("chunk_512_over_32k", [512], [32768 + 512]),            # target: >= 60% of flash-attn / SDPA
    Case("chunk_2048_over_32k", [2048], [32768 + 2048]),
    Case("chunk_512_over_4k", [512], [4096 + 512]),
    Case("prefill_whole_8k", [8192], [8192]),
    Case("mixed_sarathi", [1] * 32 + [480], [4096] * 32 + [16384]),   # 32 decodes + a chunk in one launch
]


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_peaks(dev) -> dict[str, float]:
    n = 1 << 30                                                      # 2 GiB of bf16
    src, dst = torch.randn(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16)
    copy_ms = median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b)
    return {"copy_GBps": 2 * n * 2 / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


def paged_inputs(case: Case, dev, seed=0):
    """q [T, HQ, D]; engine-shaped caches with each sequence in shuffled blocks."""
    rng = random.Random(seed)
    need = [-(-s // BLOCK) for s in case.seq_lens]
    ids = list(range(sum(need)))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    qsl = [0]
    for q in case.q_lens:
        qsl.append(qsl[-1] + q)
    cache = torch.randn(2, sum(need), BLOCK, HKV, D, device=dev, dtype=DTYPE)
    q = torch.randn(qsl[-1], HQ, D, device=dev, dtype=DTYPE)
    meta = AttentionMetadata(qsl, case.seq_lens, tables, torch.zeros(0, dtype=torch.long), BLOCK)
    return q, cache[0], cache[1], meta


def contiguous_kv(case: Case, dev):
    """Baseline inputs: each sequence's K/V already contiguous ([B, S, HKV, D]; equal lengths only)."""
    b, s = len(case.seq_lens), max(case.seq_lens)
    k = torch.randn(b, s, HKV, D, device=dev, dtype=DTYPE)
    return k, torch.randn_like(k)


def baselines(case: Case, dev) -> dict[str, callable]:
    """name -> zero-argument callable, for the cases a baseline can express in one call."""
    out = {}
    if len(set(case.seq_lens)) != 1 or len(set(case.q_lens)) != 1:
        return out                                  # mixed batch: only the paged kernel does it in one call
    k, v = contiguous_kv(case, dev)
    b, qn, s = len(case.seq_lens), case.q_lens[0], case.seq_lens[0]
    q = torch.randn(b, qn, HQ, D, device=dev, dtype=DTYPE)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)           # [B, H, S, D]
    if qn == 1:
        out["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    elif qn == s:
        out["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    elif causal_lower_right is not None:
        # the mask object, not a tensor, keeps SDPA on its flash / efficient kernels
        bias = causal_lower_right(qn, s)
        try:
            F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, enable_gqa=True)
            out["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, enable_gqa=True)
        except (RuntimeError, TypeError):     # no GQA with this mask here: expand K/V heads (same FLOPs)
            kx, vx = kt.repeat_interleave(HQ // HKV, 1), vt.repeat_interleave(HQ // HKV, 1)
            out["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kx, vx, attn_mask=bias)
    if flash_attn_func is not None:
        if qn == 1:
            lens = torch.full((b,), s, dtype=torch.int32, device=dev)
            out["flash_attn"] = lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)
        else:
            out["flash_attn"] = lambda: flash_attn_func(q, k, v, causal=True)        # bottom-right causal
    return out


def run_case(case: Case, dev, peaks, tile: TileConfig | None = None, with_baselines: bool = True) -> list[dict]:
    q, kc, vc, meta = paged_inputs(case, dev)
    plan = plan_attention(meta, HQ, HKV, dev, tile)
    impls = {"triton_paged": lambda: paged_attention(q, kc, vc, plan, D ** -0.5)}
    if with_baselines:
        impls.update(baselines(case, dev))
    rows = []
    for name, fn in impls.items():
        try:
            ms = median_ms(fn)
        except Exception as e:          # a baseline that refuses a shape is a row with the reason
            rows.append({"case": case.name, "impl": name, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        tflops = case.flops() / ms / 1e9
        gbps = case.kv_bytes() / ms / 1e6
        rows.append({"case": case.name, "impl": name, "ms": round(ms, 4), "TFLOPs": round(tflops, 1),
                     "KV_GBps": round(gbps, 1),
                     "frac_peak": round(gbps / peaks["copy_GBps"] if case.is_decode
                                        else tflops / peaks["bf16_matmul_TFLOPs"], 3),
                     "tile": f"{plan.tile.block_m}x{plan.tile.block_n}w{plan.tile.num_warps}s{plan.tile.num_stages}"
                             f"k{plan.num_splits}" if name == "triton_paged" else ""})
        print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    return rows


def check_correct(dev) -> None:
    """One mixed case against the torch reference before any timing."""
    from testbed.kernels.reference import ref_paged_attention
    case = Case("check", [1, 300, 1], [5000, 2300, 77])
    q, kc, vc, meta = paged_inputs(case, dev, seed=1)
    out = paged_attention(q, kc, vc, plan_attention(meta, HQ, HKV, dev), D ** -0.5)
    ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), meta.query_start_loc, meta.seq_lens,
                              meta.block_tables, D ** -0.5)
    err = ((out.cpu().float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"check: relative error vs reference {err:.2e}")
    if not err < 1e-2:
        sys.exit(f"Triton kernel disagrees with the reference (relative error {err:.2e}); not timing it")


def bench_kv_copy(dev, peaks) -> list[dict]:
    """A 32K-token request's blocks over all 32 layers (4 GiB at llama3-8b): gather and scatter."""
    layers, tokens = 32, 32768
    nb = tokens // BLOCK
    cache = torch.randn(layers, 2, 2 * nb, BLOCK, HKV, D, device=dev, dtype=DTYPE)
    ids = torch.randperm(2 * nb, device=dev)[:nb]
    buf = torch.empty(layers, 2, nb, BLOCK, HKV, D, device=dev, dtype=DTYPE)
    nbytes = 2 * buf.numel() * buf.element_size()                     # read + write
    rows = []
    for name, fn in [("triton_gather", lambda: gather_blocks(cache, ids, dim=2, out=buf)),
                     ("torch_gather", lambda: kv_ops.gather_blocks(cache, ids, dim=2, out=buf)),
                     ("triton_scatter", lambda: scatter_blocks(cache, ids, buf, dim=2)),
                     ("torch_scatter", lambda: kv_ops.scatter_blocks(cache, ids, buf, dim=2))]:
        ms = median_ms(fn)
        gbps = nbytes / ms / 1e6
        rows.append({"case": "kv_copy_32k_tokens_32_layers", "impl": name, "ms": round(ms, 4),
                     "KV_GBps": round(gbps, 1), "frac_peak": round(gbps / peaks["copy_GBps"], 3)})
        print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    return rows


SWEEP = {
    "decode_64x4k": [TileConfig(16, n, w, s, k) for n, w, s, k in
                     [(32, 4, 3, 1), (64, 4, 2, 1), (64, 4, 4, 1), (64, 8, 3, 1), (128, 4, 2, 1), (64, 4, 3, 2)]],
    "decode_8x32k": [TileConfig(16, 64, 4, 3, k) for k in (1, 2, 4, 8, 16)],
    "chunk_512_over_32k": [TileConfig(m, n, w, s) for m, n, w, s in
                           [(64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2),
                            (128, 128, 8, 2), (128, 128, 8, 3)]],
}


def write_csv(path: Path, rows: list[dict]) -> None:
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sweep", action="store_true", help="also try launch shapes on the two target cases")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"flash_attn {'yes' if flash_attn_func else 'no'}")
    check_correct(dev)
    peaks = measure_peaks(dev)
    print(f"peaks: copy {peaks['copy_GBps']:.0f} GB/s, bf16 matmul {peaks['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    wanted = set(filter(None, args.cases.split(",")))
    rows: list[dict] = [{"case": "peak", "impl": "device_copy_2GiB", "KV_GBps": round(peaks["copy_GBps"], 1)},
                        {"case": "peak", "impl": "bf16_matmul_8192", "TFLOPs": round(peaks["bf16_matmul_TFLOPs"], 1)}]
    for case in CASES:
        if not wanted or case.name in wanted:
            try:
                rows += run_case(case, dev, peaks)
            except Exception as e:        # one failing case (out of memory, say) must not lose the others
                rows.append({"case": case.name, "impl": "triton_paged", "error": f"{type(e).__name__}: {e}"[:200]})
                print(rows[-1], flush=True)
            torch.cuda.empty_cache()                            # each case's tensors died with run_case
            write_csv(args.out / "kernels.csv", rows)          # after each case: a timeout keeps what ran
    rows += bench_kv_copy(dev, peaks)
    write_csv(args.out / "kernels.csv", rows)

    def get(case, impl, key):
        return next((r.get(key) for r in rows if r["case"] == case and r["impl"] == impl), None)
    targets = []
    dec = get("decode_64x4k", "triton_paged", "frac_peak")
    if dec is not None:
        targets.append({"target": "decode 64x4K >= 70% of copy bandwidth", "value": dec, "pass": dec >= 0.70})
    tri = get("chunk_512_over_32k", "triton_paged", "TFLOPs")
    base = [v for v in (get("chunk_512_over_32k", "flash_attn", "TFLOPs"), get("chunk_512_over_32k", "sdpa", "TFLOPs"))
            if v]
    if tri and base:
        ratio = tri / max(base)
        targets.append({"target": "chunk 512 over 32K >= 60% of best of flash-attn/SDPA", "value": round(ratio, 3),
                        "pass": ratio >= 0.60})
    for t in targets:
        print(f"TARGET {'PASS' if t['pass'] else 'FAIL'}: {t['target']}: {t['value']}")
    write_csv(args.out / "targets.csv", targets)

    if args.sweep:
        sweep_rows = []
        for case in CASES:
            for tile in SWEEP.get(case.name, []):
                try:
                    sweep_rows += run_case(case, dev, peaks, tile, with_baselines=False)
                    torch.cuda.empty_cache()
                except Exception as e:       # e.g. a shape that needs more shared memory than an SM has
                    sweep_rows.append({"case": case.name, "impl": "triton_paged", "tile": str(tile),
                                       "error": f"{type(e).__name__}: {e}"[:200]})
                write_csv(args.out / "tile_sweep.csv", sweep_rows)


if __name__ == "__main__":
    main()
