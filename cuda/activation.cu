// SwiGLU activation.  Twin: numpy_backend.silu_and_mul (on gate_up with its columns de-interleaved).
#include "common.cuh"

// out[t, i] = silu(g) * u, silu(g) = g / (1 + exp(-g)), where gate_up's columns are interleaved in groups of 8 as
// the gate/up weight's rows are (backends/cuda/forward.py): unit i's gate at column 16 * (i / 8) + i % 8, its up 8
// columns further. (gemv.cu computes the same in its epilogue at batch <= 8; this serves the cuBLAS path.)
// Launch: grid (T, ceil(I / 2048)), block 256; 8 units (two 16-byte loads) per thread. I % 8 == 0.
extern "C" __global__ void silu_and_mul(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    pdl_begin();
    const int i = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (i >= inter) return;
    const bf16* group = gate_up + (int64_t)blockIdx.x * 2 * inter + 2 * i;
    float g[8], u[8];
    load8(group, g);
    load8(group + 8, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    store8(out + (int64_t)blockIdx.x * inter + i, g);
}
