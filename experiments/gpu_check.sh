#!/usr/bin/env bash
# One lent GPU (an H100 or H200), no network, about 8 minutes: the real engine with CUDA-graph
# decode, its measured presets, and the piggyback tax where the GPU sets the pace.
#
#   experiments/gpu_check.sh OUT_DIR            # on the GPU (carry .whl: experiments/gpu_wheels.sh)
#   experiments/gpu_check.sh OUT_DIR --tiny     # here, on the CPU: every step with the tiny model,
#                                               # so that the GPU run does not fail on a typo
#
# Writes into OUT_DIR (seven files: a copy-back limited to eight keeps them all):
#   gpu_check.log        environment, set-up, the command behind each file, every step's output
#                        (the CUDA tests of the graph path included)
#   graphs.csv           bench_gpu_graphs: a decode step of llama3-8b (all 32 layers, bf16, random weights,
#                        triton) at B = 1, 8, 32, 128, eager against graph replay: wall clock, GPU busy time
#   graphs_tokens.json   the same engine's greedy tokens with graphs against eager, and the smallest top-2 margin
#   HW.yaml              testbed profile --device cuda: the measured hardware preset of this GPU (BASE-measured)
#   engine-testbed.yaml  ... and the engine preset (name: testbed, CUDA graphs on) beside it
#   piggyback.csv        bench_gpu_piggyback: 8 of llama3-8b's layers, 4K-128K prompts in chunks of 2,048 and
#                        512 alone and riding on 8/32/128 decodes (their steps replayed as graphs), the measured
#                        tax beside the simulator's price with the two presets above, point by point
#   prefill.csv          bench_gpu_prefill: whole vs chunked prefill, llama3-8b, 4K-128K prompts
#
# Needs a CUDA build of torch and triton. Sets the repo up with `pip install -e . --no-deps`
# (falling back to a symlinked package tree); the packages the GPU image lacks (hydra-core,
# omegaconf, antlr4-python3-runtime) come from wheels in .whl/ (experiments/gpu_wheels.sh).
set -uo pipefail
OUT=${1:?usage: experiments/gpu_check.sh OUT_DIR [--tiny]}
TINY=${2:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
LOG="$OUT/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
T0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
# run LIMIT_S CMD...: logs the command, runs it under a timeout, logs its exit status
run() {
  local limit=$1; shift
  echo "command: $*" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "exit $? ($*)" | tee -a "$LOG"
}

if [ "$TINY" = "--tiny" ]; then
  PY=${PYTHON:-.venv/bin/python}
  DEV=(--device cpu --model tiny)
  GRAPHS=(--batches 1,3 --decode-context 64 --prompts 5 --max-tokens 4 --repeats 2)
  PROFILE=(--device cpu --model tiny --quick --base h200)
  HW=h200-rehearsal
  PIGGY=(--prompts 512,1024 --chunks 128 --decodes 0,4 --decode-context 128 --cuda-graph-sizes 4 --repeats 1
         --max-chunk-samples 3 --budget-s 60)
  PREFILL=(--prompts 256,512 --chunks 0,128 --backends torch --budget-s 30)
  LIMITS=(120 300 300 300 200)
else
  PY=${PYTHON:-python3}
  DEV=()
  GRAPHS=()
  PROFILE=(--device cuda)
  HW=""
  PIGGY=(--layers 8 --prompts 4096,16384,32768,65536,131072 --chunks 2048,512 --decodes 0,8,32,128
         --cuda-graph-sizes 8,32,128 --max-chunk-samples 6 --budget-s 110)
  PREFILL=(--prompts 4096,8192,16384,32768,65536,131072 --backends triton --budget-s 45)
  LIMITS=(60 110 90 140 65)
fi

step "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  "$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null || echo "flash_attn: not installed"
  git log -1 --format='commit %H %s' 2>/dev/null || true
} >>"$LOG" 2>&1

step "set-up"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/pdt-site .whl/*.whl >>"$LOG" 2>&1 \
    && export PYTHONPATH=/tmp/pdt-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import testbed.kernels.attention" >>"$LOG" 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1
fi
if ! "$PY" -c "import testbed.kernels.attention" >>"$LOG" 2>&1; then
  # no editable install: rebuild the package-dir mapping of pyproject.toml with symlinks
  shadow=/tmp/pdt-shadow/testbed
  mkdir -p "$shadow"
  for f in testbed/*; do ln -sfn "$PWD/$f" "$shadow/"; done
  for d in kernels modes kv_transfer; do ln -sfn "$PWD/$d" "$shadow/$d"; done
  export PYTHONPATH=/tmp/pdt-shadow${PYTHONPATH:+:$PYTHONPATH}
  echo "using the symlinked tree /tmp/pdt-shadow" >>"$LOG"
fi
"$PY" -c "import testbed.config, testbed.model.cuda_graphs, testbed.profiling.gpu_profile; print('imports ok')" \
  >>"$LOG" 2>&1
if [ -z "$HW" ]; then
  HW=$("$PY" -c "import torch; from testbed.profiling.gpu_profile import base_preset
print(base_preset(torch.cuda.get_device_name()))" 2>>"$LOG")-measured
fi

step "tests of the graph path (CUDA ones marked gpu)"
run "${LIMITS[0]}" "$PY" -m pytest -m "gpu or not slow" tests/test_cuda_graphs.py tests/test_kernels_engine.py -rs \
  -p no:cacheprovider

step "bench_gpu_graphs -> graphs.csv graphs_tokens.json"
run "${LIMITS[1]}" "$PY" experiments/benchmarks/bench_gpu_graphs.py --out "$OUT" "${DEV[@]}" "${GRAPHS[@]}"

step "testbed profile -> $HW.yaml engine-testbed.yaml"
run "${LIMITS[2]}" "$PY" -c "import sys; from testbed.profiling.profile import profile_main; sys.exit(profile_main(sys.argv[1:]))" \
  "${PROFILE[@]}" --out "$OUT/$HW.yaml" --engine-out "$OUT/engine-testbed.yaml"

step "bench_gpu_piggyback -> piggyback.csv"
if [ -f "$OUT/$HW.yaml" ] && [ -f "$OUT/engine-testbed.yaml" ]; then
  PRICE=(--hardware "$OUT/$HW.yaml" --engine "$OUT/engine-testbed.yaml")
else
  PRICE=(--hardware "${HW%-*}")
  echo "no measured presets: priced with the stated preset ${HW%-*}" | tee -a "$LOG"
fi
run "${LIMITS[3]}" "$PY" experiments/benchmarks/bench_gpu_piggyback.py --out "$OUT" "${DEV[@]}" --backend triton \
  "${PRICE[@]}" "${PIGGY[@]}"

step "bench_gpu_prefill -> prefill.csv"
run "${LIMITS[4]}" "$PY" experiments/benchmarks/bench_gpu_prefill.py --out "$OUT" "${DEV[@]}" "${PREFILL[@]}"

step "done"
ls -l "$OUT" >>"$LOG"
