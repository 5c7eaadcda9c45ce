"""The fp8 KV cache's scales: one power of two per layer and KV head for K, and one for V, from the weights alone.

A K (or V) entry is stored as e4m3(value / scale) and read back as code * scale. The scale is the smallest power of
two with |value| / scale <= 448 for *every* input, by a bound rather than a sample: the layer's input is RMS-normed,
so its normalized vector n has ||n||_2 <= sqrt(hidden), and a projection row w with the norm's gain g gives
|(w * g) . n| <= ||w * g||_2 sqrt(hidden) (Cauchy-Schwarz; + |bias| for Qwen2; Qwen3's per-head K norm bounds an
entry by sqrt(head_dim) |k_norm gain|). RoPE rotates the pair (j, j + d/2), so a K entry is bounded by the pair's
root sum of squares. The bound is loose (typical entries are ~sqrt(hidden) below it) but costs little: e4m3 is a
float, its 3-bit relative precision holds over 2^-6..448, so entries down to ~2^-6 / sqrt(hidden) of the bound keep it.
In exchange nothing ever saturates, the scales do not depend on which prompts came first (every batch and every
backend quantizes alike), and as powers of two they make scaling exact and fold into the attention kernels' softmax
scale (K) and output (V).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.dtypes import E4M3_MAX
from tinyvllm.model.layout import fused_parts, layer_parts, row_slices


def kv_cache_scales(weights: Mapping[str, np.ndarray], config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """K and V scales, float32 [num_layers, num_kv_heads] each (powers of two), for the weights (HF names)."""
    if fused_parts(config) or config.norm_offset:
        raise ValueError(f"kv_cache_dtype fp8 is not available for this {config.architecture} model: its K/V scales are "
                         "bounded from separate K and V projections and Llama's RMSNorm gains")
    kv_heads, d = config.num_key_value_heads, config.head_dim
    _, k_rows, v_rows = row_slices(config, "qkv")
    radius = np.sqrt(np.float32(config.hidden_size))
    k_scales, v_scales = [], []
    for i in range(config.num_hidden_layers):
        parts = layer_parts(config, i)
        gain = np.asarray(weights[parts["input_norm"][0]], np.float32)
        _, k_name, v_name = parts["qkv"]
        bias = (np.concatenate([np.asarray(weights[name], np.float32) for name in parts["qkv_bias"]])
                if "qkv_bias" in parts else np.zeros(v_rows.stop, np.float32))

        def row_bounds(name: str, rows: slice) -> np.ndarray:  # [kv_heads, d]
            w = np.asarray(weights[name], np.float32) * gain
            return (radius * np.linalg.norm(w, axis=1) + np.abs(bias[rows])).reshape(kv_heads, d)

        if "k_norm" in parts:
            k_norm = np.abs(np.asarray(weights[parts["k_norm"][0]], np.float32))
            k_bound = np.broadcast_to(np.sqrt(np.float32(d)) * k_norm, (kv_heads, d))
        else:
            k_bound = row_bounds(k_name, k_rows)
        half = d // 2
        pair = np.sqrt(k_bound[:, :half] ** 2 + k_bound[:, half:] ** 2)  # RoPE rotates dims j and j + d/2
        k_scales.append(power_of_two_scale(pair.max(axis=1)))
        v_scales.append(power_of_two_scale(row_bounds(v_name, v_rows).max(axis=1)))
    return np.array(k_scales, np.float32), np.array(v_scales, np.float32)


def power_of_two_scale(bound: np.ndarray) -> np.ndarray:
    """The smallest power of two s with bound / s <= 448 (1 for a zero bound), within float32's normal range."""
    exponent = np.ceil(np.log2(np.maximum(bound, 1e-30) / E4M3_MAX))
    return np.exp2(np.clip(exponent, -100, 100)).astype(np.float32)
