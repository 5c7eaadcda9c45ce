"""The CUDA backend against the numpy backend on the mixture-of-experts families (Qwen3-MoE with a dense layer,
Mixtral, OLMoE's unnormalized top-8 and whole-projection q/k norms) and on a Qwen3-30B-A3B-shaped model with two
layers, on random weights rounded to bf16 so that both sides compute with the same weights: prefill chunks take
the grouped GEMM, decode steps the GEMV kernels (ops.moe_uses_gemv), in CUDA graphs. REPORT lines carry the
measured numbers (pytest -s)."""

from dataclasses import replace

import numpy as np
import pytest

from tinyvllm.backends.cuda.ops import moe_uses_gemv
from tinyvllm.backends.numpy_backend import NumpyBackend
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.model.dummy import qwen3_30b_a3b_config, tiny_config

from test_cuda_model import bf16_model, decode_batch, gpu_logits, make_seqs, prefill_batch, rel_err

pytestmark = pytest.mark.gpu

MOE = dict(hidden_size=1024, num_attention_heads=16, rms_norm_eps=1e-6, rope_theta=1e6)
FAMILIES = {
    # per-head q/k norms, renormalized top-8 of 32, layer 1 dense (mlp_only_layers)
    "qwen3-moe": dict(MOE, architecture="Qwen3MoeForCausalLM", num_key_value_heads=4, head_dim=128,
                      intermediate_size=1536, num_experts=32, num_experts_per_tok=8, norm_topk_prob=True,
                      moe_intermediate_size=256, mlp_only_layers=(1,)),
    # renormalized top-2 of 8, the experts as wide as Mixtral's ratio to hidden
    "mixtral": dict(MOE, architecture="MixtralForCausalLM", num_key_value_heads=8, head_dim=64,
                    intermediate_size=3584, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=3584),
    # unnormalized top-8 of 32, q/k norms over each token's whole Q and K
    "olmoe": dict(MOE, architecture="OlmoeForCausalLM", num_key_value_heads=16, head_dim=64, intermediate_size=512,
                  num_experts=32, num_experts_per_tok=8, norm_topk_prob=False, moe_intermediate_size=512),
}
TOLERANCE = 3e-2  # bf16 against float32; a router's near-tie can pick another expert for a token on one side

# 64-token prefill chunks: the 100-token prompt is computed in two
LIMITS = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=64)


def compare(cuda, cuda_backend, config, limits, name):
    """Prefill three prompts, then 5 decode steps fed the numpy backend's greedy tokens: the logits' relative errors
    and the greedy agreement, reported; the errors within TOLERANCE."""
    model = bf16_model(config, seed=3)
    ours, ref = cuda_backend(model, limits), NumpyBackend(model, limits)
    for backend in (ours, ref):
        backend.init_kv_cache()
    rng = np.random.default_rng(1)
    seqs = make_seqs([rng.integers(0, config.vocab_size, n) for n in (9, 100, 30)])
    bm = BlockManager(EngineConfig(block_size=16, enable_prefix_caching=False), 64)
    batch = prefill_batch(seqs, bm, 16)
    errors, agree, tokens = [], [], None
    for step in range(6):
        if step:
            batch = decode_batch(seqs, tokens, bm, 16)
        got = ours.execute(batch)
        ref_logits = ref.forward(batch, batch.query_start_loc[1:] - 1)
        errors.append(rel_err(gpu_logits(cuda, ours, 3), ref_logits))
        tokens = ref_logits.argmax(-1)
        agree.append(np.mean(got.last_token_ids == tokens))
    print(f"REPORT moe {name}: logits rel err prefill {errors[0]:.2e}, decode max {max(errors[1:]):.2e}; "
          f"greedy agree {np.mean(agree):.3f}")
    ours.close()
    assert max(errors) < TOLERANCE


@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_family_logits_match_numpy(cuda, cuda_backend, name):
    config = replace(tiny_config(**FAMILIES[name]), vocab_size=8192, num_hidden_layers=2)
    k, e = config.num_experts_per_tok, config.num_experts
    assert not moe_uses_gemv(LIMITS.max_num_batched_tokens, k, e) and moe_uses_gemv(4, k, e)  # both paths run
    compare(cuda, cuda_backend, config, LIMITS, name)


def test_qwen3_30b_a3b_shaped_logits_match_numpy(cuda, cuda_backend):
    """Qwen3-30B-A3B's widths and 128 experts (top 8), two layers; 256-token steps: the 139-token prefill in one
    chunk takes the grouped GEMM (a 64-token chunk would still take the GEMV kernels at 128 experts)."""
    config = replace(qwen3_30b_a3b_config(), vocab_size=8192, num_hidden_layers=2)
    limits = replace(LIMITS, max_num_batched_tokens=256)
    assert not moe_uses_gemv(139, 8, 128) and moe_uses_gemv(4, 8, 128)
    compare(cuda, cuda_backend, config, limits, "qwen3-30b-a3b x2 layers")
