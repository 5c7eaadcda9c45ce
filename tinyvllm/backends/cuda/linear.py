"""Linear layers: our GEMV kernel (cuda/gemv.cu) for a few rows, cuBLAS for more.

At decode batch 1..8 a GEMM is one pass over the weights, and cuBLAS reaches only about half of the memory
bandwidth there; gemv.cu is built to stream the weights at the copy rate. Both paths compute the same thing
(bf16 inputs, float32 accumulation) and launch without allocating or synchronizing, so either can be captured in
a CUDA graph.
"""

from __future__ import annotations

import pycuda.driver as cuda

from tinyvllm.backends.cuda.cublas import Cublas
from tinyvllm.backends.cuda.kernels import Kernel

GEMV_MAX_ROWS = 8  # the width of the kernel's mma tile (m16n8k16: x^T is its 16x8 B operand); any m <= 8 costs the same
# Measured on the H200 (bench/gemv.py, docs/PERFORMANCE.md): the kernel beats cuBLAS by 15-25% on weights of a few
# MB (Llama-3.2-1B's QKV and O), ties at 32 MB and loses ~5-15% above, where cuBLAS streams at the copy rate.
GEMV_MAX_WEIGHTS = 8 << 20  # n * k up to which the kernel runs
GEMV_WARPS = 8  # cuda/gemv.cu GEMV_WARPS
GEMV_TILE_ROWS = 16  # output rows (weight rows) of one mma tile
GEMV_K_PER_ITERATION = 256  # k that one warp loads per iteration: GEMV_UNROLL * 4 lanes * 8 bf16


class Linear:
    """out[m, n] = x[m, k] . w[n, k]^T, row-major, with Cublas.gemm's meaning and arguments."""

    def __init__(self, blas: Cublas, kernels: dict[str, Kernel], stream: cuda.Stream,
                 max_gemv_weights: int = GEMV_MAX_WEIGHTS) -> None:
        self.blas = blas
        self.kernels = kernels
        self.stream = stream
        self.max_gemv_weights = max_gemv_weights

    def uses_gemv(self, m: int, n: int, k: int) -> bool:
        # the kernel loads 16 bytes (8 bf16) at a time
        return 0 < m <= GEMV_MAX_ROWS and 0 < n * k <= self.max_gemv_weights and k % 8 == 0

    def gemm(self, out: int, x: int, w: int, m: int, n: int, k: int, out_fp32: bool = False,
             accumulate: bool = False) -> None:
        """bf16 x and w, float32 accumulation; out bf16 or float32 (out_fp32), out += x . w^T when accumulate."""
        if not self.uses_gemv(m, n, k):
            self.blas.gemm(out, x, w, m, n, k, out_fp32=out_fp32, accumulate=accumulate)
            return
        # Warps sharing one 16-row tile, each taking a part of k: as many as k keeps busy for a full iteration, so
        # that small n still has enough loads in flight (n = 2048 at k = 2048: all 8 MB requested at once).
        split = 1
        while split < GEMV_WARPS and 2 * split * GEMV_K_PER_ITERATION <= k:
            split *= 2
        tiles = -(-n // GEMV_TILE_ROWS)
        blocks = -(-tiles // (GEMV_WARPS // split))
        self.kernels["gemv_f32" if out_fp32 else "gemv_bf16"](
            (blocks,), (GEMV_WARPS * 32, 1, 1), self.stream, out, x, w, m, n, k, split, int(accumulate))
