"""Device tensors: a pointer into GPU memory with the dtype and shape of what lies there (and, for a quantized
weight, its scales). Byte sizes and offsets come from the dtype, never from a width written at the call site.

No pycuda here: a DeviceTensor is plain data (its memory belongs to the Device that allocated it, device.py), so
that the code reading them (linear.py, cublas.py) can be tested on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# dtype name -> bytes per element. bf16: bfloat16; f32: float32; e4m3: float8 e4m3 codes (the FP8 KV cache and,
# with scales, FP8 weights); f16: float16 (with scales: the values of e4m3 codes, the FP8 GEMV's input); i32, u8,
# u64: index tables, masks and pointer arrays.
DTYPE_BYTES = {"bf16": 2, "f32": 4, "e4m3": 1, "f16": 2, "i32": 4, "u8": 1, "u64": 8}
BF16, F32, E4M3, F16, I32, U8, U64 = "bf16", "f32", "e4m3", "f16", "i32", "u8", "u64"
NUMPY_DTYPES = {"f32": "float32", "i32": "int32", "u8": "uint8", "u64": "uint64", "bf16": "uint16",
                "e4m3": "uint8", "f16": "float16"}  # numpy's storage of each (bf16 as bit patterns, e4m3 as codes)


@dataclass(frozen=True)
class DeviceTensor:
    """`shape` elements of `dtype` at device address `ptr`, row-major. scale: the float32 scales of a quantized
    tensor (per tensor or per output row), None for bf16 and float32 data."""

    ptr: int
    dtype: str
    shape: tuple[int, ...]
    scale: DeviceTensor | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown device dtype {self.dtype!r}; one of {', '.join(DTYPE_BYTES)}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def rows(self) -> int:
        """Rows of a matrix view: every dimension but the last."""
        return math.prod(self.shape[:-1])

    @property
    def row_bytes(self) -> int:
        return self.shape[-1] * self.itemsize

    def row(self, i: int) -> int:
        """The address of row i (of the first dimension)."""
        return self.ptr + i * (self.nbytes // self.shape[0])

    def element(self, i: int) -> int:
        """The address of flat element i."""
        return self.ptr + i * self.itemsize


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_BYTES[dtype]


def matmul_shape(out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int) -> tuple[int, int]:
    """(n, k) of out[:m] = x[:m] . w^T, w [n, k]; ValueError where the buffers cannot hold it."""
    n, k = w.shape
    if x.shape[-1] != k or out.shape[-1] != n or not 0 < m <= min(x.rows, out.rows):
        raise ValueError(f"a product of {m} rows: x {x.shape}, w {w.shape} and out {out.shape} do not fit")
    return n, k


@dataclass(frozen=True)
class DeviceLayer:
    """One decoder layer on the GPU: model/weights.py's LayerWeights, field for field, as device tensors (matrices
    [out, in]; gate_up's rows interleaved in groups of 8 for SwiGLU, forward.py). The family's optional parts are
    None where it has none; an expert layer has the router and stacked experts in place of gate_up and down."""

    input_norm: DeviceTensor
    post_norm: DeviceTensor
    qkv: DeviceTensor
    o: DeviceTensor
    gate_up: DeviceTensor | None = None
    down: DeviceTensor | None = None
    qkv_bias: DeviceTensor | None = None
    q_norm: DeviceTensor | None = None
    k_norm: DeviceTensor | None = None
    attn_out_norm: DeviceTensor | None = None  # Gemma's: the cuda backend refuses such a model (no kernels yet)
    mlp_out_norm: DeviceTensor | None = None
    # an expert layer's router [num_experts, hidden] and stacked experts [num_experts, rows, columns] (LayerWeights';
    # cuda/moe.cu); None in a dense layer
    router: DeviceTensor | None = None
    experts_gate_up: DeviceTensor | None = None
    experts_down: DeviceTensor | None = None
