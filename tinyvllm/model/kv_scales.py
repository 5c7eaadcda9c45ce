"""The fp8 KV cache's scales: those an FP8 checkpoint stores (stored_kv_cache_scales), else one power of two per layer
and KV head for K, and one for V, from the weights alone (kv_cache_scales).

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
from tinyvllm.model.layout import fused_parts, layer_parts, layout_of, row_slices

KVCacheScales = tuple[np.ndarray, np.ndarray]  # K's and V's, float32 [num_layers, num_kv_heads] each


def kv_cache_scales(weights: Mapping[str, np.ndarray], config: ModelConfig,
                    stored: KVCacheScales | None = None) -> KVCacheScales:
    """K and V scales, float32 [num_layers, num_kv_heads] each: those an FP8 checkpoint stores (`stored`, from
    stored_kv_cache_scales), else powers of two bounded from the weights (HF names)."""
    if fused_parts(config) or config.norm_offset:
        raise ValueError(f"kv_cache_dtype fp8 is not available for this {config.architecture} model: its K/V scales are "
                         "bounded from separate K and V projections and Llama's RMSNorm gains")
    if stored is not None:
        return stored
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


def kv_scale_names(config: ModelConfig) -> dict[str, tuple[int, str]]:
    """Checkpoint name -> (layer, "k", "v" or "kv": both) of every KV cache scale an FP8 checkpoint may store."""
    layout = layout_of(config)
    names = {}
    for i in range(config.num_hidden_layers):
        prefix = layout.hf_layer.format(i=i)
        for which, suffixes in (("k", layout.hf_k_scale), ("v", layout.hf_v_scale), ("kv", (layout.hf_kv_scale,))):
            names |= {prefix + suffix: (i, which) for suffix in suffixes}
    return names


def stored_kv_cache_scales(tensors: Mapping[str, np.ndarray], config: ModelConfig, source: str) -> KVCacheScales | None:
    """The KV cache scales an FP8 checkpoint stores (`tensors`: those named by kv_scale_names), as vLLM reads them:
    an entry is stored as e4m3(value / scale); one scale per layer, or one per layer and KV head. None when it
    stores none; ValueError (one line) for a scale that is not positive and finite, of another shape, given twice
    with two values, or missing for some layer."""
    if not tensors:
        return None
    layers, kv_heads, names = config.num_hidden_layers, config.num_key_value_heads, kv_scale_names(config)
    scales = {"k": np.full((layers, kv_heads), np.nan, np.float32), "v": np.full((layers, kv_heads), np.nan, np.float32)}
    for name, tensor in sorted(tensors.items()):
        layer, which = names[name]
        value = np.asarray(tensor, np.float32).reshape(-1)
        if value.size not in (1, kv_heads):
            raise ValueError(f"{source}: {name} has {value.size} values: a KV cache scale has 1 or {kv_heads} (one per "
                             "KV head)")
        if not (np.isfinite(value).all() and (value > 0).all()):
            raise ValueError(f"{source}: {name} is not a positive finite scale")
        for target in ("k", "v") if which == "kv" else (which,):
            row = scales[target][layer]
            if not np.isnan(row).all() and not np.array_equal(row, np.broadcast_to(value, row.shape)):
                raise ValueError(f"{source}: layer {layer}'s {target.upper()} cache scale is given twice, with two "
                                 f"values ({name})")
            row[:] = value
    for which, table in scales.items():
        missing = np.isnan(table).any(axis=1)
        if missing.any():
            raise ValueError(f"{source}: the checkpoint stores KV cache scales for some layers only: no "
                             f"{which.upper()} scale for layer {int(np.argmax(missing))}")
    return scales["k"], scales["v"]
