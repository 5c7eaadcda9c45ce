"""The helpers the test files share: a tiny model and an LLM on it, running the CLI in-process and as a subprocess,
the one-line-error contract, writing JSONL inputs, and `require` for the optional references.

Fixtures built on them are in conftest.py (tiny_model_dir, make_model_dir, reference)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


class Crash(Exception):
    """Stands for a kill at a chosen point of an in-process run."""


def require(module: str) -> ModuleType:
    """Import a module a check needs (a reference: torch, transformers...). Missing, it fails the test when the
    environment variable CI is set (CI installs the test extra, so a missing one is a broken setup, not a reason to
    pass), and skips it elsewhere. Works at module level, like pytest.importorskip."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is required when CI is set: {e}", pytrace=False)
        pytest.skip(f"{module} is not installed: {e}", allow_module_level=True)


def run_device_script(script: Path, args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, list]:
    """Run a bench/*_device.sh script with $PYTHON a stand-in that logs each call's arguments instead of running
    it: (the finished process, each call's arguments as a list)."""
    log, fake = tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    done = subprocess.run(["bash", str(script), *args], env={**os.environ, "PYTHON": str(fake)},
                          cwd=script.parents[1], capture_output=True, text=True, timeout=60)
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


def load_script(path: Path, name: str) -> ModuleType:
    """A script (bench/*.py, a file outside the package) imported as module `name`, run now."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- models ----

def tiny_model(path: Path, *, dtype: str = "float32", shards: int = 1, seed: int = 0, **overrides) -> Path:
    """A tiny random HF model dir at `path`: random_weights(tiny_config(**overrides), seed), stored in `dtype`."""
    from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config

    config = tiny_config(**overrides)
    return save_hf_model_dir(path, config, random_weights(config, seed), dtype=dtype, shards=shards)


def llm_for(model_dir, **kw):
    """An LLM for `model_dir`, on the numpy backend and with max_num_seqs 8 unless given."""
    from tinyvllm import LLM

    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("backend", "numpy")
    return LLM(model_dir, **kw)


# ---- the CLI ----

def run(model, src, out, *args) -> Result:
    """`tinyvllm run` in this process on the numpy backend, quiet; the click Result, whatever happened."""
    from tinyvllm.cli import main

    return CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(out),
                                     "--backend", "numpy", "--quiet", *map(str, args)])


def counted_run(monkeypatch, model, src, out, *args) -> tuple[Result, list[int]]:
    """run(), and the row numbers it computed (rather than kept from committed pieces or a finished output)."""
    from tinyvllm.io import PartsWriter

    added = []
    add = PartsWriter.add

    def counting(self, record):
        added.append(record["row"])
        add(self, record)

    with monkeypatch.context() as m:
        m.setattr(PartsWriter, "add", counting)
        result = run(model, src, out, *args)
    return result, sorted(added)


def ok_result(model, src, out, *args) -> Result:
    """run(), which must succeed and leave no pieces behind; its Result (for any output format)."""
    result = run(model, src, out, *args)
    assert result.exit_code == 0, result.output + str(result.exception)
    assert not Path(str(out) + ".parts").exists()
    return result


def ok_run(model, src, out, *args) -> pa.Table:
    """ok_result() for a Parquet output: the output's table."""
    ok_result(model, src, out, *args)
    return pq.read_table(out)


def one_line_error(result: Result, message: str | None = None, exit_code: int | None = 1) -> str:
    """The contract for bad input: the run failed (with `exit_code`; None: any but 0) on purpose, not by a bug in the
    code (an AssertionError, TypeError or KeyError), with one line on stderr and no traceback, containing
    `message` if given. Returns that line."""
    assert result.exit_code != 0 if exit_code is None else result.exit_code == exit_code, \
        (result.exit_code, result.output)
    assert not isinstance(result.exception, (AssertionError, TypeError, KeyError)), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert message is None or message in lines[0], (message, lines[0])
    return lines[0]


