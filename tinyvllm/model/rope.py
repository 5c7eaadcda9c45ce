"""Rotary position embedding frequencies (rotate-half layout): Llama 3's frequency scaling, linear scaling, Phi-3's
LongRoPE, partial rotation, and Gemma 3's second base for its sliding layers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], float64; dimension i of a head rotates by position * inv_freq[i].
    head_dim: the dimensions rotated (all of a head's but where partial_rotary_factor < 1)."""
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = None if rope_scaling is None else rope_scaling.get("rope_type")
    if kind is None:
        return inv_freq
    if kind == "linear":  # positions divided by the factor
        return inv_freq / rope_scaling["factor"]
    if kind == "longrope":  # the short factors: LongRope.long_inv_freq has the others
        return inv_freq / np.asarray(rope_scaling["short_factor"], np.float64)
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
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


@dataclass(frozen=True)
class Rope:
    """One layer's rotation: its frequencies, and LongRoPE's second set with its attention factor."""

    inv_freq: np.ndarray  # [rotary_dim // 2], float64
    long_inv_freq: np.ndarray | None = None  # LongRoPE: the frequencies of positions from original_max on
    original_max: int = 0
    attention_factor: float = 1.0  # cos and sin are multiplied by it (LongRoPE's), as HF does

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin [len(positions), rotary_dim // 2] float32. A LongRoPE position p uses the long factors where
        p >= original_max: what HF's generate uses for the token it appends at p (its sequence is then longer than
        original_max), so a cached key keeps the rotation it was written with."""
        freq = self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            freq = np.where((positions >= self.original_max)[:, None], self.long_inv_freq[None, :], freq)
        angles = positions.astype(np.float64)[:, None] * freq
        f = self.attention_factor
        return (np.cos(angles) * f).astype(np.float32), (np.sin(angles) * f).astype(np.float32)


def layer_ropes(config) -> list[Rope]:
    """Each layer's Rope (a ModelConfig's; the layers that share one share the object)."""
    dim, scaling = config.rotary_dim, config.rope_scaling
    full = Rope(rope_inv_freq(dim, config.rope_theta, scaling))
    if scaling is not None and scaling["rope_type"] == "longrope":
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor", config.max_position_embeddings / original)
        attention = scaling.get("attention_factor")
        if attention is None:  # the LongRoPE paper's, as HF computes it
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        base = rope_inv_freq(dim, config.rope_theta, None)
        full = Rope(full.inv_freq, base / np.asarray(scaling["long_factor"], np.float64), original, attention)
    if config.local_rope_theta is None:
        return [full] * config.num_hidden_layers
    local = Rope(rope_inv_freq(dim, config.local_rope_theta, None))
    types = config.layer_types or ("full_attention",) * config.num_hidden_layers
    return [local if t == "sliding_attention" else full for t in types]


def cos_sin_tables(config, max_positions: int) -> tuple[list[np.ndarray], list[int]]:
    """The rotations of positions 0..max_positions-1 as tables float32 [max_positions, rotary_dim // 2, 2] of
    (cos, sin) pairs, one per distinct Rope of layer_ropes (Gemma 3: its sliding layers' and its global layers'), and
    each layer's table index: what cuda/cache.cu's rope_and_cache reads (its cos_sin)."""
    ropes = layer_ropes(config)
    distinct = list({id(rope): rope for rope in ropes}.values())
    positions = np.arange(max_positions)
    tables = [np.stack(rope.cos_sin(positions), axis=-1) for rope in distinct]
    index = {id(rope): i for i, rope in enumerate(distinct)}
    return tables, [index[id(rope)] for rope in ropes]
