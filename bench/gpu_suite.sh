#!/usr/bin/env bash
# The GPU suite (tests/gpu) in a few minutes on one GPU: the kernels built once, then the test files in SHARDS pytest
# processes side by side (files dealt largest first to the emptiest shard), then, alone, the files that size the KV
# cache from the GPU's free memory or count every byte given back (they need the GPU to themselves).
# Usage: bash bench/gpu_suite.sh OUT [SHARDS] [EXTRA PYTEST ARGS...]; logs in OUT/gpu-shard-*.txt, OUT/gpu-solo.txt,
# each ending in its slowest tests (--durations), to deal the files by time.
# GPU_SUITE_PART=1 or 2 runs half of the test files (dealt alternately, largest first; the solo part with the second),
# so that the suite fits in two device calls: together the two parts run every file once.
set -uo pipefail
out=${1:?usage: bench/gpu_suite.sh OUT [SHARDS]}
shards=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/.."
mkdir -p "$out"
solo="tests/gpu/test_close.py tests/gpu/test_kernel_start.py"
timed="tests/gpu/test_cuda_model.py::test_measure_limits_and_describe"  # measures the copy and GEMM rates
python3 -m tinyvllm build-kernels >"$out/gpu-build.txt" 2>&1 || echo "build-kernels failed: see $out/gpu-build.txt"

files=$(ls -S tests/gpu/test_*.py | grep -v -F -x -f <(tr ' ' '\n' <<<"$solo"))
part=${GPU_SUITE_PART:-}
case "$part" in
  "") ;;
  1|2) files=$(awk -v p="$part" 'NR % 2 == p % 2' <<<"$files"); [[ $part == 1 ]] && solo="" ;;
  *) echo "GPU_SUITE_PART must be 1 or 2, not $part" >&2; exit 2 ;;
esac
declare -a lists sizes
for ((s = 0; s < shards; s++)); do lists[s]=""; sizes[s]=0; done
for f in $files; do
  best=0
  for ((s = 1; s < shards; s++)); do (( sizes[s] < sizes[best] )) && best=$s; done
  lists[best]+=" $f"
  sizes[best]=$(( sizes[best] + $(wc -c <"$f") ))
done

start=$SECONDS
for ((s = 0; s < shards; s++)); do
  [[ -z ${lists[s]} ]] && continue  # more shards than files: pytest with no file would collect the CPU suite
  python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15 ${lists[s]} --deselect "$timed" "$@" \
    >"$out/gpu-shard-$s.txt" 2>&1 &
done
wait
[[ -n $solo ]] && python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15 $solo "$timed" "$@" \
  >"$out/gpu-solo.txt" 2>&1
for log in "$out"/gpu-shard-*.txt ${solo:+"$out/gpu-solo.txt"}; do
  echo "$(basename "$log"): $(tail -n 1 "$log")"
  grep -E "^(FAILED|ERROR) " "$log"
done
echo "gpu suite: $(( SECONDS - start )) s wall, $shards shards + solo"
