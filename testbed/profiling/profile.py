"""`testbed profile`: measure this CPU with the real engine's kernels and write
two presets the cost model reads, the hardware (conf/hardware/) and the
testbed engine on it (conf/engine/, engine_path_for), so that `runtime=sim hardware=cpu`
predicts what `runtime=real` does here.

Measures, with one torch thread per worker as the real engine runs:
- GEMM seconds for every GEMM shape of a model preset at several token
  counts, each nn.Linear timed inside real engine steps (engine_gemms.py:
  alone, on a weight still in cache, a small-m GEMM looks 2-5x faster than in a
  forward pass) -> gemm_profile rows [m, n, k, seconds], interpolated over m
  by the cost model;
- one attention forward of the torch backend over a grid of (query length,
  prefix), of decode batches, of like lengths (one SDPA call) and spread
  (several), and of a few whole prompts together (a call each) ->
  attention_profile rows of timers.ATTENTION_COLUMNS (timers.attention_features
  and the seconds), fitted by the cost model (timers.fit_attention); a chunk
  on a prefix runs with an explicit mask (the whole q x ctx rectangle), a
  whole prompt is_causal (half of it), decodes of unlike lengths padded and
  masked;
- memcpy bandwidth -> hbm_bw_gbps (read plus written bytes), and the best GEMM
  throughput -> peak_tflops, for whatever the tables do not cover;
- the real engine's step times against the model of them (calibration.py) ->
  the engine preset's overhead_ms, overhead_per_seq_ms, overhead_per_token_ms
  and the hardware's calibration_scale, and the spread of
  serving steps in a real run -> step_jitter_ms (jitter.py); the same run ->
  frontend_hop_ms; the frontend routing and sending commands ->
  frontend_message_ms.

`testbed profile [--quick] [--out PATH] [--model NAME]` runs it (profile_main);
`testbed profile --device cuda` measures the GPU instead (gpu_profile.py)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

from testbed.kernels.attention import AttentionMetadata
from testbed.kernels.torch_backend import TorchAttentionBackend
from testbed.model.config import ModelConfig, load_model_preset
from testbed.sim.config import HardwareConfig
from testbed.sim.engine_config import EngineConfig, load_engine_preset
from testbed.profiling.engine_gemms import measure_engine_gemms
from testbed.progress import progress
from testbed.sim.jitter import jitter_quantiles
from testbed.sim.layer_shapes import layer_shapes
from testbed.sim.timers import ATTENTION_COLUMNS, attention_features

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class _Plan:
    token_counts: list[int]
    single_seq: list[tuple[int, int]]      # (q_len, prefix)
    decode_batches: list[tuple[int, int]]  # (num_seqs, ctx)
    spread_decodes: list[tuple[int, int, int]]  # (num_seqs, shortest, longest ctx): several SDPA calls
    prompt_batches: list[tuple[int, int]]       # (num_prompts, tokens each): whole prompts in one forward
    min_time_s: float


_QUICK = _Plan([1, 16, 64, 256, 1024], [(q, p) for q in (1, 64, 512) for p in (0, 512, 2048)],
               [(8, 512), (32, 512)], [(8, 64, 1024)], [(4, 32)], 0.02)
# Every m up to 8 and a fine grid to 32: a CPU GEMM's time is not monotonic in
# small m (MKL's m=4 and m=8 kernels beat m=3 and m=7; decode batches live there)
_FULL = _Plan([1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048, 4096],
              [(q, p) for q in (1, 16, 128, 512, 2048) for p in (0, 512, 2048, 8192)],
              [(4, 256), (16, 256), (64, 256), (4, 2048), (16, 2048), (64, 2048)],
              [(2, 64, 256), (4, 64, 512), (8, 64, 512), (16, 64, 2048), (32, 64, 512), (64, 64, 4096)],
              [(2, 64), (4, 32), (8, 32), (8, 128)], 0.2)


def seconds_per_call(fn: Callable[[], object], min_time_s: float, repeats: int = 3) -> float:
    """Best of `repeats` averages, each over enough calls to last
    min_time_s / repeats (the minimum resists other processes' noise)."""
    fn()
    calls, budget = 1, min_time_s / repeats
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= budget:
            break
        calls = max(calls * 2, int(calls * budget / max(elapsed, 1e-9)) + 1)
    best = elapsed / calls
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def profile_attention(model: ModelConfig, plan: _Plan, block_size: int = 16) -> list[list[float]]:
    dtype = _TORCH_DTYPES[model.dtype]
    shape = layer_shapes(model).attention
    heads, kv_heads, d = model.num_heads, model.num_kv_heads, model.resolved_head_dim
    batches = ([[(q, q + p)] for q, p in plan.single_seq] + [[(1, c)] * b for b, c in plan.decode_batches]
               + [[(1, lo + (hi - lo) * i // (b - 1)) for i in range(b)] for b, lo, hi in plan.spread_decodes]
               + [[(q, q)] * n for n, q in plan.prompt_batches])
    budget_tokens = TorchAttentionBackend.cpu_decode_group_bytes // shape.kv_bytes_per_token
    max_blocks = max(sum(-(-c // block_size) for _, c in batch) for batch in batches)
    k_cache = torch.randn(max_blocks, block_size, kv_heads, d, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    backend, scale = TorchAttentionBackend(), d ** -0.5
    passes = 3

    def forward(batch: list[tuple[int, int]]) -> Callable[[], object]:
        starts, tables, next_block = [0], [], 0
        for q, ctx in batch:
            starts.append(starts[-1] + q)
            nblocks = -(-ctx // block_size)
            tables.append(list(range(next_block, next_block + nblocks)))
            next_block += nblocks
        meta = AttentionMetadata(query_start_loc=starts, seq_lens=[c for _, c in batch], block_tables=tables,
                                 slot_mapping=torch.zeros(starts[-1], dtype=torch.int64), block_size=block_size)
        query = torch.randn(starts[-1], heads, d, dtype=dtype)
        return lambda: backend.forward(query, k_cache, v_cache, meta, scale)

    # the best of passes over the whole grid, not of calls in a row: a row's
    # timings then span the whole measurement, and a slow few seconds on this
    # shared machine cannot make one part of the grid slow against the rest
    calls, secs = [forward(batch) for batch in batches], [float("inf")] * len(batches)
    with progress(total=passes * len(calls), desc="attention shapes", unit="shape") as bar:
        for _ in range(passes):
            for i, fn in enumerate(calls):
                secs[i] = min(secs[i], seconds_per_call(fn, plan.min_time_s / passes, repeats=1))
                bar.update()
    return [[*attention_features(shape, batch, block_size, budget_tokens), s] for batch, s in zip(batches, secs)]


def memcpy_gbps(nbytes: int = 64 << 20, min_time_s: float = 0.1) -> float:
    """Copy bandwidth counting bytes read plus bytes written, GB/s."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call(lambda: dst.copy_(src), min_time_s) / 1e9


def engine_path_for(hardware_path: str | Path, name: str) -> Path:
    """Where a profile's engine preset goes: for a hardware file in a config
    directory's hardware/, its engine/testbed.yaml (the cpu preset) or
    engine/testbed-NAME.yaml; else beside the hardware file as STEM-engine.yaml."""
    path = Path(hardware_path)
    if path.parent.name == "hardware":
        return path.parent.parent / "engine" / ("testbed.yaml" if name == "cpu" else f"testbed-{name}.yaml")
    return path.with_name(f"{path.stem}-engine.yaml")


def profile_cpu(out_path: str | Path, model_name: str = "tiny", quick: bool = False, name: str = "cpu",
                num_threads: int = 1, engine_overhead: bool = True, log=lambda _: None,
                num_workers: int = 1, engine_path: str | Path | None = None) -> HardwareConfig:
    """Measure this machine on the GEMM and attention shapes of `model_name`
    and (engine_overhead) the real engine's per-iteration overhead and frontend
    hop (a short real run), write the hardware YAML to out_path (e.g. conf/hardware/cpu.yaml)
    and the testbed engine's to engine_path (default: engine_path_for), and return the hardware.
    With num_workers > 1, num_workers - 1 busy neighbours (neighbors.py) step
    the same model meanwhile: the tables are then one of num_workers workers'.
    The YAML records num_threads and num_workers (profiled_threads, profiled_workers).
    quick=True takes a few seconds (tests), the full grid a minute or two."""
    from testbed.profiling.neighbors import Neighbors
    model, plan = load_model_preset(model_name), _QUICK if quick else _FULL
    if model.dtype not in _TORCH_DTYPES or model.attention != "gqa":
        raise ValueError(f"model='{model_name}': profile a GQA model in float32/bfloat16/float16 "
                         "that the real engine runs (e.g. tiny, mid)")
    if num_workers < 1:
        raise ValueError(f"--workers: the worker processes stepping at once, >= 1; got {num_workers}")
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with Neighbors(model_name, num_workers - 1, num_threads):
            gemm_rows = measure_engine_gemms(model, plan.token_counts, plan.min_time_s)
            attention_rows = profile_attention(model, plan)
            bandwidth = memcpy_gbps(min_time_s=plan.min_time_s * 5)
            peak = max(2.0 * m * n * k / s for m, n, k, s in gemm_rows) / 1e12
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
            hardware = HardwareConfig(
                name=name, peak_tflops=peak, peak_tflops_fp32=peak, hbm_bw_gbps=bandwidth,
                memory_gib=round(memory, 1), compute_efficiency=1.0, memory_efficiency=1.0, gemm_ramp_tokens=0.0,
                # all floats: Hydra's typed list[list[float]] rejects ints
                gemm_profile=[[float(m), float(n), float(k), float(f"{s:.4g}")] for m, n, k, s in gemm_rows],
                attention_profile=[[*row[:-1], float(f"{row[-1]:.4g}")] for row in attention_rows],
                profiled_for=name, profiled_threads=num_threads, profiled_workers=num_workers)
            engine = EngineConfig(name="", kernel_launch_us=5.0, profiled_for=name)
            overhead_note = (calibrate_overhead(model, hardware, engine, quick, log) if engine_overhead
                             else "not measured (engine_overhead=False)")
    finally:
        torch.set_num_threads(threads)
    header = (f"# Measured on this machine by testbed.profiling.profile.profile_cpu ({time.strftime('%Y-%m-%d %H:%M')}):\n"
              f"# model={model_name} ({model.dtype}), torch threads={num_threads}, quick={quick}, "
              f"workers stepping at once={num_workers}.\n"
              "# peak_tflops: best GEMM throughput seen; hbm_bw_gbps: memcpy, read plus written bytes.\n"
              "# gemm_profile rows [m, n, k, seconds]; attention_profile rows of one torch-backend attention\n"
              f"# forward [{', '.join(ATTENTION_COLUMNS)}].\n"
              "# calibration_scale, with the engine preset's overhead_ms + overhead_per_seq_ms * num_seqs +\n"
              f"# overhead_per_token_ms * num_tokens: {overhead_note}.\n"
              "# step_jitter_ms: quantiles 0%..100% (above 99.9% clipped) of a serving step's time minus the median step of its\n"
              "# shape, in ms (real serving runs spread over the calibration rounds).\n"
              "# frontend_hop_ms: one way, frontend <-> worker process, from the same serving runs;\n"
              "# frontend_message_ms: the frontend's time to route, pack and send one command.\n")
    body = yaml.safe_dump(dataclasses.asdict(hardware), sort_keys=False, default_flow_style=None, width=120)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(header + body)
    engine_path = Path(engine_path or engine_path_for(out_path, name))
    engine.name = engine_path.stem
    engine.provenance = {"host_model": f"measured by testbed profile on {name} (real engine step times)",
                         "kernel_launch_us": f"stated assumption off {name} (one PyTorch eager launch)",
                         "attention_kernel": "the hardware preset's"}
    engine_header = (f"# This project's engine as testbed.profiling.profile.profile_cpu measured it on hardware "
                     f"'{name}' ({time.strftime('%Y-%m-%d %H:%M')}):\n# overhead_ms + overhead_per_seq_ms * num_seqs "
                     f"+ overhead_per_token_ms * num_tokens: {overhead_note}.\n"
                     "# On other hardware those terms do not carry (EngineConfig.for_hardware).\n")
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    engine_path.write_text(engine_header + yaml.safe_dump(dataclasses.asdict(engine), sort_keys=False,
                                                          default_flow_style=None, width=120))
    return hardware


def calibrate_overhead(model, hardware: HardwareConfig, engine: EngineConfig, quick: bool, log) -> str:
    """Fit `engine`'s per-iteration overhead and `hardware`'s calibration
    scale, step jitter and frontend hop to the real engine's steps (short real
    runs), log the model's error per batch shape, and return the YAML header's note on it."""
    from testbed.config import RuntimeConfig
    from testbed.profiling.calibration import measure_frontend_message, measure_overhead, measure_serving
    fit = measure_overhead(model, hardware, quick, lambda: measure_serving(model, hardware, quick))
    serving = fit.serving
    engine.overhead_ms = round(fit.overhead_ms, 4)
    engine.overhead_per_seq_ms = round(fit.overhead_per_seq_ms, 4)
    engine.overhead_per_token_ms = round(fit.overhead_per_token_ms, 5)
    hardware.calibration_scale = round(fit.calibration_scale, 4)
    hardware.step_jitter_ms = [round(q, 4) for q in jitter_quantiles(serving.step_deviations_ms)]
    hardware.frontend_hop_ms = round(serving.hop_ms, 4)
    hardware.frontend_message_ms = round(measure_frontend_message(model, RuntimeConfig.host), 4)

    for seqs, tokens, wall, modeled, _ in fit.rows:
        model_ms = fit.predict_ms(seqs, tokens, modeled)
        log(f"  step of {seqs:2d} seqs, {tokens:4d} tokens: engine {wall * 1e3:7.2f} ms, "
            f"model {model_ms:7.2f} ms ({model_ms / (wall * 1e3) - 1:+.0%})")
    for seqs, tokens, wall, modeled, count in fit.serving_rows:
        if count >= 20 or tokens >= 1024:
            model_ms = fit.predict_ms(seqs, tokens, modeled)
            log(f"  served {count:4d}x {seqs:2d} seqs, {tokens:4d} tokens: engine {wall * 1e3:7.2f} ms, "
                f"model {model_ms:7.2f} ms ({model_ms / (wall * 1e3) - 1:+.0%})")
    served = [fit.predict_ms(*row[:2], row[3]) / (row[2] * 1e3) - 1 for row in fit.serving_rows]
    log(f"  {len(fit.serving_rows)} batch shapes of real serving runs: model error median "
        f"{np.median(served):+.0%}, 10th-90th percentile "
        f"{np.percentile(served, 10):+.0%} to {np.percentile(served, 90):+.0%}")
    return (f"fitted with calibration_scale to the real engine's step times over "
            f"{len(fit.rows)} batch shapes stepped alone and {len(fit.serving_rows)} "
            f"served (testbed.profiling.calibration)")


def _check_writable(parser: argparse.ArgumentParser, flag: str, out: Path) -> None:
    """Said before minutes of measuring, not after: the directory is made (as writing would) and tried."""
    if out.is_dir():
        parser.error(f"{flag}: cannot write {out} (a directory); name a .yaml file where you may write")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out.parent).close()
    except OSError as e:
        parser.error(f"{flag}: cannot write {out} ({e.strerror or e}); name a .yaml file where you may write")


def _profile_gpu_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from testbed.model.config import CONF_DIR
    from testbed.profiling.gpu_profile import base_preset, profile_gpu
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device: '{args.device}', but torch {torch.__version__} sees no CUDA GPU here; "
                     "profile this CPU with --device cpu")
    try:
        base = args.base or base_preset(torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu")
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out or CONF_DIR / "hardware" / f"{base}-measured.yaml")
    engine_out = Path(args.engine_out or engine_path_for(out, args.name or out.stem))
    _check_writable(parser, "--out", out)
    _check_writable(parser, "--engine-out", engine_out)
    t0 = time.perf_counter()
    try:
        # the torch backend's graph path pads to the whole cache: fine for a CPU rehearsal only
        hw, engine = profile_gpu(out, engine_out, args.model or "llama3-8b", args.device, base, args.name,
                                 args.quick, attention_backend="triton" if args.device != "cpu" else "torch",
                                 log=print)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} and {engine_out} in {time.perf_counter() - t0:.0f} s: {len(hw.gemm_profile)} GEMM rows, "
          f"memory efficiency {hw.memory_efficiency:.2f}; engine overhead {engine.overhead_ms:.3f} ms "
          f"+ {engine.overhead_per_seq_ms:.4f} ms/seq + {engine.overhead_per_token_ms * 1e3:.2f} us/token, "
          f"{engine.kernel_launch_us:.2f} us per eager launch")
    return 0


def profile_main(argv: list[str]) -> int:
    """`testbed profile [--quick] [--out PATH] [--model NAME]`."""
    from testbed.model.config import CONF_DIR
    parser = argparse.ArgumentParser(prog="testbed profile", description=(
        "Measure this machine (GEMMs, attention, memory bandwidth, the real engine's per-iteration "
        "overhead) and write the hardware and engine presets that `runtime=sim hardware=cpu` reads."))
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds, for tests); default: full")
    parser.add_argument("--out", default=None,
                        help="where to write the YAML (default: conf/hardware/cpu.yaml; with --device cuda "
                             "conf/hardware/BASE-measured.yaml)")
    parser.add_argument("--model", default=None,
                        help="the model preset whose shapes to measure (default: tiny; with --device cuda llama3-8b)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda: measure this GPU and write a hardware and an engine preset")
    parser.add_argument("--engine-out", default=None,
                        help="where the engine preset goes (default with --device cuda: conf/engine/testbed.yaml); "
                             "given with --device cpu, the GPU profile's code runs here (a rehearsal)")
    parser.add_argument("--base", default=None,
                        help="with the engine preset: the stated preset of this chip (default: from the GPU's name)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as each worker process uses (1)")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes stepping at once, as a deployment of that many real workers "
                             "runs near capacity: the profile measures beside workers - 1 busy neighbours (1)")
    parser.add_argument("--name", default=None, help="the preset's name (default: the output file's stem)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads: must be >= 1, got {args.threads}")
    if args.workers < 1:
        parser.error(f"--workers: must be >= 1, got {args.workers}")
    if args.device != "cpu" or args.engine_out:
        return _profile_gpu_main(parser, args)
    out = Path(args.out or CONF_DIR / "hardware" / "cpu.yaml")
    args.model = args.model or "tiny"
    _check_writable(parser, "--out", out)
    t0 = time.perf_counter()
    try:
        name = args.name or out.stem
        engine_out = engine_path_for(out, name)
        hw = profile_cpu(out, args.model, args.quick, name, args.threads, log=print,
                         num_workers=args.workers, engine_path=engine_out)
        engine = load_engine_preset(str(engine_out))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s: {len(hw.gemm_profile)} GEMM rows, "
          f"{len(hw.attention_profile)} attention rows, {hw.peak_tflops * 1e3:.1f} GFLOP/s peak, "
          f"{hw.hbm_bw_gbps:.1f} GB/s copy; engine preset {engine_out}: overhead {engine.overhead_ms:.3f} ms "
          f"+ {engine.overhead_per_seq_ms:.3f} ms/seq + {engine.overhead_per_token_ms * 1e3:.1f} us/token, "
          f"calibration scale {hw.calibration_scale:.3f}, frontend hop {hw.frontend_hop_ms:.3f} ms "
          f"+ {hw.frontend_message_ms:.3f} ms per command")
    hint = f"hardware={out.stem}" if out.parent.resolve() == (CONF_DIR / "hardware").resolve() else \
        f"copy it to {CONF_DIR / 'hardware'} and use hardware={out.stem}"
    print(f"use it: testbed run runtime=sim {hint}")
    return 0
