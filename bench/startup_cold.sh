#!/usr/bin/env bash
# Cold start on the GPU host, run from the repository root (~3 minutes; the model dir is written once, ~1 more):
#   1. nvcc's time for each kernel compile job, one after another, and each set compiled side by side on the
#      host's cores (every kernel as whole files, every kernel as cached, Llama-3.2-1B's: bench/kernel_compile.py);
#   2. LLM(...) of Llama-3.2-1B-shaped random bf16 weights, per phase, in fresh processes: empty kernel cache, warm,
#      empty with the file dropped from the page cache, and after `tinyvllm build-kernels` (timed too).
#
#   bash bench/startup_cold.sh [RESULTS_DIR]     (default $OUT if set, else bench/results)
#
# Needs pycuda and nvcc; $PYTHON (default python3), the repository root put on PYTHONPATH; $MODEL (default /tmp/l1b).
set -euo pipefail
out=${1:-${OUT:-bench/results}} python=${PYTHON:-python3} model=${MODEL:-/tmp/l1b}
mkdir -p "$out" && export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$python" bench/write_llama_1b.py "$model"
echo "== 1. nvcc per compile job, and side by side on $(nproc) cores"
"$python" bench/kernel_compile.py --parallel --json "$out/kernel-compile.json" | tee "$out/kernel-compile.txt"
echo "== 2. LLM() start-up per phase"
"$python" bench/startup_cold.py "$model" ${BACKEND:+--backend "$BACKEND"} --json "$out/startup-cold.json" \
  | tee "$out/startup-cold.txt"
