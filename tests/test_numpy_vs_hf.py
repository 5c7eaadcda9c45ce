"""The numpy forward against HF transformers (torch CPU, float32) for each family: prefill and paged decode."""

import numpy as np
import pytest
from helpers import hf_model, require

from tinyvllm.config import EngineConfig
from tinyvllm.backends.numpy_backend import NumpyBackend
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.model_inputs import build_batch
from tinyvllm.engine.scheduler import ScheduledStep
from tinyvllm.engine.sequence import Sequence
from tinyvllm.model.dummy import random_weights, tiny_config
from tinyvllm.model.loader import LoadedModel
from tinyvllm.outputs import RequestMetrics
from tinyvllm.sampling_params import SamplingParams

torch = require("torch")
transformers = require("transformers")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
CONFIGS = {
    # GQA ratio 1, head_dim 32, tied
    "mha-hd32-tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32, hidden_size=96,
                          tie_word_embeddings=True),
    # GQA ratio 3, head_dim 32, untied
    "gqa3-hd32-untied": dict(num_attention_heads=6, num_key_value_heads=2, head_dim=32, hidden_size=192,
                             tie_word_embeddings=False),
    # GQA ratio 4, head_dim 64, llama3 rope scaling, tied
    "gqa4-hd64-llama3": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=256,
                             tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),
    # Qwen2/2.5: Q/K/V biases, rope theta 1e6; tied (0.5B-3B) and untied (7B+)
    "qwen2-gqa3-tied": dict(architecture="Qwen2ForCausalLM", num_attention_heads=6, num_key_value_heads=2,
                            head_dim=32, hidden_size=192, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2-gqa2-untied": dict(architecture="Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64, hidden_size=256, tie_word_embeddings=False, rope_theta=1e6),
    # Qwen3: q/k RMSNorm, head_dim decoupled from hidden / heads (64 * 8 != 128)
    "qwen3-gqa4-hd64": dict(architecture="Qwen3ForCausalLM", num_attention_heads=8, num_key_value_heads=2,
                            head_dim=64, hidden_size=128, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3-gqa2-untied": dict(architecture="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, hidden_size=96, tie_word_embeddings=False),
    # Mistral: a window wider than any sequence the engine runs (max_model_len <= window)
    "mistral-gqa4": dict(architecture="MistralForCausalLM", num_attention_heads=8, num_key_value_heads=2,
                         head_dim=32, hidden_size=256, sliding_window=4096, max_position_embeddings=4096),
}


def hf_logits(model, token_ids):
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def rel_err(ours, ref):
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("block_size", [3, 16])
def test_prefill_and_paged_decode_match_hf(name, block_size):
    config = tiny_config(**CONFIGS[name])
    weights = random_weights(config, seed=hash(name) % 1000)
    model = hf_model(config, weights)
    engine_config = EngineConfig(block_size=block_size, num_kv_blocks=64, enable_prefix_caching=False)
    backend = NumpyBackend(LoadedModel(config, weights, None, "dummy"), engine_config)
    bm = BlockManager(engine_config, backend.init_kv_cache())
    rng = np.random.default_rng(0)
    seqs = [Sequence(str(i), i, None, rng.integers(0, config.vocab_size, n).tolist(), SamplingParams(), 0, 0,
                     RequestMetrics(0.0)) for i, n in enumerate([7, 13, 5])]
    for seq in seqs:
        bm.allocate(seq, len(seq))

    # Prefill all three in one packed batch; compare the logits at every position.
    batch = build_batch(ScheduledStep(seqs, [len(s) for s in seqs]), block_size)
    ours = backend.forward(batch, np.arange(len(batch.token_ids)))
    ref = np.concatenate([hf_logits(model, seq.token_ids) for seq in seqs])
    assert rel_err(ours, ref) < 1e-4
    assert ours.dtype == np.float32  # nothing upcast the residual stream (float64 GEMMs are 4x slower)

    # Decode step by step through the paged cache (contexts cross block boundaries unevenly).
    for _ in range(6):
        for seq in seqs:
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(int(rng.integers(config.vocab_size)))
            bm.grow(seq, len(seq))
        batch = build_batch(ScheduledStep(seqs, [1] * len(seqs)), block_size)
        ours = backend.forward(batch, np.arange(len(seqs)))
        ref = np.stack([hf_logits(model, seq.token_ids)[-1] for seq in seqs])
        assert rel_err(ours, ref) < 1e-4
        assert ours.dtype == np.float32
