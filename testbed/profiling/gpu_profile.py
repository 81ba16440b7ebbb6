"""`testbed profile --device cuda`: measure the GPU this runs on with the real
engine and write two presets in the CPU profile's format (profile.py), so
that the simulator prices this engine on this chip:

- a hardware preset (the chip): the GEMM seconds of every GEMM shape of a
  model preset at several token counts (CUDA time, weights rotated so that
  none stays in L2) -> gemm_profile; an 8192^3 bf16 matmul ->
  matmul_tflops_measured; a copy's bandwidth against the datasheet's ->
  memory_efficiency; the memory -> memory_gib. Peaks and the attention
  kernel model come from the stated preset of the same chip (--base);
- an engine preset (`name: testbed`, this project's engine with CUDA graphs):
  one eager kernel launch's host time -> kernel_launch_us, and the engine's
  step times (decode batches replayed as graphs, prefill chunks eager)
  against the kernels the hardware preset prices -> overhead_ms +
  overhead_per_seq_ms * seqs + overhead_per_token_ms * tokens, fitted >= 0.

The engine preset is profiled for the hardware preset (`profiled_for`), so
`engine=auto` picks it on that hardware. On the CPU (--device cpu, tests) the same code runs on a tiny model: its
files have the right fields, its numbers mean nothing."""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

from testbed.batch import Batch, ScheduledSlice
from testbed.experiments.prefill import RealBench
from testbed.model.config import load_model_preset
from testbed.sim.config import HardwareConfig, load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.engine_config import EngineConfig
from testbed.sim.engine_overhead import VLLM_CUDA_GRAPH_SIZES
from testbed.sim.layer_shapes import layer_shapes

# stated presets by the name CUDA reports
_BASE_PRESETS = {"H200": "h200", "H100": "h100-sxm", "A100": "a100-80gb-sxm"}
_L2_EVICT_BYTES = 256 << 20           # weights cycled per GEMM shape: more than any L2
_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
_QUICK_TOKENS = [1, 16, 128]


def base_preset(device_name: str) -> str:
    for key, preset in _BASE_PRESETS.items():
        if key in device_name:
            return preset
    raise ValueError(f"--base: no stated preset for the GPU '{device_name}'; name the closest conf/hardware "
                     "preset with --base")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], device: torch.device, min_time_s: float) -> float:
    """Mean seconds per call over enough calls queued back to back to last min_time_s."""
    fn()
    _sync(device)
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time_s:
            return elapsed / calls
        calls = max(calls * 2, int(calls * min_time_s / max(elapsed, 1e-9)) + 1)


def measure_gemms(model, tokens: list[int], device: torch.device, min_time_s: float) -> list[list[float]]:
    """Rows [m, n, k, seconds] of every GEMM shape of the model (lm_head included)."""
    dtype = getattr(torch, model.dtype)
    shapes = layer_shapes(model)
    rows = []
    for n, k in sorted({(g.n, g.k) for g in (*shapes.gemms, shapes.lm_head)}):
        copies = max(1, math.ceil(_L2_EVICT_BYTES / (n * k * shapes.dtype_bytes))) if device.type == "cuda" else 1
        weights = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies)]
        cycle = itertools.cycle(weights)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=dtype)
            rows.append([float(m), float(n), float(k),
                         float(f"{seconds_per_call(lambda: x @ next(cycle).T, device, min_time_s):.4g}")])
        del weights
    return rows


def matmul_tflops(device: torch.device, size: int, min_time_s: float) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    return 2 * size ** 3 / seconds_per_call(lambda: a @ b, device, min_time_s) / 1e12


