"""Phi-3 / Phi-3.5-mini / Phi-4-mini on the numpy backend against HF transformers (float32, eager attention):
fused qkv_proj and gate_up_proj, LongRoPE, partial rotary dimensions, the sliding window; and the cuda refusal."""

import numpy as np
import pytest
from helpers import compare_with_hf, require

from tinyvllm.backends.base import check_cuda_kernels
from tinyvllm.model.config import ModelConfig
from tinyvllm.model.dummy import tiny_config
from tinyvllm.model.layout import row_slices, weight_shapes
from tinyvllm.model.rope import layer_ropes

pytestmark = pytest.mark.slow

PHI = dict(architecture="Phi3ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
           tie_word_embeddings=False)


def longrope(config_dims: int, original: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    factors = [(1 + scale * rng.random(config_dims)).astype(np.float32).tolist() for scale in (1, 4)]  # as GGUF has
    return {"rope_type": "longrope", "short_factor": factors[0], "long_factor": factors[1],
            "original_max_position_embeddings": original}


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, n).tolist() for n in lengths]


def test_phi3_fused_tensors_are_in_the_table():
    config = tiny_config(**PHI)
    shapes = weight_shapes(config)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (64 + 2 * 32, 64)
    assert shapes["model.layers.1.mlp.gate_up_proj.weight"] == (2 * 128, 64)
    assert not any("q_proj" in name or "gate_proj" in name for name in shapes)
    assert row_slices(config, "qkv") == [slice(0, 64), slice(64, 96), slice(96, 128)]


def test_phi3_mini_4k_matches_hf_across_its_window(tmp_path):
    """Phi-3-mini-4k's shape: full rotation, no scaling, a sliding window (here 6) the prompts cross."""
    config = tiny_config(**PHI, sliding_window=6, max_position_embeddings=64)
    err = compare_with_hf(tmp_path, config, prompts([5, 19, 11]), block_size=4, max_model_len=64)
    assert err <= 1e-4


def test_phi4_mini_longrope_partial_rotary_matches_hf(tmp_path):
    """Phi-4-mini's: 3/4 of each head rotated, LongRoPE short factors with its attention factor."""
    rotary = int(16 * 0.75)
    config = tiny_config(**{**PHI, "tie_word_embeddings": True}, partial_rotary_factor=0.75,
                         rope_scaling=longrope(rotary // 2, 32), max_position_embeddings=256)
    assert layer_ropes(config)[0].attention_factor > 1  # 256 / 32: sqrt(1 + ln 8 / ln 32)
    err = compare_with_hf(tmp_path, config, prompts([7, 17, 24]), block_size=4, max_model_len=256)
    assert err <= 1e-4


def test_longrope_long_factors_match_hf_past_the_original_length():
    """Positions from original_max_position_embeddings on rotate with the long factors, as HF's rotary embedding
    does for a sequence longer than that."""
    torch, transformers = require("torch"), require("transformers")
    config = tiny_config(**PHI, rope_scaling=longrope(8, 32), max_position_embeddings=128)
    hf_dict = config.to_hf_dict()
    hf_config = transformers.AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_config)
    positions = np.arange(40)
    for seen in (positions[:32], positions):  # HF picks the factors by the longest position it is given
        cos, sin = rotary(torch.zeros(1), torch.tensor(seen)[None])
        ours = layer_ropes(config)[0].cos_sin(seen)
        half = cos.shape[-1] // 2
        np.testing.assert_allclose(ours[0][len(seen) - 8:], cos[0, len(seen) - 8:, :half].numpy(), atol=2e-6)
        np.testing.assert_allclose(ours[1][len(seen) - 8:], sin[0, len(seen) - 8:, :half].numpy(), atol=2e-6)


def test_phi3_hub_config_reads_longrope_and_partial_rotary():
    hub = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=200064, hidden_size=3072,
               intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
               hidden_act="silu", max_position_embeddings=131072, original_max_position_embeddings=4096,
               partial_rotary_factor=0.75, rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=True,
               rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    config = ModelConfig.from_hf_dict(hub)
    assert config.rotary_dim == 96 and config.rope_scaling["original_max_position_embeddings"] == 4096
    assert config.layer_windows == [262144] * 32
    with pytest.raises(ValueError, match="long_factor has 47 entries"):
        ModelConfig.from_hf_dict(dict(hub, rope_scaling={**hub["rope_scaling"], "long_factor": [2.0] * 47}))


def test_cuda_runs_phi3_and_refuses_odd_rotary_dims_in_one_line():
    config = tiny_config(**PHI, partial_rotary_factor=0.5)
    assert config.ops_beyond_llama(2048) == []  # 8 of 16 dims rotated by rope_and_cache
    check_cuda_kernels(tiny_config(**dict(PHI, head_dim=64), partial_rotary_factor=0.5), 2048)  # fused tensors too
    odd = tiny_config(**PHI, partial_rotary_factor=0.25, rope_scaling=longrope(2, 32))
    assert odd.ops_beyond_llama(2048) == ["4 rotary dimensions (not a multiple of 8)"]
    with pytest.raises(ValueError, match="cuda backend has no kernels yet .*4 rotary dimensions.*--backend numpy"):
        check_cuda_kernels(odd, 2048)


def test_fp8_kv_cache_is_refused_for_fused_checkpoints(tmp_path):
    from helpers import llm_for

    from tinyvllm.model.dummy import random_weights, save_hf_model_dir

    config = tiny_config(**PHI)
    model = save_hf_model_dir(tmp_path / "model", config, random_weights(config))
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 is not available for this Phi3ForCausalLM model"):
        llm_for(model, kv_cache_dtype="fp8")
