"""Rotary position embedding frequencies (rotate-half layout), with Llama 3's frequency scaling."""

from __future__ import annotations

import math

import numpy as np


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], float64; dimension i of a head rotates by position * inv_freq[i]."""
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope_scaling is None:
        return inv_freq
    if rope_scaling.get("rope_type") != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_scaling.get('rope_type')!r}")
    # Llama 3.1/3.2: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = rope_scaling["factor"]
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_len = rope_scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [len(positions), head_dim // 2] as float32."""
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
