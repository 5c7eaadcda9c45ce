"""The fp8 (e4m3) KV cache on the CPU: the e4m3 twin against torch, the scales, the numpy backend's accuracy with it,
and the setting from the API, the CLI and job files."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from tinyvllm import LLM, SamplingParams
from tinyvllm.backends import create_backend
from tinyvllm.cli import main
from tinyvllm.config import EngineConfig, SettingError
from tinyvllm.model.dtypes import E4M3_VALUES, e4m3_to_f32, f32_to_e4m3
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config
from tinyvllm.model.kv_scales import kv_cache_scales
from tinyvllm.model.loader import load_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def torch_e4m3(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


# ---- the e4m3 twin ---------------------------------------------------------------------------------------------------

def test_e4m3_decodes_every_code_as_torch():
    codes = np.arange(256, dtype=np.uint8)
    ours, theirs = e4m3_to_f32(codes), torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(ours, theirs)  # NaNs (0x7F, 0xFF) in the same places
    finite = ~np.isnan(ours)
    np.testing.assert_array_equal(f32_to_e4m3(ours[finite]), codes[finite])  # every finite code round-trips


def test_e4m3_rounds_like_torch():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-14, 9, 200_000))).astype(np.float32)
    values = np.sort(E4M3_VALUES[~np.isnan(E4M3_VALUES)].astype(np.float64))
    midpoints = ((values[:-1] + values[1:]) / 2).astype(np.float32)  # ties: to the even code
    for sample in (x[np.abs(x) < 448], midpoints, np.float32([0.0, -0.0, 2.0**-10, -(2.0**-10), 2.0**-9 * 1.5])):
        np.testing.assert_array_equal(f32_to_e4m3(sample), torch_e4m3(sample))


def test_e4m3_in_chunks_is_the_whole_array_at_once(monkeypatch):
    """f32_to_e4m3 converts CHUNK values at a time: pieces that end anywhere (997) give the codes of the whole
    array in one piece, in its shape, from a view that is not contiguous too."""
    from tinyvllm.model import dtypes

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((300, 80)) * np.exp2(rng.uniform(-14, 10, (300, 80)))).astype(np.float32)[:, ::3]
    monkeypatch.setattr(dtypes, "CHUNK", 1 << 30)
    whole = f32_to_e4m3(x)
    monkeypatch.setattr(dtypes, "CHUNK", 997)
    pieces = f32_to_e4m3(x)
    assert pieces.shape == x.shape and pieces.dtype == np.uint8
    np.testing.assert_array_equal(pieces, whole)
    np.testing.assert_array_equal(pieces[np.abs(x) < 448], torch_e4m3(x[np.abs(x) < 448]))


def test_e4m3_saturates_like_the_gpu():
    # torch turns values past 464 into NaN; the GPU's satfinite conversion (and so the twin) clamps to +-448
    out = f32_to_e4m3(np.float32([464.0, 1e30, np.inf, -500.0, -np.inf, np.nan]))
    assert list(e4m3_to_f32(out[:5])) == [448.0, 448.0, 448.0, -448.0, -448.0] and out[5] & 0x7F == 0x7F


# ---- the scales ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", [{}, {"architecture": "Qwen2ForCausalLM"}, {"architecture": "Qwen3ForCausalLM"}])
def test_scales_are_powers_of_two_that_never_saturate(family, tmp_path):
    """Cached codes stay below 448 (the bound holds) yet reach its top octaves (the bound is not absurdly loose)."""
    config = tiny_config(**family)
    weights = random_weights(config, seed=3)
    k_scales, v_scales = kv_cache_scales(weights, config)
    assert k_scales.shape == v_scales.shape == (config.num_hidden_layers, config.num_key_value_heads)
    for s in (k_scales, v_scales):
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)
    llm = LLM(save_hf_model_dir(tmp_path, config, weights), backend="numpy", kv_cache_dtype="fp8", max_model_len=256)
    prompt = np.random.default_rng(0).integers(3, config.vocab_size, 200).tolist()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    backend = llm.llm_engine.backend
    for cache in (*backend.k_cache, *backend.v_cache):
        top = e4m3_to_f32(cache & 0x7F).max()
        assert 448 / 16 <= top < 448, top


# ---- the numpy backend with an fp8 cache ----------------------------------------------------------------------------

def prompt_scores(llm: LLM, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """Each prompt token's logprob, whether the top-1 token there was the next prompt token's top-1 in the other run
    (returned as the top-1 ids), and 16 greedy tokens per prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=1), use_tqdm=False)
    logprobs = np.concatenate([[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
                               for o, p in zip(outs, prompts)])
    top1 = np.concatenate([[max(d, key=lambda t: d[t].logprob) for d in o.prompt_logprobs[1:]] for o in outs])
    return logprobs, top1, [o.outputs[0].token_ids for o in outs]


def test_numpy_fp8_cache_stays_close_to_float32(tiny_model_dir):
    """fp8 rounds each K/V entry to 3 mantissa bits (relative error up to 2^-4, 16x bf16's), so prompt logprobs move
    a little; a random model's flat logits make its top-1 token the first thing to flip. Measured on this model (8
    prompts of 48 random tokens): mean |error| 0.038, max 0.23; top-1 agreement 0.91. The bounds leave room for
    another seed; a scale left out of the read, or a code misdecoded, moves logprobs by nats."""
    prompts = [np.random.default_rng(i).integers(3, 512, 48).tolist() for i in range(8)]
    settings = dict(backend="numpy", max_model_len=256, max_num_seqs=8, cpu_kv_cache_gib=0.01)
    exact, fp8 = LLM(tiny_model_dir, **settings), LLM(tiny_model_dir, kv_cache_dtype="fp8", **settings)
    assert fp8.llm_engine.backend.k_cache[0].dtype == np.uint8
    lp_exact, top_exact, greedy_exact = prompt_scores(exact, prompts)
    lp_fp8, top_fp8, greedy_fp8 = prompt_scores(fp8, prompts)
    error = np.abs(lp_fp8 - lp_exact)
    assert 0 < error.mean() < 0.08 and error.max() < 0.5, (error.mean(), error.max())
    assert np.mean(top_fp8 == top_exact) > 0.8  # teacher-forced greedy agreement
    assert sum(a[0] == b[0] for a, b in zip(greedy_fp8, greedy_exact)) >= 6  # first sampled tokens (measured 8/8)


def test_fp8_cache_holds_four_times_the_blocks_of_float32(tiny_model_dir):
    model = load_model(tiny_model_dir)
    blocks = [create_backend(model, EngineConfig(backend="numpy", kv_cache_dtype=dtype, max_model_len=2048,
                                                 cpu_kv_cache_gib=0.001)).init_kv_cache() for dtype in ("auto", "fp8")]
    assert blocks[1] == 4 * blocks[0] > 0


def test_kv_cache_dtype_from_the_api_cli_and_job_files(tiny_model_dir, tmp_path):
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").fp8_kv_cache and not EngineConfig().fp8_kv_cache
    with pytest.raises(SettingError, match="invalid kv_cache_dtype='fp8_e5m2': choose auto, fp8, fp8_e4m3"):
        LLM(tiny_model_dir, backend="numpy", kv_cache_dtype="fp8_e5m2")
    args = ["--input", str(EXAMPLES / "prompts.jsonl"), "--model", str(tiny_model_dir), "--backend", "numpy",
            "--max-tokens", "2", "--quiet"]
    out = tmp_path / "o.parquet"
    result = CliRunner().invoke(main, ["run", "--output", str(out), "--kv-cache-dtype", "fp8", *args])
    assert result.exit_code == 0, result.output
    assert json.loads(pq.read_schema(out).metadata[b"tinyvllm.engine"])["kv_cache_dtype"] == "fp8"
    bad = CliRunner().invoke(main, ["run", "--output", str(out), "--kv-cache-dtype", "int8", *args])
    assert bad.exit_code == 2 and "Invalid value for '--kv-cache-dtype'" in bad.stderr
    job = tmp_path / "job.toml"
    job.write_text(f'input = "{EXAMPLES / "prompts.jsonl"}"\noutput = "{out}"\nmodel = "{tiny_model_dir}"\n'
                   'kv_cache_dtype = "fp8_e5m2"\n')
    from_file = CliRunner().invoke(main, ["job", str(job), "--quiet"])
    assert from_file.exit_code != 0 and len(from_file.stderr.strip().splitlines()) == 1
    assert "invalid kv_cache_dtype='fp8_e5m2'" in from_file.stderr
