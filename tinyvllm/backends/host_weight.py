"""A linear layer's weight as the numpy backend holds it: its values in an encoding (a dtype), with the scales that
encoding needs, and the matrix product that reads that encoding. The host twin of a device tensor.

float32: `data` is the matrix itself and there is no scale. float8_e4m3fn (FP8 W8A8, model/fp8.py): `data` holds e4m3
codes, `scale` one float32 per output column, or one per block of `block` = (output rows, input columns) of the
checkpoint's [out, in] weight; the product first quantizes its input to e4m3 (per token, per token and block column,
or with the static `input_scale`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tinyvllm.model.dtypes import e4m3_to_f32
from tinyvllm.model.fp8 import FP8_DTYPE, Fp8Rows, expand_block_scale, quantize_activations


@dataclass(frozen=True)
class HostWeight:
    data: np.ndarray  # [in, out], so that a linear layer is x @ data: the values (float32) or their codes
    dtype: str = "float32"  # the encoding of `data`: a key of MATMULS
    # float32: [out], what each output column's product is multiplied by; with `block`, [ceil(in / block[1]),
    # ceil(out / block[0])], the scale of each block of data
    scale: np.ndarray | None = None
    block: tuple[int, int] | None = None  # (output rows, input columns) of the checkpoint's weight blocks
    input_scale: float | None = None  # a static scale for the input's e4m3 codes; None: computed per token

    def __post_init__(self) -> None:
        if self.dtype not in MATMULS:
            raise ValueError(f"unsupported weight dtype {self.dtype!r}: supported are {', '.join(MATMULS)}")
        n_in, n_out = self.data.shape
        want = self.data.shape[-1:] if self.block is None else (-(-n_in // self.block[1]), -(-n_out // self.block[0]))
        if self.scale is not None and self.scale.shape != want:
            raise ValueError(f"weight scale of shape {self.scale.shape} for a weight of shape {self.data.shape}")

    @classmethod
    def from_rows(cls, w: np.ndarray) -> HostWeight:
        """A float32 weight from a matrix [out, in] as a checkpoint stores it (and model/weights.py packs it)."""
        return cls(np.ascontiguousarray(w.T, dtype=np.float32))

    @classmethod
    def from_fp8(cls, w: Fp8Rows) -> HostWeight:
        """An e4m3 weight from its rows [out, in] and their scales (model/fp8.py)."""
        scale = w.scale if w.block is None else w.scale.T
        return cls(np.ascontiguousarray(w.codes.T), FP8_DTYPE, np.ascontiguousarray(scale, np.float32), w.block,
                   w.input_scale)

    @cached_property
    def decoded(self) -> np.ndarray:
        """e4m3 codes as float32 (times their scales where those are per block): what every product reads, decoded
        once rather than at each call (the numpy backend budgets 4 bytes a weight either way)."""
        values = e4m3_to_f32(self.data)
        if self.block is not None:
            values = values * expand_block_scale(self.scale, self.block[::-1], self.data.shape)
        return values

    @property
    def shape(self) -> tuple[int, int]:
        """[in, out]"""
        return self.data.shape


ALIGN = 64  # bytes: where an invariant product's row and result sit, whatever the batch's arrays' addresses


def product(x: np.ndarray, data: np.ndarray, invariant: bool = False) -> np.ndarray:
    """x [T, in] @ data [in, out]. invariant: each row's result the same whatever the other rows and however many:
    each row is a product of its own (a vector times the matrix), read from and written to buffers at the same
    alignment every time, so BLAS takes one path for it wherever it sits. One product over several rows does not
    give that: a BLAS kernel adds a row's sums in an order that depends on the row's place in its tile (OpenBLAS's
    Haswell SGEMM: the first 6 rows of a 16-row product in one order, the rest in another)."""
    if not invariant:
        return x @ data
    row, result = _aligned(x.shape[1]), _aligned(data.shape[1])
    out = np.empty((len(x), data.shape[1]), np.float32)
    for i in range(len(x)):
        row[:] = x[i]
        np.matmul(row, data, out=result)
        out[i] = result
    return out


def _aligned(n: int) -> np.ndarray:
    """A new float32 vector of n at an ALIGN-byte boundary."""
    raw = np.empty(n + ALIGN // 4, np.float32)
    start = (-raw.ctypes.data % ALIGN) // 4
    return raw[start:start + n]


def _matmul_float32(x: np.ndarray, w: HostWeight, invariant: bool) -> np.ndarray:
    return product(x, w.data, invariant)


def _matmul_fp8(x: np.ndarray, w: HostWeight, invariant: bool) -> np.ndarray:
    # The float32 product of the e4m3 values: per-column scales multiply the product (as an FP8 GEMM's epilogue
    # does), block scales the weight.
    x = quantize_activations(x, w.input_scale, None if w.block is None else w.block[1])
    if w.block is None:
        return product(x, w.decoded, invariant) * w.scale
    return product(x, w.decoded, invariant)


# encoding -> (x [T, in], w, invariant) -> x @ w, float32 [T, out]
MATMULS: dict[str, Callable[[np.ndarray, HostWeight, bool], np.ndarray]] = {"float32": _matmul_float32,
                                                                             FP8_DTYPE: _matmul_fp8}


def linear(x: np.ndarray, w: HostWeight, bias: np.ndarray | None = None, invariant: bool = False) -> np.ndarray:
    """x [T, in] times the weight, plus the bias [out] if there is one -> [T, out] float32; invariant: each row's
    result independent of the others (`product`).
    Twins: cuda/linear.py (cuBLAS GEMMs, gemv.cu), and cuda/qkv.cu add_qkv_bias for the bias."""
    out = MATMULS[w.dtype](x, w, invariant)
    if bias is not None:
        out += bias
    return out
