#!/usr/bin/env bash
# lm-evaluation-harness on the GPU host (issue 16), run from the repository root:
#   1. tests/gpu/test_lm_eval_cuda.py: the test tasks (tests/eval_tasks) on the cuda backend against lm-eval's hf
#      model in float32 and bf16 on the same GPU (per-item loglikelihood distances, generate_until agreement);
#   2. bench/lm_eval_timing.py: the 1,000-item multiple-choice task on the dummy Llama-3.2-1B (random bf16 weights),
#      tinyvllm's cuda backend against lm-eval's hf model (batch_size 64), in this one run.
#
#   bench/lm_eval_device.sh [RESULTS_DIR]     (default $OUT if set, else bench/results)
#
# TIMING_ARGS replaces part 2's arguments (default: the 1B run above; `--device cpu --preset tiny --items 20` checks
# the script on a machine without a GPU, where part 1 skips).
#
# The host has no network and no lm-eval: the wheels of .whl/ (pycuda, ...) and .whl-eval/ are carried and installed
# into $SITE (default /tmp/site), which goes on PYTHONPATH with the repository root. .whl-eval/ holds lm-eval and the
# part of its import chain (`hf` model, CLI table) that the host's image lacks, 11 MiB, all pure Python; made with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl-eval \
#     lm_eval==0.4.13 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pytablewriter==1.2.1 DataProperty==1.1.1 \
#     mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 \
#     pytz==2026.6
# (found by running both models under a Python 3.12 venv holding only the host's packages at its versions).
# Both parts run even when the first fails; the exit status says.
set -uo pipefail
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
RESULTS=${1:-${OUT:-bench/results}}
mkdir -p "$RESULTS"
"$PYTHON" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl .whl-eval/*.whl || exit 1
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # everything is local: never wait on a hub
export TQDM_DISABLE=1  # progress bars would fill the logs
TIMING_ARGS=${TIMING_ARGS:---device cuda --preset llama-3.2-1b --items 1000 --hf-batch-size 64}
status=0

echo "== 1. test tasks: tinyvllm cuda vs lm-eval hf float32 / bf16"
"$PYTHON" -m pytest -q -s -rs -p no:cacheprovider tests/gpu/test_lm_eval_cuda.py 2>&1 \
  | tee "$RESULTS/lm-eval-cuda-tests.txt" || status=1

echo "== 2. 1,000-item multiple choice, dummy Llama-3.2-1B: tinyvllm cuda vs lm-eval hf"
# shellcheck disable=SC2086  # TIMING_ARGS is a list of arguments
"$PYTHON" bench/lm_eval_timing.py $TIMING_ARGS --json "$RESULTS/lm-eval-timing.json" 2>&1 \
  | tee "$RESULTS/lm-eval-timing.txt" || status=1
exit $status
