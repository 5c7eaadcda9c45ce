"""Sliding-window attention on the numpy backend against HF transformers (float32, eager attention): Mistral's window
on every layer, Qwen2's from max_window_layers on; prompts and decodes that cross the window, through chunked
prefill and through prefix-cached blocks."""

import numpy as np
import pytest
from helpers import compare_with_hf

from tinyvllm.model.dummy import tiny_config

pytestmark = pytest.mark.slow

MISTRAL = dict(architecture="MistralForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               hidden_size=64, sliding_window=5, max_position_embeddings=128)
QWEN2 = dict(architecture="Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             hidden_size=64, sliding_window=4, layer_types=("full_attention", "sliding_attention"), rope_theta=1e6)


def prompts(lengths, seed=0, prefix=()):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(3, 512, n).tolist() for n in lengths]


@pytest.mark.parametrize("engine", [
    dict(enable_chunked_prefill=False),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=8),  # a 27-token prompt over 4 steps, decodes between
])
def test_mistral_window_matches_hf(tmp_path, engine):
    config = tiny_config(**MISTRAL)
    err = compare_with_hf(tmp_path, config, prompts([3, 12, 27]), max_tokens=8, block_size=4, max_model_len=64,
                          enable_prefix_caching=False, **engine)
    assert err <= 1e-4


def test_prefix_cached_blocks_under_a_window_match_hf(tmp_path):
    """A cached block holds the same K and V whatever window its readers apply: prompts sharing a 16-token prefix
    (4 blocks, past the window) reuse it and still match HF."""
    config = tiny_config(**MISTRAL)
    shared = prompts([16], seed=5)[0]
    stats = {}
    err = compare_with_hf(tmp_path, config, prompts([2, 9, 3], prefix=shared), block_size=4, max_model_len=64,
                          enable_prefix_caching=True, max_num_seqs=1, stats=stats,
                          logprobs_from=len(shared) + 1)
    assert err <= 1e-4
    assert stats["prefix_cache_hit_rate"] > 0.4  # the later prompts found the prefix's blocks


def test_qwen2_sliding_layers_match_hf(tmp_path):
    """Qwen2 with use_sliding_window: the layers from max_window_layers on slide, those before see everything."""
    config = tiny_config(**QWEN2)
    assert config.layer_windows == [None, 4]
    err = compare_with_hf(tmp_path, config, prompts([6, 15, 21]), block_size=3, max_model_len=64)
    assert err <= 1e-4
