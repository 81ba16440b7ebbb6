#!/usr/bin/env bash
# One GPU, no network, under 5 minutes: the attention kernels' checks, whole vs chunked prefill,
# and the chunk tax inside a decode batch (the piggyback tax) against the simulator's h200 preset.
#
#   experiments/gpu_check.sh OUT_DIR
#
# Writes into OUT_DIR (seven files, so that a file-count-limited copy-back keeps them all):
#   gpu_check.log   environment, set-up, and every step's output
#   tests.log       pytest -m "gpu or not slow" over tests/test_kernels*.py on CUDA
#   kernels.csv     Triton paged attention vs SDPA / flash-attn, KV gather/scatter, measured peaks
#   targets.csv     the two performance targets, pass/fail
#   prefill.csv     whole vs chunked prefill, llama3-8b bf16 random weights, 4K-128K prompts
#   piggyback.csv   llama3-8b-shaped layers, 4K-128K prompts in chunks of 2048/512 alone and riding on
#                   0/8/32/128 decodes at 1K context: measured tax beside the sim's h200 price, point by point
#   step_host.csv   one step's wall clock against its GPU busy time (decodes alone, a chunk alone, both):
#                   whether the eager engine's host or the GPU sets a step's pace (bench_gpu_step_host)
#
# Needs a CUDA build of torch and triton. Sets the repo up with `pip install -e . --no-deps`
# (falling back to a symlinked package tree); packages the image lacks (omegaconf and
# antlr4-python3-runtime, for the engine) are installed from wheels in .whl/ when present.
# flash-attn is optional: its baselines and backend are skipped without it.
set -uo pipefail
OUT=${1:?usage: experiments/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
T0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

step "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  "$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null || echo "flash_attn: not installed"
} >>"$LOG" 2>&1

step "set-up"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/pdt-site .whl/*.whl >>"$LOG" 2>&1 \
    && export PYTHONPATH=/tmp/pdt-site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1
if ! "$PY" -c "import testbed.kernels.attention" >>"$LOG" 2>&1; then
  # no editable install: rebuild the package-dir mapping of pyproject.toml with symlinks
  shadow=/tmp/pdt-shadow/testbed
  mkdir -p "$shadow"
  for f in testbed/*; do ln -sfn "$PWD/$f" "$shadow/"; done
  for d in kernels modes kv_transfer; do ln -sfn "$PWD/$d" "$shadow/$d"; done
  export PYTHONPATH=/tmp/pdt-shadow${PYTHONPATH:+:$PYTHONPATH}
  echo "using the symlinked tree /tmp/pdt-shadow" >>"$LOG"
fi
"$PY" -c "import testbed.kernels.triton_attention, testbed.model.config; print('imports ok')" >>"$LOG" 2>&1

step "kernel tests on CUDA -> tests.log"
# Triton compiles each test's specialisation on the CPU: spread them over processes when xdist is there
parallel=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 6" || true)
timeout 50 "$PY" -m pytest -m "gpu or not slow" tests/test_kernels*.py -q -rs -p no:cacheprovider $parallel \
  >"$OUT/tests.log" 2>&1
echo "pytest exit $?" | tee -a "$LOG"; tail -n 3 "$OUT/tests.log" >>"$LOG"

step "bench_kernels -> kernels.csv targets.csv"
timeout 50 "$PY" experiments/benchmarks/bench_kernels.py --out "$OUT" >>"$LOG" 2>&1
echo "bench_kernels exit $?" | tee -a "$LOG"

step "bench_gpu_prefill -> prefill.csv"
timeout 70 "$PY" experiments/benchmarks/bench_gpu_prefill.py --out "$OUT" --budget-s 45 --backends triton,flash_attn \
  >>"$LOG" 2>&1
echo "bench_gpu_prefill exit $?" | tee -a "$LOG"

step "bench_gpu_piggyback -> piggyback.csv"
# 8 of llama3-8b's 32 layers: the same per-layer shapes, a quarter of the time (the sim prices the same 8)
timeout 110 "$PY" experiments/benchmarks/bench_gpu_piggyback.py --out "$OUT" --layers 8 --hardware h200 --backend triton \
  --budget-s 80 >>"$LOG" 2>&1
echo "bench_gpu_piggyback exit $?" | tee -a "$LOG"

step "bench_gpu_step_host -> step_host.csv"
timeout 40 "$PY" experiments/benchmarks/bench_gpu_step_host.py --out "$OUT" --layers 8 >>"$LOG" 2>&1
echo "bench_gpu_step_host exit $?" | tee -a "$LOG"

step "done"
ls -l "$OUT" >>"$LOG"
