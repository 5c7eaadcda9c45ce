#!/usr/bin/env bash
# The host loop's profiles on the GPU host (issue 38), one device call (~5 min on an H100), from the repository root:
#   1. per engine step, each host phase and the GPU's idle gap between steps (bench/profile_host.py): steady decode
#      at 512 rows with a quarter of them mixed (stop strings, logprobs, penalties) and at 1 row; W6 (its masks'
#      phases too) and J1-like token ids through llm.generate;
#   2. J1 as a job against the engine on the same requests (bench/profile_job.py --backend cuda --timeline): the
#      first step, the full-batch window's step interval and gaps, the sequences a step, the tail; each phase's CPU.
#
#   bash bench/host_loop_device.sh [RESULTS_DIR] [PRESET]     (default $OUT if set, else bench/results; smollm2-135m)
#
# Needs pycuda importable by $PYTHON (default python3); the repository root is put on PYTHONPATH.
set -uo pipefail
PYTHON=${PYTHON:-python3}
RESULTS=${1:-${OUT:-bench/results}}
PRESET=${2:-smollm2-135m}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RESULTS"

"$PYTHON" -m tinyvllm build-kernels >"$RESULTS/host-loop-build.txt" 2>&1 || echo "build-kernels failed (see the log)"
"$PYTHON" bench/profile_host.py --dummy-weights "$PRESET" --batch 512 --mixed --workloads W6,J1 \
  --json "$RESULTS/host-loop-profile.json" >"$RESULTS/host-loop-profile.txt" 2>&1
echo "profile_host (512 mixed, W6, J1-like) rc=$?"
"$PYTHON" bench/profile_host.py --dummy-weights "$PRESET" --batch 1 --json "$RESULTS/host-loop-batch1.json" \
  >"$RESULTS/host-loop-batch1.txt" 2>&1
echo "profile_host (batch 1) rc=$?"
"$PYTHON" bench/profile_job.py --backend cuda --dummy-weights "$PRESET" --rows 20000 --timeline \
  >"$RESULTS/host-loop-j1-job.txt" 2>&1
echo "profile_job (J1, 20,000 rows) rc=$?"
grep -h -s -E "^== |engine step|masks:|idle|gap|^engine:|^job:|job - engine|us/row" \
  "$RESULTS"/host-loop-profile.txt "$RESULTS"/host-loop-batch1.txt "$RESULTS"/host-loop-j1-job.txt | head -80 || true
