#!/usr/bin/env bash
# Issue 43's batch-invariant mode on one GPU, run from the repository root: its GPU tests (the attention kernels bit
# for bit, the engine's layouts), then bench/batch_invariant.py (W1 and W3 off and on, W3's TTFT and TPOT, each "on"
# LLM's gemv_chain-or-cuBLAS choice), then for each preset gemv_chain against cuBLAS's pinned algorithm on its
# shapes (bench/gemv.py --invariant) and where a batch-1 decode step goes off and on (bench/profile_step.py --chain).
# Logs in OUT; a summary on stdout. About 7 minutes on an H100 (tests ~4, benchmarks ~3).
#
#   bash bench/invariant_device.sh OUT [PRESETS]     # PRESETS: default smollm2-135m,llama-3.2-1b
#
# Needs pycuda importable by $PYTHON (default python3) and nvcc for the kernels' first build.
set -uo pipefail
PYTHON=${PYTHON:-python3}
OUT=${1:?usage: bench/invariant_device.sh OUT [PRESETS]}
PRESETS=${2:-smollm2-135m,llama-3.2-1b}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
start=$SECONDS
$PYTHON -m tinyvllm build-kernels > "$OUT/build.txt" 2>&1 || echo "build-kernels failed: see $OUT/build.txt"
T="$PYTHON -m pytest -q -p no:cacheprovider -rfE"
$T tests/gpu/test_attention_invariant.py > "$OUT/tests-attention.txt" 2>&1 &
$T tests/gpu/test_batch_invariant_cuda.py > "$OUT/tests-engine.txt" 2>&1 &
wait
for log in "$OUT"/tests-*.txt; do
  echo "$(basename "$log"): $(tail -n 1 "$log")"
  grep -E "^(FAILED|ERROR) " "$log"
done
$PYTHON bench/batch_invariant.py --presets "$PRESETS" --json "$OUT/batch_invariant.json" > "$OUT/batch_invariant.txt" 2>&1
cat "$OUT/batch_invariant.txt"
for preset in ${PRESETS//,/ }; do
  log="$OUT/gemv-invariant-$preset.txt"
  $PYTHON bench/gemv.py --invariant --runs 50 --preset "$preset" > "$log" 2>&1
  grep -v "^ *bits" "$log"  # the per-shape times and the step's sum; of the bit checks, failures
  grep "DIFFERS" "$log"
  for mode in "" --batch-invariant; do
    log="$OUT/profile-$preset${mode:+-invariant}.txt"
    $PYTHON bench/profile_step.py --dummy-weights "$preset" --batch 1 --chain $mode > "$log" 2>&1
    echo "$preset ${mode:-(off)}: $(grep -m 1 "graph step" "$log")"
    grep -m 1 "batch-invariant products" "$log"  # (on) which shapes ran gemv_chain
  done
done
echo "invariant_device: $(( SECONDS - start )) s"
