#!/usr/bin/env bash
# The full grid's cells whose winner rested on probes too short to be steady
# (`grid_table.py`'s last column; the grid ran with a flat 4,000-request probe cap),
# re-run with the per-GPU cap (`experiment.max_requests_per_gpu`, 2,000 x N).
# Each cell: one link (rdma-400, or the flagged one), p99 TBT (fluidity where only that was
# flagged) at the phase diagram's 100 ms or at 50 ms, the three colocated
# deployments and the grid's best disaggregated ones there (the three best at each
# length of the cell, from experiments/results/decision/full_grid/).
#
#   experiments/recheck_short_lengths.sh OUT_DIR [JOBS [CELL ...]]
#
# Writes OUT_DIR/<cell>/decision.csv (with its probes and summary) and OUT_DIR/<cell>.log.
# JOBS cells at a time (default 2); CELLs: only these (names below). All 15: 83 min of one
# core here (42 min of wall two at a time, s46).
set -euo pipefail
out=${1:?usage: experiments/recheck_short_lengths.sh OUT_DIR [JOBS [CELL ...]]}
jobs=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
only=" $* "
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
testbed=${TESTBED:-$here/.venv/bin/testbed}

# name model hardware N link lengths smoothness tbt_ms disaggregated-deployments
cells="
dsv2_h100-sxm_n4 deepseek-v2-lite h100-sxm 4 rdma-400 1024,2048,4096 p99_tbt 100 disagg-2P2D,disagg-3P1D,disagg-2P1D-p_tp1-d_tp2
dsv2_h100-sxm_n8 deepseek-v2-lite h100-sxm 8 rdma-400 1024,2048,4096 p99_tbt 100 disagg-5P3D,disagg-4P2D-p_tp1-d_tp2,disagg-4P4D,disagg-6P2D,disagg-3P2D-p_tp2-d_tp1
dsv2_a100-80gb-sxm_n4 deepseek-v2-lite a100-80gb-sxm 4 rdma-400 1024,2048,4096 p99_tbt 100 disagg-3P1D,disagg-2P2D,disagg-2P1D-p_tp1-d_tp2,disagg-1P1D-p_tp2-d_tp2
dsv2_a100-80gb-sxm_n8 deepseek-v2-lite a100-80gb-sxm 8 rdma-400 1024,2048,4096 p99_tbt 100 disagg-6P2D,disagg-3P2D-p_tp2-d_tp1,disagg-5P3D,disagg-6P1D-p_tp1-d_tp2,disagg-3P1D-p_tp2-d_tp2,disagg-7P1D
dsv2_h200_n4 deepseek-v2-lite h200 4 rdma-400 1024,2048,4096 p99_tbt 100 disagg-3P1D,disagg-2P1D-p_tp1-d_tp2,disagg-2P2D
dsv2_h200_n8 deepseek-v2-lite h200 8 rdma-400 1024,2048,4096 p99_tbt 100 disagg-4P2D-p_tp1-d_tp2,disagg-3P2D-p_tp2-d_tp1,disagg-6P2D,disagg-7P1D,disagg-5P3D
dsv2_h100-sxm_n4_50ms deepseek-v2-lite h100-sxm 4 rdma-400 1024,2048 p99_tbt 50 disagg-2P2D,disagg-3P1D,disagg-2P1D-p_tp1-d_tp2
dsv2_h100-sxm_n8_50ms deepseek-v2-lite h100-sxm 8 rdma-400 1024 p99_tbt 50 disagg-5P3D,disagg-4P2D-p_tp1-d_tp2,disagg-4P4D
dsv2_h200_n4_50ms deepseek-v2-lite h200 4 rdma-400 1024 p99_tbt 50 disagg-3P1D,disagg-2P1D-p_tp1-d_tp2,disagg-2P2D
dsv2_h200_n8_50ms deepseek-v2-lite h200 8 rdma-400 1024 p99_tbt 50 disagg-6P2D,disagg-3P2D-p_tp2-d_tp1,disagg-5P3D
l3_h100_n8_2k llama3-8b h100-sxm 8 rdma-400 2048 p99_tbt 100 disagg-6P2D,disagg-6P1D-p_tp1-d_tp2,disagg-5P3D
l3_h200_n4_8k llama3-8b h200 4 rdma-400 8192 p99_tbt 100 disagg-3P1D,disagg-2P2D,disagg-2P1D-p_tp1-d_tp2
l3_h200_n8_2k llama3-8b h200 8 rdma-400 2048 p99_tbt 100 disagg-6P2D,disagg-6P1D-p_tp1-d_tp2,disagg-5P3D
l3_h200_n8_16k_tcp llama3-8b h200 8 tcp-25 16384 p99_tbt 100 disagg-7P1D,disagg-6P2D,disagg-3P1D-p_tp2-d_tp2
l3_a100_n8_2k_fl50 llama3-8b a100-80gb-sxm 8 rdma-400 2048 fluidity 50 disagg-6P2D,disagg-6P1D-p_tp1-d_tp2,disagg-5P3D
"

for c in $only; do
  echo "$cells" | grep -q "^$c " || { echo "unknown cell '$c'; the cells are: $(echo "$cells" | cut -d' ' -f1 | xargs)" >&2; exit 2; }
done

one() {
  local name=$1 model=$2 hw=$3 n=$4 link=$5 lens=$6 sm=$7 tbt=$8 deps=$9
  "$testbed" run experiment=decision-full "experiment.models=[$model]" "experiment.hardware=[$hw]" \
    "experiment.links=[$link]" "experiment.num_gpus=[$n]" "experiment.tbt_slos_ms=[$tbt]" \
    "experiment.context_lens=[$lens]" "experiment.smoothness=[$sm]" \
    "experiment.deployments=[sarathi-512,sarathi-2048,adaptive,$deps]" wandb.mode=disabled \
    "hydra.run.dir=$out/$name" > "$out/$name.log" 2>&1 && echo "done $name" || echo "FAILED $name (see $out/$name.log)"
}
export -f one
export out testbed
echo "$cells" | grep -v '^$' | while read -r name rest; do
  if [ "$only" = "  " ] || [[ "$only" == *" $name "* ]]; then echo "$name $rest"; fi
done | xargs -P "$jobs" -L 1 bash -c 'one "$@"' _
