"""A checkpoint's weights, packed the way both backends run them: Q/K/V fused into one matrix (and their biases into
one vector), gate/up into another, so that each is one GEMM instead of three (or two). What each packed tensor
stacks is model/layout.py's table."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.fp8 import Fp8Rows
from tinyvllm.model.layout import layer_parts, model_parts, stacked_experts

__all__ = ["LayerWeights", "LazyWeights", "ModelWeights", "layer_parts", "pack_weights"]

# How a backend holds a layer's matrices: numpy arrays [out, in] as packed here; the numpy backend's HostWeight
Matrix = TypeVar("Matrix")


class LazyWeights(Mapping):
    """Tensors by HF name, each read from the model file (as float32) only when asked for: a checkpoint's weights
    pass through the host one at a time, on their way into a backend."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading it (KeyError for a name it does not have)."""

    def stored(self, name: str) -> np.ndarray:
        """The tensor as its source holds it: float32, float16, or bfloat16 as uint16 bit patterns (which the CUDA
        backend uploads as they are, with no float32 copy)."""
        return self[name]

    def __contains__(self, name: object) -> bool:
        # Mapping's own `in` reads the tensor (self[name]): checking a checkpoint's names read all of it.
        try:
            self.shape(name)
        except KeyError:
            return False
        return True


@dataclass
class LayerWeights(Generic[Matrix]):
    """One decoder layer; as packed, matrices [out, in] as the checkpoint stores them. The optional parts are what
    the family adds to Llama's layer (ModelConfig.attention_bias, qk_norm, sandwich_norms) and an expert layer's
    router and experts in place of its dense MLP (ModelConfig.moe_layer); None where it has none."""

    input_norm: np.ndarray  # [hidden]
    post_norm: np.ndarray  # [hidden]
    qkv: Matrix  # [(heads + 2 * kv_heads) * head_dim, hidden]: Q rows, then K, then V
    o: Matrix  # [hidden, heads * head_dim]
    gate_up: Matrix | None = None  # [2 * intermediate, hidden]: gate rows, then up; None in an expert layer
    down: Matrix | None = None  # [hidden, intermediate]
    qkv_bias: np.ndarray | None = None  # [(heads + 2 * kv_heads) * head_dim], laid out as qkv's rows
    q_norm: np.ndarray | None = None  # [head_dim], the same gain for every query head
    k_norm: np.ndarray | None = None  # [head_dim]
    attn_out_norm: np.ndarray | None = None  # [hidden]: of the attention's output (ModelConfig.sandwich_norms)
    mlp_out_norm: np.ndarray | None = None  # [hidden]: of the MLP's output
    # an expert layer's MLP (ModelConfig.moe_layer): the router and the experts stacked (model/layout.py)
    router: Matrix | None = None  # [num_experts, hidden]
    experts_gate_up: Matrix | None = None  # [num_experts, 2 * moe_intermediate, hidden]: each expert's gate, then up
    experts_down: Matrix | None = None  # [num_experts, hidden, moe_intermediate]


@dataclass
class ModelWeights:
    embed: np.ndarray  # [vocab, hidden]
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [vocab, hidden]; the embedding itself when the model ties them
    layers: Iterator[LayerWeights]  # packed as iterated: one layer's fused copies exist at a time

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed


def pack_weights(weights: Mapping[str, np.ndarray], config: ModelConfig, get: Callable[[str], object] | None = None,
                 join: Callable[[list], object] | None = None) -> ModelWeights:
    """The weights of a LoadedModel (Hugging Face names), packed for a backend, each tensor as `get(name)` gives it
    (default: weights[name], float32) and the parts of a packed tensor joined by `join` (default: their rows
    concatenated; model/fp8.py's stack_rows for e4m3 weights). A lazy `weights` (SafetensorsWeights) is read layer
    by layer as the layers are iterated."""
    get = get or weights.__getitem__

    def stack(names: list[str]) -> np.ndarray:
        if join is not None:
            try:
                return join([get(name) for name in names])
            except ValueError as e:  # parts that cannot be one tensor: say which
                raise ValueError(f"{names[0]} and the tensors packed with it: {e}") from None
        return get(names[0]) if len(names) == 1 else np.concatenate([get(name) for name in names])

    experts = stacked_experts(config)

    def pack(field: str, names: list[str]) -> np.ndarray:
        packed = stack(names)
        if field not in experts:
            return packed
        if isinstance(packed, Fp8Rows):
            return packed.by_expert(config.num_experts)
        return packed.reshape(config.num_experts, -1, packed.shape[-1])

    def layers() -> Iterator[LayerWeights]:
        for i in range(config.num_hidden_layers):
            yield LayerWeights(**{field: pack(field, names) for field, names in layer_parts(config, i).items()})

    parts = model_parts(config)
    embed = stack(parts["embed"])
    lm_head = embed if config.tie_word_embeddings else stack(parts["lm_head"])
    return ModelWeights(embed, stack(parts["final_norm"]), lm_head, layers())
