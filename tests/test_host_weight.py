"""HostWeight and linear: the numpy backend's weights, and its layers as typed LayerWeights."""

import numpy as np
import pytest

from tinyvllm.backends import host_weight
from tinyvllm.backends.host_weight import HostWeight, linear
from tinyvllm.backends.numpy_backend import NumpyBackend
from tinyvllm.config import EngineConfig
from tinyvllm.model.dummy import random_weights, tiny_config
from tinyvllm.model.loader import LoadedModel
from tinyvllm.model.weights import LayerWeights, pack_weights


def test_float32_linear_is_the_plain_product():
    rng = np.random.default_rng(0)
    w, x, bias = (rng.standard_normal(s, dtype=np.float32) for s in ((24, 16), (5, 16), (24,)))
    weight = HostWeight.from_rows(w)
    assert weight.shape == (16, 24) and weight.dtype == "float32" and weight.scale is None
    assert weight.data.flags.c_contiguous
    want = x @ np.ascontiguousarray(w.T)
    np.testing.assert_array_equal(linear(x, weight), want)
    want += bias
    np.testing.assert_array_equal(linear(x, weight, bias), want)


def test_weight_dtype_and_scale_are_checked():
    data = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="unsupported weight dtype 'float8_e4m3'"):
        HostWeight(data, "float8_e4m3")
    with pytest.raises(ValueError, match=r"scale of shape \(4,\)"):
        HostWeight(data, scale=np.ones(4, np.float32))


def test_linear_dispatches_on_the_dtype(monkeypatch):
    """An encoding is one entry of MATMULS: here a per-output-channel scaled one."""
    monkeypatch.setitem(host_weight.MATMULS, "scaled", lambda x, w, invariant: (x @ w.data) * w.scale)
    w = HostWeight(np.eye(3, dtype=np.float32), "scaled", scale=np.array([1, 2, 4], np.float32))
    np.testing.assert_array_equal(linear(np.ones((2, 3), np.float32), w, np.ones(3, np.float32)),
                                  [[2, 3, 5], [2, 3, 5]])


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_numpy_backend_holds_typed_layers(architecture):
    config = tiny_config(architecture=architecture)
    weights = random_weights(config, 2)
    backend = NumpyBackend(LoadedModel(config, weights, None, "dummy"), EngineConfig(max_model_len=64))
    assert len(backend.layers) == config.num_hidden_layers
    for layer, packed in zip(backend.layers, pack_weights(weights, config).layers):
        assert isinstance(layer, LayerWeights)
        for name in ("qkv", "o", "gate_up", "down"):
            matrix = getattr(layer, name)
            assert isinstance(matrix, HostWeight) and matrix.dtype == "float32"
            np.testing.assert_array_equal(matrix.data, getattr(packed, name).T)
        np.testing.assert_array_equal(layer.input_norm, packed.input_norm)
        assert (layer.qkv_bias is None) == (architecture != "Qwen2ForCausalLM")
        assert (layer.q_norm is None) == (layer.k_norm is None) == (architecture != "Qwen3ForCausalLM")
    assert isinstance(backend.lm_head, HostWeight) and backend.lm_head.shape == (config.hidden_size, config.vocab_size)