def copy_gbps(device: torch.device, nbytes: int, min_time_s: float) -> float:
    """Read plus written bytes per second, GB/s."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call(lambda: dst.copy_(src), device, min_time_s) / 1e9


def launch_us(device: torch.device, calls: int = 5000) -> float:
    """Host time to issue one small eager kernel (the GPU keeps up: the host sets the pace)."""
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        x.add_(1)
    elapsed = time.perf_counter() - t0
    _sync(device)
    return elapsed / calls * 1e6


def fit_nonnegative(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best of the fits on each subset of the columns."""
    best, best_err = np.zeros(features.shape[1]), float(np.sum(target ** 2))
    for r in range(1, features.shape[1] + 1):
        for cols in itertools.combinations(range(features.shape[1]), r):
            coef, *_ = np.linalg.lstsq(features[:, cols], target, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((features[:, cols] @ coef - target) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(features.shape[1])
                best[list(cols)] = coef
    return best


def engine_steps(quick: bool) -> list[tuple[int, int, int]]:
    """(decodes, decode context, prefill chunk) of the steps the overhead is fitted to."""
    if quick:
        return [(1, 64, 0), (4, 64, 0), (0, 0, 64)]
    return [(b, 1024, 0) for b in (1, 8, 32, 64, 128)] + [(0, 0, 512), (0, 0, 2048), (32, 1024, 512)]


def fit_engine(bench: RealBench, cost: CostModel, steps: list[tuple[int, int, int]], repeats: int,
               log) -> tuple[np.ndarray, list[tuple]]:
    """(overhead_ms, per_seq_ms, per_token_ms) >= 0 fitted to wall - priced kernels, and each step's row."""
    rows = []
    for decodes, ctx, chunk in steps:
        slices = bench.decodes(decodes, ctx) if decodes else []
        if chunk:
            slices.append(ScheduledSlice(bench.request(chunk, 0), chunk))
        batch = Batch(slices)
        for _ in range(3):
            bench.executor.execute(batch)                          # warm-up: compiles, picks cuBLAS algorithms
        wall = float(np.median([bench.executor.execute(batch).duration_s for _ in range(repeats)]))
        priced = cost.iteration_time_s([(s.num_tokens, s.end) for s in slices])
        rows.append((len(slices), batch.num_prefill_tokens + batch.num_decode_tokens, wall, priced))
        for s in slices:
            bench.bm.free(s.request.request_id)
    features = np.array([[1.0, seqs, tokens] for seqs, tokens, _, _ in rows])
    target = np.array([(wall - priced) * 1e3 for _, _, wall, priced in rows])
    coef = fit_nonnegative(features, target)
    for (seqs, tokens, wall, priced), f in zip(rows, features):
        model_ms = priced * 1e3 + float(f @ coef)
        log(f"  step of {seqs:3d} seqs, {tokens:5d} tokens: engine {wall * 1e3:8.3f} ms, kernels priced "
            f"{priced * 1e3:8.3f} ms, with the fitted overhead {model_ms:8.3f} ms ({model_ms / (wall * 1e3) - 1:+.0%})")
    return coef, rows


def _write(path: Path, header: str, values: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(values, sort_keys=False, default_flow_style=None, width=120))


def profile_gpu(hardware_out: str | Path, engine_out: str | Path, model_name: str = "llama3-8b",
                device: str = "cuda", base: str | None = None, name: str | None = None, quick: bool = False,
                sizes: list[int] | None = None, attention_backend: str = "triton",
                log=lambda _: None) -> tuple[HardwareConfig, EngineConfig]:
    """Measure, write both presets and return them."""
    dev = torch.device(device)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    base = base or base_preset(device_name)
    name = name or Path(hardware_out).stem
    sizes = sorted(set(VLLM_CUDA_GRAPH_SIZES if sizes is None else sizes))
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    model = load_model_preset(model_name, dtype=dtype)
    min_time_s = 0.005 if quick else 0.05
    stated = load_hardware_preset(base)
    t0 = time.perf_counter()
    gemm_rows = measure_gemms(model, _QUICK_TOKENS if quick else _TOKENS, dev, min_time_s)
    matmul = matmul_tflops(dev, 512 if quick else 8192, min_time_s * 4)
    copy = copy_gbps(dev, (16 << 20) if quick else (1 << 30), min_time_s * 4)
    launch = launch_us(dev, 500 if quick else 5000)
    memory = (torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda" else stated.memory_gib)
    log(f"{device_name}: {len(gemm_rows)} GEMM rows, matmul {matmul:.1f} TFLOP/s, copy {copy:.0f} GB/s, "
        f"launch {launch:.2f} us ({time.perf_counter() - t0:.0f} s)")
    values = {f.name: getattr(stated, f.name) for f in dataclasses.fields(HardwareConfig)}
    values.update(
        name=name, gemm_table="", gemm_profile=gemm_rows, matmul_tflops_measured=round(matmul, 1),
        memory_gib=round(memory, 1), memory_efficiency=float(f"{min(1.0, copy / stated.hbm_bw_gbps):.3g}"),
        profiled_for=name,
        provenance=(f"Measured by testbed profile --device {device} on {device_name} ({time.strftime('%Y-%m-%d')}): "
                    f"GEMM table of {model.name} ({dtype}), matmul, copy bandwidth, memory. Peaks, attention "
                    f"kernel model and the rest: the stated preset {base} ({stated.provenance})"))
    hardware = HardwareConfig(**values)

    steps = engine_steps(quick)
    capacity = max(d * (c + 16) + chunk for d, c, chunk in steps) + 64
    bench = RealBench(model_name, capacity, 16, 0, dtype, device, attention_backend,
                      cuda_graph_sizes=sorted({d for d, _, chunk in steps if d and not chunk}))
    kernels_only = EngineConfig(name="kernels")
    coef, rows = fit_engine(bench, CostModel(bench.model_cfg, hardware, engine=kernels_only), steps,
                            3 if quick else 10, log)
    measured = f"measured by testbed profile --device {device} on {device_name} ({time.strftime('%Y-%m-%d')})"
    engine = EngineConfig(
        name="testbed", host_model="linear", overhead_ms=round(float(coef[0]), 4),
        overhead_per_seq_ms=round(float(coef[1]), 5), overhead_per_token_ms=round(float(coef[2]), 6),
        kernel_launch_us=round(launch, 3), cuda_graphs=True, cuda_graph_sizes=sizes, profiled_for=name,
        provenance={"host_model": f"{measured}: fitted (>= 0) to {len(rows)} real-engine steps of {model.name} "
                                  f"({attention_backend}, decode batches replayed as CUDA graphs, prefill chunks "
                                  f"eager) minus the kernels the hardware preset {name} prices",
                    "kernel_launch_us": f"{measured}: the host time of one small eager launch",
                    "cuda_graphs": "decode-only steps replay graphs captured at cuda_graph_sizes (testbed/model/"
                                   "cuda_graphs.py); mixed and prefill steps run eagerly"})
    when = time.strftime('%Y-%m-%d %H:%M')
    _write(Path(hardware_out), f"# Measured on {device_name} by testbed.profiling.gpu_profile ({when}).\n"
           f"# gemm_profile rows [m, n, k, seconds] of {model.name}'s GEMMs ({dtype}) on the device, weights not in L2;\n"
           f"# memory_efficiency: a {copy:.0f} GB/s copy (read plus written) over the datasheet's "
           f"{stated.hbm_bw_gbps:.0f}.\n# The engine's terms are in the engine preset written beside it.\n", values)
    _write(Path(engine_out), f"# This project's engine with CUDA graphs on {device_name}, measured by "
           f"testbed.profiling.gpu_profile ({when}).\n# per step: overhead_ms + overhead_per_seq_ms * num_seqs + "
           "overhead_per_token_ms * num_tokens beside the kernels;\n# rows it was fitted to (seqs, tokens, engine ms, "
           "kernels priced ms):\n" + "".join(f"#   {s}, {t}, {w * 1e3:.3f}, {p * 1e3:.3f}\n" for s, t, w, p in rows),
           dataclasses.asdict(engine))
    return hardware, engine
