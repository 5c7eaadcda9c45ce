"""SamplingParams(max_tokens=None) is vLLM's "up to the context": the engine generates until max_model_len (or a stop),
per request from its own prompt length; in a job's rows a null max_tokens keeps the job's default."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers import llm_for, ok_run, write_jsonl
from tinyvllm import SamplingParams
from tinyvllm.config import EngineConfig
from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.run import run_job

MAX_MODEL_LEN = 24


def test_none_generates_up_to_the_context(tiny_model_dir):
    llm = llm_for(tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    prompts = [[1, 2, 3], list(range(1, 12)), [5] * (MAX_MODEL_LEN - 1)]
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        assert len(comp.token_ids) == MAX_MODEL_LEN - len(prompt)
        assert comp.finish_reason == "length"


def test_none_still_ends_at_a_stop_token(tiny_model_dir):
    llm = llm_for(tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    free = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=None, ignore_eos=True,
                                                                          temperature=0), use_tqdm=False)
    third = free[0].outputs[0].token_ids[2]
    first_at = free[0].outputs[0].token_ids.index(third)
    stopped = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                           SamplingParams(max_tokens=None, ignore_eos=True, temperature=0, stop_token_ids=[third]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == first_at + 1


def test_none_takes_min_tokens_and_a_bound_is_still_checked():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_a_null_row_max_tokens_keeps_the_jobs_default(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a b c", "max_tokens": None},
                                              {"prompt": "a b c"}, {"prompt": "a b c", "max_tokens": 2}])
    table = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", "--max-tokens", "5", "--ignore-eos")
    assert table.column("completion_tokens").to_pylist() == [5, 5, 2]
    assert [s["max_tokens"] for s in table.column("sampling").to_pylist()] == [5, 5, 2]


def test_a_job_default_of_none_runs_each_row_to_the_context(tiny_model_dir, tmp_path):
    """The sampling column records the limit the engine applied: what the prompt left of the context."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "a b c d e f"},
                                              {"prompt": "a b", "max_tokens": 3}])
    out = tmp_path / "out.parquet"
    cfg = JobConfig(src, out, Path(tiny_model_dir), EngineConfig(backend="numpy", max_model_len=MAX_MODEL_LEN),
                    sampling={"max_tokens": None, "ignore_eos": True, "temperature": 0}, quiet=True)
    run_job(cfg)
    table = pq.read_table(out)
    prompt_tokens = table.column("prompt_tokens").to_pylist()
    generated = table.column("completion_tokens").to_pylist()
    assert generated[:2] == [MAX_MODEL_LEN - p for p in prompt_tokens[:2]] and generated[2] == 3
    assert table.column("finish_reason").to_pylist() == ["length"] * 3
    assert [s["max_tokens"] for s in table.column("sampling").to_pylist()] == generated
