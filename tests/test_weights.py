"""pack_weights: the fused matrices both backends run."""

import numpy as np

from tinyvllm.model.dummy import random_weights, tiny_config
from tinyvllm.model.weights import pack_weights


def test_pack_fuses_qkv_and_gate_up_layer_by_layer():
    config = tiny_config()
    weights = random_weights(config, 0)
    packed = pack_weights(weights, config)
    assert packed.embed is weights["model.embed_tokens.weight"] and not packed.tied
    layers = list(packed.layers)
    assert len(layers) == config.num_hidden_layers
    for i, layer in enumerate(layers):
        p = f"model.layers.{i}."
        q, k, v = (weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        kv_rows = config.num_key_value_heads * config.head_dim
        assert layer.qkv.shape == (config.num_attention_heads * config.head_dim + 2 * kv_rows, config.hidden_size)
        np.testing.assert_array_equal(layer.qkv, np.concatenate([q, k, v]))
        np.testing.assert_array_equal(layer.gate_up[: config.intermediate_size], weights[p + "mlp.gate_proj.weight"])
        np.testing.assert_array_equal(layer.gate_up[config.intermediate_size:], weights[p + "mlp.up_proj.weight"])
        assert layer.down is weights[p + "mlp.down_proj.weight"] and layer.o is weights[p + "self_attn.o_proj.weight"]
        assert layer.post_norm is weights[p + "post_attention_layernorm.weight"]


def test_tied_lm_head_is_the_embedding():
    config = tiny_config(tie_word_embeddings=True)
    weights = random_weights(config, 0)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    assert pack_weights(weights, config).tied


def test_family_parts_are_packed():
    qwen2 = tiny_config(architecture="Qwen2ForCausalLM")
    weights = random_weights(qwen2, 1)
    for i, layer in enumerate(pack_weights(weights, qwen2).layers):
        p = f"model.layers.{i}.self_attn."
        np.testing.assert_array_equal(layer.qkv_bias, np.concatenate([weights[p + f"{n}_proj.bias"] for n in "qkv"]))
        assert layer.q_norm is None and layer.k_norm is None
    qwen3 = tiny_config(architecture="Qwen3ForCausalLM")
    weights = random_weights(qwen3, 1)
    for i, layer in enumerate(pack_weights(weights, qwen3).layers):
        p = f"model.layers.{i}.self_attn."
        assert layer.q_norm is weights[p + "q_norm.weight"] and layer.k_norm is weights[p + "k_norm.weight"]
        assert layer.q_norm.shape == (qwen3.head_dim,) and layer.qkv_bias is None
