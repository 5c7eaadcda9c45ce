# `make run`: set up, fetch the default model, run the example job.  `make test`: set up and run the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INPUT ?= examples/prompts.jsonl
OUTPUT ?= out/prompts.parquet
RUN_ARGS ?= --max-tokens 64

.PHONY: setup setup-test run test test-gpu bench fetch clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

setup-test: $(VENV)/.installed-test

fetch: setup
	$(BIN)/tinyvllm fetch-default-model

run: fetch
	mkdir -p $(dir $(OUTPUT))
	$(BIN)/tinyvllm run --input $(INPUT) --output $(OUTPUT) $(RUN_ARGS)
	$(BIN)/python examples/evaluate.py $(OUTPUT)

test: setup-test fetch
	$(BIN)/python -m pytest -q

test-gpu: setup-test
	$(BIN)/python -m pytest -q -m gpu tests/gpu

bench: setup
	$(BIN)/tinyvllm bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) out *.egg-info
