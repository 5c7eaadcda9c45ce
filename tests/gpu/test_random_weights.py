"""Dummy weights made on the GPU (cuda/random.cu random_bf16) against their host twin (RandomBf16Weights.stored):
every tensor of a small MoE config bit for bit, a tensor larger than the kernel's grid, and the cuda backend built
on RandomBf16Weights (made on the device) against one built on the same weights as host arrays (streamed)."""

import numpy as np
import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.model.dtypes import bf16_to_f32
from tinyvllm.model.dummy import RandomBf16Weights, tiny_config
from tinyvllm.model.loader import LoadedModel

from test_cuda_model import gpu_logits, make_seqs, prefill_batch
from test_kernels import Gpu

pytestmark = pytest.mark.gpu

CONFIG = tiny_config(architecture="Qwen3MoeForCausalLM", hidden_size=256, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=128)


def made_on_gpu(cuda, ops, weights, name):
    gpu, recipe = Gpu(cuda), weights.recipe(name)
    out = gpu.poisoned((recipe.size,), np.uint16)
    ops.random_bf16(out, gpu.put(recipe.table), recipe.size, recipe.k1, recipe.k2)
    return gpu.get(out, (recipe.size,), np.uint16)


def test_random_bf16_is_the_hosts(cuda, ops):
    weights = RandomBf16Weights(CONFIG, seed=3)
    for name in weights:
        np.testing.assert_array_equal(made_on_gpu(cuda, ops, weights, name), weights.stored(name).reshape(-1),
                                      err_msg=name)


def test_random_bf16_past_the_grid(cuda, ops):
    """More values than 2^16 blocks of 256 threads cover in one pass: the grid-stride loop."""
    config = tiny_config(vocab_size=300_000, hidden_size=64)  # an embedding of 19.2 M values
    weights = RandomBf16Weights(config, seed=1)
    np.testing.assert_array_equal(made_on_gpu(cuda, ops, weights, "model.embed_tokens.weight"),
                                  weights.stored("model.embed_tokens.weight").reshape(-1))


def test_backend_on_random_weights_is_the_streamed_one(cuda, cuda_backend):
    lazy = RandomBf16Weights(CONFIG, seed=5)
    limits = EngineConfig(block_size=16, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256,
                          num_kv_blocks=32)
    logits = []
    for weights in (lazy, {name: bf16_to_f32(lazy.stored(name)) for name in lazy}):
        backend = cuda_backend(LoadedModel(CONFIG, weights, None, "random"), limits)
        backend.init_kv_cache()
        seqs = make_seqs([np.arange(1, 40) * 7 % CONFIG.vocab_size, np.arange(5, 20)])
        backend.execute(prefill_batch(seqs, BlockManager(EngineConfig(block_size=16, enable_prefix_caching=False),
                                                         32), 16))
        logits.append(gpu_logits(cuda, backend, 2))
        backend.close()
    np.testing.assert_array_equal(*logits)
