#!/usr/bin/env bash
# Start-up on the GPU host (issue 19), run from the repository root:
#   1. the per-phase breakdown of LLM(...) (`tinyvllm bench --startup`: cold, then warm kernel cache) for
#      Llama-3.2-1B-shaped random bf16 safetensors, the file in the page cache;
#   2. the same with the file dropped from the page cache (what a first run after boot reads from disk);
#   3. a 16-row job (64 tokens out): wall time to its first row and to its end, eager and lazy graph capture;
#   4. W1 and W3 with eager and lazy graph capture, alternating, two fresh processes each (lazy must not slow them).
#
#   bench/startup_device.sh [RESULTS_DIR]     (default $OUT if set, else bench/results)
#
# Needs pycuda importable by $PYTHON (default python3); the repository root is put on PYTHONPATH. The model dir
# ($MODEL, default /tmp/l1b, ~2.5 GB of random values tiled, which is all timing needs) is written once.
set -euo pipefail
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-/tmp/l1b}
RESULTS=${1:-${OUT:-bench/results}}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RESULTS"

"$PYTHON" bench/write_llama_1b.py "$MODEL"

echo "== 1. start-up phases, model file in the page cache"
"$PYTHON" -m tinyvllm bench --startup --backend cuda --model "$MODEL" --json "$RESULTS/startup-llama-1b.json"

echo "== 2. start-up phases, model file dropped from the page cache before the first run"
"$PYTHON" -c "
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
" "$MODEL/model.safetensors"
"$PYTHON" -m tinyvllm bench --startup --backend cuda --model "$MODEL" \
  --json "$RESULTS/startup-llama-1b-page-cache-dropped.json"

echo "== 3. tinyvllm run, 16 rows, 64 tokens out (the very first run may fill the kernel cache)"
for capture in eager lazy; do
  echo "-- --cuda-graph-capture $capture"
  "$PYTHON" bench/first_row.py --repeat 2 -- "$PYTHON" -m tinyvllm run --model "$MODEL" \
    --input examples/prompts.jsonl --output /tmp/startup-job.parquet --max-tokens 64 --overwrite \
    --cuda-graph-capture "$capture"
done 2>&1 | tee "$RESULTS/startup-job-llama-1b.txt"

echo "== 4. W1 and W3, eager vs lazy graph capture, alternating fresh processes"
for round in 1 2; do
  for capture in eager lazy; do
    echo "-- round $round, --cuda-graph-capture $capture"
    "$PYTHON" -m tinyvllm bench --backend cuda --model "$MODEL" --workloads W1,W3 --cuda-graph-capture "$capture" \
      --json "$RESULTS/capture-ab-$capture-$round.json"
  done
done 2>&1 | tee "$RESULTS/capture-ab.txt"
