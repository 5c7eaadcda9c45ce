"""bench/hf_peers.py's HF models built from tinyvllm's dummy weights on the CPU (tiny configs of the
mixture-of-experts families, and dense ones with a tied head): every parameter holds the bits RandomBf16Weights
makes (bf16: made by torch from the recipe, as on the GPU; float32: the host's), and HF's float32 logits are the
numpy backend's. Skipped without torch and transformers."""

import sys
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.backends.numpy_backend import NumpyBackend
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.model.dtypes import bf16_to_f32
from tinyvllm.model.dummy import RandomBf16Weights, tiny_config
from tinyvllm.model.loader import LoadedModel

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from hf_peers import _hf_tensors, hf_model, random_bf16  # noqa: E402
from test_cuda_model import make_seqs, prefill_batch  # noqa: E402  (host-only helpers)

MOE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           num_hidden_layers=2, vocab_size=300, rms_norm_eps=1e-6, moe_intermediate_size=32)
FAMILIES = {
    # Mixtral's and OLMoE's experts are intermediate_size wide (HF's configs have no moe_intermediate_size)
    "mixtral": dict(MOE, architecture="MixtralForCausalLM", intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2),
    "qwen3-moe": dict(MOE, architecture="Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=4,
                      norm_topk_prob=True, mlp_only_layers=(1,)),
    "olmoe": dict(MOE, architecture="OlmoeForCausalLM", intermediate_size=32, num_experts=8, num_experts_per_tok=4,
                  norm_topk_prob=False),
    # a tied head is the embedding in HF too (one parameter), whichever transformers ties at construction
    "llama-tied": dict(MOE, tie_word_embeddings=True),
    "gemma3-tied": dict(MOE, architecture="Gemma3ForCausalLM", activation="gelu_pytorch_tanh",
                        query_pre_attn_scalar=16, sliding_window=8, layer_types=("sliding_attention",
                                                                                 "full_attention"),
                        rope_theta=1e6, local_rope_theta=10000.0, tie_word_embeddings=True),
}


def dummy(name):
    config = tiny_config(**FAMILIES[name])
    return LoadedModel(config, RandomBf16Weights(config, seed=11), None, f"random:{name}")


def test_random_bf16_in_torch_is_the_hosts():
    weights = dummy("mixtral").weights
    for name in weights:
        bits = random_bf16(weights.recipe(name), "cpu", chunk=1000).view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(bits, weights.stored(name).reshape(-1), err_msg=name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_peer_model_holds_our_weights(name):
    loaded = dummy(name)
    model = hf_model(loaded, "cpu", torch.bfloat16)
    params = dict(model.named_parameters())
    assert ("lm_head.weight" in params) != loaded.config.tie_word_embeddings
    for hf_name, parts in _hf_tensors(loaded, params).items():
        ours = np.concatenate([loaded.weights.stored(p).reshape(-1) for p in parts])
        np.testing.assert_array_equal(params[hf_name].detach().view(torch.int16).numpy().reshape(-1).view(np.uint16),
                                      ours, err_msg=hf_name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_peer_logits_are_the_numpy_backends(name):
    loaded = dummy(name)
    limits = EngineConfig(block_size=16, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                          num_kv_blocks=16)
    weights = {n: bf16_to_f32(loaded.weights.stored(n)) for n in loaded.weights}
    ref = NumpyBackend(LoadedModel(loaded.config, weights, None, loaded.source), limits)
    ref.init_kv_cache()
    prompt = np.random.default_rng(0).integers(0, loaded.config.vocab_size, 20)
    seqs = make_seqs([prompt])
    batch = prefill_batch(seqs, BlockManager(EngineConfig(block_size=16, enable_prefix_caching=False), 16), 16)
    ours = ref.forward(batch, np.arange(len(prompt)))
    model = hf_model(loaded, "cpu", torch.float32)
    with torch.no_grad():
        theirs = model(torch.from_numpy(prompt[None])).logits[0].numpy()
    assert np.linalg.norm(theirs - ours) / np.linalg.norm(ours) < 1e-4


def test_run_peers_on_a_moe_model(tmp_path):
    """bench/hf_peers.py's W1 and W3 through HF's static batches on a tiny Qwen3-MoE (on the CPU, float32): every
    planned token generated, the results written as they come."""
    from hf_peers import run_peers

    from tinyvllm.benchmark import make_workload

    loaded, path = dummy("qwen3-moe"), tmp_path / "peers.json"
    results = run_peers(loaded, ["static"], 0.02, 0, [4], ("W3", "W1"), path)
    for workload in ("W1", "W3"):
        planned = sum(r.max_tokens for r in make_workload(workload, loaded.config.vocab_size, 0.02, 0))
        assert results[f"{workload}/static"]["output_tokens"] == planned, results
    assert "ms_per_token" in results["W3/static"] and path.exists()
