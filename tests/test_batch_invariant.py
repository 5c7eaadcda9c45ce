"""batch_invariant=True on the numpy backend: a probe request's tokens and logprobs (prompt logprobs too) are bitwise
the same alone, in a batch, mixed with 40 others under chunked prefill, under preemption, with prefix-cache hits and
misses, and with n > 1; greedy and seeded. Its surfaces: the CLI flag, the job key, the output's metadata, and a
resumed job equal to an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import Crash, llm_for, ok_run, one_line_error, run, write_jsonl

from tinyvllm import SamplingParams
from tinyvllm.backends.host_weight import HostWeight, linear
from tinyvllm.cli import main
from tinyvllm.io import PartsWriter

PROBES = ["Hello there", "The quick brown fox jumps over", "a", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
          "émoji 🙂 and 漢字", "Once upon a time, in a land far away, there lived", "x y z", "tinyvllm"]
OTHERS = [f"filler {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 5) for i in range(40)]


def probe_params(seeded: bool, n: int = 1) -> list[SamplingParams]:
    common = {"max_tokens": 12, "ignore_eos": True, "logprobs": 3, "prompt_logprobs": 2, "n": n}
    if not seeded:
        return [SamplingParams(temperature=0, **common) for _ in PROBES]
    return [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=100 + i, **common) for i in range(len(PROBES))]


def signature(output) -> tuple:
    """Everything a probe's output holds that batching could change, as exact floats."""
    prompt = tuple(None if e is None else tuple(sorted((t, lp.logprob) for t, lp in e.items()))
                   for e in output.prompt_logprobs)
    completions = tuple((tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in e.items()))
                                                   for e in c.logprobs)) for c in output.outputs)
    return prompt, completions


def layouts(model_dir, seeded: bool, invariant: bool, n: int = 1, **engine) -> dict[str, list[tuple]]:
    """The probes' signatures in each layout; engine: more LLM(...) settings (backend, kv_cache_dtype) for all, each
    engine closed before the next starts (a GPU's memory back)."""
    params = probe_params(seeded, n)
    others = SamplingParams(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True)

    def llm(**kw):
        return llm_for(model_dir, batch_invariant=invariant, **{**engine, **kw})

    out = {}
    with llm(max_num_seqs=1) as solo:
        out["alone"] = [signature(solo.generate(p, sp)[0]) for p, sp in zip(PROBES, params)]
    with llm() as batched:
        out["batch of 8"] = [signature(o) for o in batched.generate(PROBES, params)]
    # mixed with 40 others, prompts chunked: a step of 24 tokens splits most prompts over several steps
    with llm(max_num_seqs=16, max_num_batched_tokens=24) as mixed:
        prompts = OTHERS[:20] + PROBES + OTHERS[20:]
        results = mixed.generate(prompts, [others] * 20 + params + [others] * 20)
    out["mixed, chunked"] = [signature(o) for o in results[20:20 + len(PROBES)]]
    with llm(max_num_seqs=8, num_kv_blocks=24, block_size=4) as tight:
        results = tight.generate(PROBES[::-1] + [f"filler {i}" for i in range(8)], params[::-1] + [others] * 8)
        assert tight.llm_engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    out["preempted"] = [signature(o) for o in results[:len(PROBES)][::-1]]
    # prefix-cache hits: the probes again on an engine that has already run them (and others sharing prefixes)
    with llm() as cached:
        cached.generate([p + " and more" for p in PROBES], params)
        cached.generate(PROBES, params)
        out["prefix-cache hits"] = [signature(o) for o in cached.generate(PROBES, params)]
    with llm(enable_prefix_caching=False) as uncached:
        out["no prefix cache"] = [signature(o) for o in uncached.generate(PROBES, params)]
    return out


LONG_PROBE = "Count with me: " + " ".join(str(i) for i in range(60))  # well over 128 tokens


def long_layouts(model_dir, invariant: bool, **engine) -> dict[str, list[tuple]]:
    """A probe whose context spans several of the cuda attention's 64-key chunks in each layout: alone (batch 1:
    cuda decodes its chunks in the most parts), prefilled in 24-token steps that start mid-chunk among 199 short
    others (decode steps of up to 200 rows: fewer parts, or one), and prefilled from the prefix cache."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    others = SamplingParams(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True)

    def llm(**kw):
        return llm_for(model_dir, batch_invariant=invariant, **{**engine, **kw})

    out = {}
    with llm(max_num_seqs=1) as solo:
        out["alone"] = [signature(solo.generate(LONG_PROBE, params)[0])]
        assert len(solo.generate(LONG_PROBE, params)[0].prompt_token_ids) > 128
    with llm(max_num_seqs=200, max_num_batched_tokens=24) as mixed:
        prompts = [f"short {i}" for i in range(100)] + [LONG_PROBE] + [f"short {i}" for i in range(100, 199)]
        results = mixed.generate(prompts, [others] * 100 + [params] + [others] * 99)
        out["among 199, chunked"] = [signature(results[100])]
    with llm() as cached:
        cached.generate(LONG_PROBE, params)
        out["prefix-cache hit"] = [signature(cached.generate(LONG_PROBE, params)[0])]
    return out


def differing(sigs: dict[str, list[tuple]]) -> list[str]:
    base = sigs["alone"]
    return [f"{name}: probe {i}" for name, got in sigs.items() for i, (a, b) in enumerate(zip(base, got)) if a != b]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_probes_bitwise_equal_in_every_layout(tiny_model_dir, seeded):
    assert differing(layouts(tiny_model_dir, seeded, invariant=True)) == []


def test_probes_with_n_2_bitwise_equal(tiny_model_dir):
    assert differing(layouts(tiny_model_dir, seeded=True, invariant=True, n=2)) == []


def test_a_long_context_bitwise_equal_in_every_layout(tiny_model_dir):
    assert differing(long_layouts(tiny_model_dir, invariant=True)) == []


def test_without_it_some_layout_differs(tiny_model_dir):
    """What the setting is for: off, batching changes some probe's logprobs (BLAS picks its path by the batch)."""
    assert differing(layouts(tiny_model_dir, seeded=False, invariant=False)) != []


