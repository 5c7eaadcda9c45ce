"""A checkpoint's weights, packed the way both backends run them: Q/K/V fused into one matrix (and their biases into
one vector), gate/up into another, so that each is one GEMM instead of three (or two)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from tinyvllm.model.config import ModelConfig


@dataclass
class LayerWeights:
    """One decoder layer; matrices [out, in] as the checkpoint stores them. The optional parts are what the family
    adds to Llama's layer (ModelConfig.attention_bias, ModelConfig.qk_norm); None where it has none."""

    input_norm: np.ndarray  # [hidden]
    post_norm: np.ndarray  # [hidden]
    qkv: np.ndarray  # [(heads + 2 * kv_heads) * head_dim, hidden]: Q rows, then K, then V
    o: np.ndarray  # [hidden, heads * head_dim]
    gate_up: np.ndarray  # [2 * intermediate, hidden]: gate rows, then up
    down: np.ndarray  # [hidden, intermediate]
    qkv_bias: np.ndarray | None = None  # [(heads + 2 * kv_heads) * head_dim], laid out as qkv's rows
    q_norm: np.ndarray | None = None  # [head_dim], the same gain for every query head
    k_norm: np.ndarray | None = None  # [head_dim]


@dataclass
class ModelWeights:
    embed: np.ndarray  # [vocab, hidden]
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [vocab, hidden]; the embedding itself when the model ties them
    layers: Iterator[LayerWeights]  # packed as iterated: one layer's fused copies exist at a time

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed


def pack_weights(weights: Mapping[str, np.ndarray], config: ModelConfig) -> ModelWeights:
    """The weights of a LoadedModel (Hugging Face names), packed for a backend. `weights` may be lazy (a
    TensorSource): each tensor is read when its layer is packed."""

    def layers() -> Iterator[LayerWeights]:
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            layer = LayerWeights(
                input_norm=weights[p + "input_layernorm.weight"],
                post_norm=weights[p + "post_attention_layernorm.weight"],
                qkv=np.concatenate([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                o=weights[p + "self_attn.o_proj.weight"],
                gate_up=np.concatenate([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]),
                down=weights[p + "mlp.down_proj.weight"])
            if config.attention_bias:
                layer.qkv_bias = np.concatenate([weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            if config.qk_norm:
                layer.q_norm = weights[p + "self_attn.q_norm.weight"]
                layer.k_norm = weights[p + "self_attn.k_norm.weight"]
            yield layer

    return ModelWeights(weights["model.embed_tokens.weight"], weights["model.norm.weight"], weights["lm_head.weight"],
                        layers())
