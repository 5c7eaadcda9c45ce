"""Linear layers: our GEMV kernel (cuda/gemv.cu) for a few rows, cuBLAS for more. With the GEMV the gate/up
projection ends in SwiGLU (gemv_swiglu); after cuBLAS, SwiGLU is a kernel of its own (silu_and_mul).

At decode batch 1..8 a GEMM is one pass over the weights, and cuBLAS reaches only about half of the memory
bandwidth there; gemv.cu is built to stream the weights at the copy rate. Both paths compute the same thing
(bf16 inputs, float32 accumulation) and launch without allocating or synchronizing, so either can be captured in
a CUDA graph.
"""

from __future__ import annotations

import pycuda.driver as cuda

from tinyvllm.backends.cuda.cublas import Cublas
from tinyvllm.backends.cuda.kernels import Kernel
from tinyvllm.backends.cuda.ops import GEMV_MAX_ROWS, VECTOR, Ops

# Measured on the H200 (docs/PERFORMANCE.md). Alone (bench/gemv.py) the kernel beats cuBLAS by 15-25% on weights of
# a few MB (Llama-3.2-1B's QKV and O) and ties at 16-32 MB (its MLP). In a decode step it also starts streaming its
# weights while the kernel before it ends (programmatic dependent launch), which cuBLAS's kernels do not: with the
# MLP's GEMMs on it too, W3 went from 1.16 to 1.11 ms per token; the 128k x 2048 LM head stays on cuBLAS (equal).
GEMV_MAX_WEIGHTS = 64 << 20  # n * k up to which the kernel runs


class Linear:
    """out[m, n] = x[m, k] . w[n, k]^T, row-major, with Cublas.gemm's meaning and arguments."""

    def __init__(self, blas: Cublas, kernels: dict[str, Kernel], stream: cuda.Stream,
                 max_gemv_weights: int = GEMV_MAX_WEIGHTS) -> None:
        self.blas = blas
        self.kernels = kernels
        self.stream = stream
        device = cuda.Context.get_device()
        self.ops = Ops(kernels, stream, device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT))
        self.max_gemv_weights = max_gemv_weights

    def uses_gemv(self, m: int, n: int, k: int) -> bool:
        return 0 < m <= GEMV_MAX_ROWS and 0 < n * k <= self.max_gemv_weights and k % VECTOR == 0

    def gemm(self, out: int, x: int, w: int, m: int, n: int, k: int, out_fp32: bool = False,
             accumulate: bool = False) -> None:
        """bf16 x and w, float32 accumulation; out bf16 or float32 (out_fp32), out += x . w^T when accumulate."""
        if self.uses_gemv(m, n, k):
            self.ops.gemv(out, x, w, m, n, k, out_fp32, accumulate)
        else:
            self.blas.gemm(out, x, w, m, n, k, out_fp32=out_fp32, accumulate=accumulate)

    def gate_up_swiglu(self, out: int, x: int, w: int, m: int, n: int, k: int, gate_up: int) -> None:
        """bf16 out [m, n / 2] = SwiGLU(x . w^T), w the gate/up projection with its rows interleaved in groups of 8
        (8 gate, then the same units' 8 up); gate_up: a bf16 [m, n] buffer that the cuBLAS path goes through."""
        if self.uses_gemv(m, n, k):
            self.ops.gemv_swiglu(out, x, w, m, n, k)
        else:
            self.blas.gemm(gate_up, x, w, m, n, k)
            self.ops.silu_and_mul(out, gate_up, m, n // 2)
