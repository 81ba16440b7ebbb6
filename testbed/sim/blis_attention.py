"""The attention kernels vLLM V1 runs on an H100 (attention_kernel
"fa3_flashinfer": FlashAttention-3 for prefills, FlashInfer for decodes),
their efficiency model (attention_kernels.AttentionKernel) fitted at first use
to the blis-h100 dataset's measured tables and cached in the data directory,
keyed by the dataset's checksum and this code's version:

- prefill, kernels/mha/prefill/h100/H-K-D.csv (BF16, one causal sequence of
  1K-32K tokens): mfu = peak_fraction · (L / (L + h))², q_half = ctx_half = h,
  fitted in log space over every shape;
- decode, kernels/mha/decode/h100/H-K-D-tpN.csv (BF16 KV, batch 1-512 x
  KV 256-128K): one call per layer takes decode_floor_us plus its KV bytes at
  decode_bw_fraction of HBM bandwidth; single_seq_bw_fraction from the
  batch-1 rows past the floor.

The tables are H100 measurements; the kernel carries to H200 at the same
fractions of its peaks (as the other kernels do) and has none for A100."""
from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from testbed.sim.attention_kernels import AttentionKernel

NAME = "fa3_flashinfer"
DATASET = "blis-h100"
H100_PEAK_FLOPS, H100_HBM_BYTES_PER_S = 989.4e12, 3350e9
_DTYPE_BYTES = 2


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _shape(path: Path) -> tuple[int, int, int, int]:
    """(query heads, KV heads, head dim, TP) of a table's file name, heads per GPU."""
    parts = path.stem.split("-")
    tp = int(parts[3].removeprefix("tp")) if len(parts) > 3 else 1
    heads, kv_heads, dim = (int(p) for p in parts[:3])
    return heads // tp, max(1, kv_heads // tp), dim, tp


def fit_prefill(tables: list[Path]) -> tuple[float, float]:
    """(peak_fraction, h) of mfu = peak_fraction · (L / (L + h))²."""
    lengths, mfus = [], []
    for path in tables:
        heads, _, dim, _ = _shape(path)
        for r in _rows(path):
            L, seconds = float(r["seq_len"]), float(r["latency_us"]) * 1e-6
            flops = 2 * heads * 2 * dim * L * (L + 1) / 2            # causal QK and PV
            lengths.append(L)
            mfus.append(flops / seconds / H100_PEAK_FLOPS)
    lengths, mfus = np.array(lengths), np.array(mfus)
    best = None
    for h in np.geomspace(64, 16384, 400):
        shape = (lengths / (lengths + h)) ** 2
        pf = float(np.exp(np.mean(np.log(mfus / shape))))
        err = float(np.sum(np.log(pf * shape / mfus) ** 2))
        if best is None or err < best[0]:
            best = (err, pf, float(h))
    return best[1], best[2]


def fit_decode(tables: list[Path]) -> tuple[float, float, float]:
    """(decode_floor_us, decode_bw_fraction, single_seq_bw_fraction)."""
    x, y, single = [], [], []
    for path in tables:
        _, kv_heads, dim, _ = _shape(path)
        for r in _rows(path):
            nbytes = int(r["batch_size"]) * int(r["kv_len"]) * kv_heads * dim * 2 * _DTYPE_BYTES
            seconds = float(r["latency_us"]) * 1e-6
            x.append(nbytes)
            y.append(seconds)
            if int(r["batch_size"]) == 1:
                single.append((nbytes, seconds))
    x, y = np.array(x, dtype=np.float64), np.array(y)
    # least squares weighted to relative error: y ≈ floor + x / bw
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    (floor, s_per_byte), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    floor = max(0.0, float(floor))
    long_single = [(b, s) for b, s in single if s > 4 * floor]
    single_fraction = float(np.median([b / ((s - floor) * H100_HBM_BYTES_PER_S) for b, s in long_single]))
    return floor * 1e6, 1.0 / (float(s_per_byte) * H100_HBM_BYTES_PER_S), single_fraction


def fit_kernel(root: Path) -> AttentionKernel:
    prefill = sorted((root / "kernels" / "mha" / "prefill" / "h100").glob("*.csv"))
    decode = sorted((root / "kernels" / "mha" / "decode" / "h100").glob("*.csv"))
    if not prefill or not decode:
        raise ValueError(f"{root}/kernels/mha: no attention tables; reinstall the {DATASET} dataset")
    pf, h = fit_prefill(prefill)
    floor_us, decode_bw, single_bw = fit_decode(decode)
    return AttentionKernel(NAME, {"h100": pf}, q_half=h, ctx_half=h, decode_bw_fraction=decode_bw,
                           single_seq_bw_fraction=single_bw, decode_floor_us=floor_us)


def fitted_kernel(dataset: str = DATASET) -> AttentionKernel:
    """The kernel fitted to `dataset`'s tables, made once and cached in the
    data directory (testbed.data.derived) until the dataset or this code changes."""
    from testbed.data.derived import code_version, derived_dir

    def make(src: Path, dest: Path) -> None:
        (dest / "kernel.json").write_text(json.dumps(asdict(fit_kernel(src))))

    cache = derived_dir(dataset, NAME, code_version(Path(__file__)), make,
                        needed_by=f"attention_kernel={NAME} (engine=vllm-v1's attention)")
    return AttentionKernel(**json.loads((cache / "kernel.json").read_text()))