def cli(*args, **kwargs) -> subprocess.Popen:
    """`python -m tinyvllm *args` as a subprocess (a real process: signals, kill -9), stdout and stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "tinyvllm", *map(str, args)], cwd=EXAMPLES.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def job_args(model, src, out) -> list:
    """The arguments of the kill tests' job: small batches and pieces, so that a kill lands between commits."""
    return ["run", "--model", model, "--input", src, "--output", out, "--backend", "numpy", "--max-num-seqs", "4",
            "--piece-rows", "3", "--quiet"]


# ---- inputs ----

def write_jsonl(path: Path, lines: list) -> Path:
    """One line per item: a dict or list as JSON, a str or bytes as it is (a malformed line, a blank one)."""
    def line(item) -> bytes:
        if isinstance(item, bytes):
            return item
        return (item if isinstance(item, str) else json.dumps(item)).encode()

    path.write_bytes(b"".join(line(item) + b"\n" for item in lines))
    return path


def make_input(path: Path, n: int) -> Path:
    """n rows: mostly greedy, some sampled without a seed (reproducible through the job's per-row seeds), every
    tenth malformed and every eleventh refused (error rows among the good ones)."""
    rows = []
    for i in range(n):
        row = {"id": f"r{i}", "prompt": f"Item {i}: " + "abc " * (i % 7), "max_tokens": 4 + i % 13}
        row["temperature"] = 0.8 if i % 5 == 0 else 0
        if i % 11 == 6:
            row["best_of"] = 2
        rows.append("{malformed" if i % 10 == 9 else row)
    return write_jsonl(path, rows)


# ---- the HF transformers reference (torch CPU, float32, eager attention) ----

def hf_model(config, weights):
    """transformers' model of a ModelConfig (built from its config.json dict), holding these weights."""
    import numpy as np

    torch, transformers = require("torch"), require("transformers")
    hf_dict = config.to_hf_dict() | {"pad_token_id": 0}  # Phi-3's default (32000) is past a tiny vocabulary
    hf_config = transformers.AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    hf_config._attn_implementation = "eager"
    model = getattr(transformers, config.architecture)(hf_config).eval()
    state = {name: torch.from_numpy(np.ascontiguousarray(w)) for name, w in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if not config.tie_word_embeddings:
        assert "lm_head.weight" in state
    return model


def hf_logprobs(model, token_ids: list[int]):
    """log_softmax of the HF model's logits at every position of one sequence (float64 [len, vocab])."""
    torch = require("torch")
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def compare_with_hf(tmp_path: Path, config, prompts: list[list[int]], max_tokens: int = 6, seed: int = 0,
                    stats: dict | None = None, logprobs_from: int = 1, **llm_kw) -> float:
    """Run random weights of `config` saved as an HF dir through the numpy engine (greedy, prompt logprobs) and
    through HF: asserts the greedy tokens are HF's, returns the largest prompt-logprob difference (of the prompt
    tokens from `logprobs_from` on: those before may come from the prefix cache). `stats` gets the LLM's stats()."""
    import numpy as np

    from tinyvllm import SamplingParams, TokensPrompt
    from tinyvllm.model.dummy import random_weights, save_hf_model_dir

    weights = random_weights(config, seed)
    model_dir = save_hf_model_dir(tmp_path / "model", config, weights)
    reference = hf_model(config, weights)
    llm = llm_for(model_dir, **llm_kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=0, ignore_eos=True,
                            prompt_logprobs_start=logprobs_from)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    (stats if stats is not None else {}).update(llm.stats())
    llm.close()
    worst = 0.0
    for prompt, out in zip(prompts, outputs):
        ref = hf_logprobs(reference, prompt)
        positions = np.arange(logprobs_from, len(prompt))
        ours = np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in positions])
        worst = max(worst, float(np.max(np.abs(ours - ref[positions - 1, np.array(prompt)[positions]]))))
        greedy = list(prompt)
        for _ in range(max_tokens):
            greedy.append(int(np.argmax(hf_logprobs(reference, greedy)[-1])))
        assert list(out.outputs[0].token_ids) == greedy[len(prompt):], (len(prompt), out.outputs[0].token_ids)
    return worst