def test_product_rows_independent_of_the_batch():
    rng = np.random.default_rng(0)
    w = HostWeight(rng.standard_normal((96, 80), dtype=np.float32))
    row = rng.standard_normal(96, dtype=np.float32)
    alone = linear(row[None], w, invariant=True)[0]
    for t in (1, 2, 7, 16, 17, 40):
        x = rng.standard_normal((t, 96), dtype=np.float32)
        for pos in {0, t // 2, t - 1}:
            x[pos] = row
            assert np.array_equal(linear(x, w, invariant=True)[pos], alone)
    # every place in a 16-row batch (a BLAS tile adds its first rows in another order than the rest), and a batch
    # whose rows start 4 bytes past where the others did
    x = rng.standard_normal((17, 96), dtype=np.float32).ravel()[1:16 * 96 + 1].reshape(16, 96)
    for pos in range(16):
        moved = x.copy() if pos % 2 else x
        moved[pos] = row
        assert np.array_equal(linear(moved, w, invariant=True)[pos], alone), pos
    x = rng.standard_normal((5, 96), dtype=np.float32)
    np.testing.assert_allclose(linear(x, w, invariant=True), x @ w.data, rtol=1e-5, atol=1e-5)


RESULTS = ["row", "completion", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs"]


def job_rows(tmp_path) -> Path:
    rows = [{"prompt": p, "max_tokens": 6, "temperature": 0.8, "logprobs": 2, "prompt_logprobs": 1}
            for p in PROBES + OTHERS[:16]]
    return write_jsonl(tmp_path / "in.jsonl", rows)


def test_cli_flag_job_key_and_metadata(tiny_model_dir, tmp_path):
    src = job_rows(tmp_path)
    by_flag = ok_run(tiny_model_dir, src, tmp_path / "flag.parquet", "--batch-invariant")
    job = tmp_path / "job.toml"
    job.write_text(f'model = "{tiny_model_dir}"\nbackend = "numpy"\ninput = "{src}"\n'
                   f'output = "{tmp_path / "key.parquet"}"\nbatch_invariant = true\nmax_num_seqs = 3\nquiet = true\n')
    result = CliRunner().invoke(main, ["job", str(job)])
    assert result.exit_code == 0, result.output
    by_key = pq.read_table(tmp_path / "key.parquet")
    for table in (by_flag, by_key):
        meta = table.schema.metadata
        assert json.loads(meta[b"tinyvllm.engine"])["batch_invariant"] is True
        assert json.loads(meta[b"tinyvllm.job"])["batch_invariant"] is True
    # 8 sequences a step against 3: the same rows, bitwise
    assert by_flag.select(RESULTS).to_pylist() == by_key.select(RESULTS).to_pylist()
    off = ok_run(tiny_model_dir, src, tmp_path / "off.parquet")
    assert "batch_invariant" not in json.loads(off.schema.metadata[b"tinyvllm.job"])
    job.write_text(job.read_text().replace("batch_invariant = true", 'batch_invariant = "yes"'))
    one_line_error(CliRunner().invoke(main, ["job", str(job)]), "batch_invariant", exit_code=2)


def test_resumed_job_equals_uninterrupted(tiny_model_dir, tmp_path, monkeypatch):
    src = job_rows(tmp_path)
    args = ("--batch-invariant", "--piece-rows", "4")
    whole = ok_run(tiny_model_dir, src, tmp_path / "whole.parquet", *args)
    out = tmp_path / "resumed.parquet"
    commit, done = PartsWriter._commit_piece, []

    def crash_after_two(self, records, seq):
        if len(done) == 2:
            raise Crash
        commit(self, records, seq)
        done.append(seq)

    with monkeypatch.context() as m:
        m.setattr(PartsWriter, "_commit_piece", crash_after_two)
        assert isinstance(run(tiny_model_dir, src, out, *args, "--max-num-seqs", "3").exception, Crash)
    resumed = ok_run(tiny_model_dir, src, out, *args, "--max-num-seqs", "5")
    assert resumed.select(RESULTS).to_pylist() == whole.select(RESULTS).to_pylist()
