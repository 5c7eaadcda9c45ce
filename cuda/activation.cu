// SwiGLU activation.  Twin: numpy_backend.silu_and_mul.
#include "common.cuh"

// out[t, i] = silu(g) * u with g = gate_up[t, i], u = gate_up[t, I + i], silu(g) = g / (1 + exp(-g)).
// Launch: grid (T, ceil(I / 2048)), block 256; 8 elements (16-byte loads) per thread. I % 8 == 0.
extern "C" __global__ void silu_and_mul(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    pdl_begin();
    const int i = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (i >= inter) return;
    const bf16* row = gate_up + (int64_t)blockIdx.x * 2 * inter;
    float g[8], u[8];
    load8(row + i, g);
    load8(row + inter + i, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    store8(out + (int64_t)blockIdx.x * inter + i, g);
}
