"""A linear layer's weight as the numpy backend holds it: its values in an encoding (a dtype), with the scales that
encoding needs, and the matrix product that reads that encoding. The host twin of a device tensor.

float32 is the one encoding today: `data` is the matrix itself and there is no scale. An encoding with per-output-
channel scales (e4m3 codes, say) is one more entry of MATMULS that multiplies the product by `scale`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HostWeight:
    data: np.ndarray  # [in, out], so that a linear layer is x @ data: the values (float32) or their codes
    dtype: str = "float32"  # the encoding of `data`: a key of MATMULS
    scale: np.ndarray | None = None  # float32 [out]: what each output column's product is multiplied by

    def __post_init__(self) -> None:
        if self.dtype not in MATMULS:
            raise ValueError(f"unsupported weight dtype {self.dtype!r}: supported are {', '.join(MATMULS)}")
        if self.scale is not None and self.scale.shape != self.data.shape[-1:]:
            raise ValueError(f"weight scale of shape {self.scale.shape} for a weight of shape {self.data.shape}")

    @classmethod
    def from_rows(cls, w: np.ndarray) -> HostWeight:
        """A float32 weight from a matrix [out, in] as a checkpoint stores it (and model/weights.py packs it)."""
        return cls(np.ascontiguousarray(w.T, dtype=np.float32))

    @property
    def shape(self) -> tuple[int, int]:
        """[in, out]"""
        return self.data.shape


def _matmul_float32(x: np.ndarray, w: HostWeight) -> np.ndarray:
    return x @ w.data


# encoding -> x [T, in] @ w -> float32 [T, out]
MATMULS: dict[str, Callable[[np.ndarray, HostWeight], np.ndarray]] = {"float32": _matmul_float32}


def linear(x: np.ndarray, w: HostWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, in] times the weight, plus the bias [out] if there is one -> [T, out] float32.
    Twins: cuda/linear.py (cuBLAS GEMMs, gemv.cu), and cuda/qkv.cu add_qkv_bias for the bias."""
    out = MATMULS[w.dtype](x, w)
    if bias is not None:
        out += bias
    return out
