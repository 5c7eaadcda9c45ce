#!/usr/bin/env bash
# Issue 41's MoE targets at the Qwen3-30B-A3B shape (random bf16 weights, 61 GB, made on the GPU by both sides) on
# one GPU, run from the repository root: tinyvllm's W1 and W3 (W3 <= 2.2 ms/token, W1 >= 50% of its floor) and HF
# transformers' compiled static-cache peer on the same requests (>= 5x), then the table (bench/moe_report.py).
#
#   bash bench/moe_device.sh OUT
#
# HF's W3 is the full workload; its W1 runs at HF_W1_SCALE (default 0.5: 256 prompts x 128 in / 128 out, one static
# batch of 256), and tinyvllm runs that same W1 again for the ratio. Each HF run is cut at HF_TIMEOUT seconds
# (default 180; what it finished is kept). The kernels build (nvcc, on the CPU) while HF runs. At most ~7.5 minutes
# on an H200 (HF's two runs capped, tinyvllm's ~1.5). Needs pycuda, torch and transformers importable by $PYTHON
# (default python3).
set -uo pipefail
PYTHON=${PYTHON:-python3}
OUT=${1:?usage: bench/moe_device.sh OUT}
PRESET=${PRESET:-qwen3-30b-a3b}
BACKEND=${BACKEND:-cuda}
HF_PEER=${HF_PEER:-compiled}
SCALE=${SCALE:-1}  # tinyvllm's own run (the targets'); a dry run on a CPU: PRESET=tiny BACKEND=numpy HF_PEER=static
HF_W1_SCALE=${HF_W1_SCALE:-0.5}
HF_TIMEOUT=${HF_TIMEOUT:-180}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
rm -f "$OUT"/ours.json "$OUT"/ours-hf-scale.json "$OUT"/hf-w1.json "$OUT"/hf-w3.json
start=$SECONDS

build=""
if [ "$BACKEND" = cuda ]; then
  "$PYTHON" -m tinyvllm build-kernels >"$OUT/build-kernels.txt" 2>&1 &
  build=$!
fi

echo "== HF peer $HF_PEER (compiled: static cache, torch.compile): W3 at scale $SCALE, then W1 at scale $HF_W1_SCALE (each at most $HF_TIMEOUT s)"
timeout -k 10 "$HF_TIMEOUT" "$PYTHON" bench/hf_peers.py --peers "$HF_PEER" --dummy-weights "$PRESET" --workloads W3 \
  --scale "$SCALE" --json "$OUT/hf-w3.json" >"$OUT/hf-w3.txt" 2>&1 || echo "HF W3 exited with $? (see $OUT/hf-w3.txt)"
timeout -k 10 "$HF_TIMEOUT" "$PYTHON" bench/hf_peers.py --peers "$HF_PEER" --dummy-weights "$PRESET" --workloads W1 \
  --scale "$HF_W1_SCALE" --batch-sizes 256 --json "$OUT/hf-w1.json" >"$OUT/hf-w1.txt" 2>&1 \
  || echo "HF W1 exited with $? (see $OUT/hf-w1.txt)"
grep -h "^HF \|^peer " "$OUT"/hf-w3.txt "$OUT"/hf-w1.txt
echo "   HF done at $(( SECONDS - start )) s"
[ -z "$build" ] || wait "$build" || echo "build-kernels failed (see $OUT/build-kernels.txt)"

echo "== tinyvllm: W1 and W3 (scale $SCALE), then W1 at scale $HF_W1_SCALE (HF's requests)"
"$PYTHON" -m tinyvllm bench --backend "$BACKEND" --dummy-weights "$PRESET" --workloads W1,W3 --scale "$SCALE" \
  --json "$OUT/ours.json" \
  >"$OUT/ours.txt" 2>&1 || echo "tinyvllm bench exited with $? (see $OUT/ours.txt)"
if [ "$HF_W1_SCALE" != "$SCALE" ]; then
  "$PYTHON" -m tinyvllm bench --backend "$BACKEND" --dummy-weights "$PRESET" --workloads W1 --scale "$HF_W1_SCALE" \
    --json "$OUT/ours-hf-scale.json" >"$OUT/ours-hf-scale.txt" 2>&1 \
    || echo "tinyvllm bench (scale $HF_W1_SCALE) exited with $? (see $OUT/ours-hf-scale.txt)"
fi
echo "   tinyvllm done at $(( SECONDS - start )) s"

echo "== $PRESET, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
"$PYTHON" bench/moe_report.py "$OUT" "$HF_PEER" | tee "$OUT/table.txt"
echo "total $(( SECONDS - start )) s"
