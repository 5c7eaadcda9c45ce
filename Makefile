# `make run`: set up, fetch the default model, run the example job.  `make test`: set up and run every test (what CI
# runs).  `make test-fast`: the tests not marked `slow` or `model` (no Ray cluster, lm-eval, HF torch reference or
# long end-to-end run; no default model needed), a couple of minutes on two cores.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INPUT ?= examples/prompts.jsonl
OUTPUT ?= out/prompts.parquet
RUN_ARGS ?= --max-tokens 64

.PHONY: setup setup-test run test test-fast test-gpu bench fetch clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	@# A GPU host gets the cuda extra (pycuda builds against the CUDA toolkit), so its first run is the fast one.
	@if [ -z "$(NO_CUDA)" ] && command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install -q -e '.[cuda]' || { echo "make: an NVIDIA GPU is here but pycuda did not install (it needs the CUDA toolkit, nvcc on PATH); fix that, or run on the CPU: make run NO_CUDA=1" >&2; exit 1; }; \
	fi
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

# A GPU host builds every CUDA kernel into the kernel cache here (nvcc processes side by side), so that the first run
# compiles none; again after a kernel source changes. A failure only costs the first run the compile.
$(VENV)/.kernels: $(VENV)/.installed $(wildcard cuda/*.cu cuda/*.cuh) $(wildcard tinyvllm/backends/cuda/*.py)
	@if [ -z "$(NO_CUDA)" ] && command -v nvidia-smi >/dev/null 2>&1 && $(BIN)/python -c "import pycuda" 2>/dev/null; then \
		$(BIN)/tinyvllm build-kernels || echo "make: building the CUDA kernels ahead failed; a run compiles what it needs" >&2; \
	fi
	touch $@

setup: $(VENV)/.installed $(VENV)/.kernels

setup-test: $(VENV)/.installed-test

fetch: setup
	$(BIN)/tinyvllm fetch-default-model

run: fetch
	mkdir -p $(dir $(OUTPUT))
	$(BIN)/tinyvllm run --input $(INPUT) --output $(OUTPUT) $(RUN_ARGS)
	$(BIN)/python examples/evaluate.py $(OUTPUT)

test: setup-test fetch
	$(BIN)/python -m pytest -q

test-fast: setup-test
	$(BIN)/python -m pytest -q -m "not slow and not model"

test-gpu: setup-test
	$(BIN)/python -m pytest -q -m gpu tests/gpu

bench: setup
	$(BIN)/tinyvllm bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) out *.egg-info
