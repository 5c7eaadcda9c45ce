// RMSNorm.  Twin: numpy_backend.rms_norm.
//
// The residual add that precedes each norm in the numpy forward (x = x + attn @ Wo, x = x + mlp @ Wd) is fused
// one step earlier, into the cuBLAS epilogue: those GEMMs write C = A.B + C straight into the float32 residual
// stream. What is left for this kernel is to read x once and write the bf16 GEMM input.
#include "common.cuh"

// out[r, :] = x[row, :] / sqrt(mean(x[row, :]^2) + eps) * w, with row = rows ? rows[r] : r (rows picks the
// positions that need logits before the LM head).
// Launch: grid (R), block a multiple of 32 with blockDim.x * 8 * NORM_CHUNKS >= hidden: one row per block, each
// thread holds up to NORM_CHUNKS chunks of 8 entries. A thread issues all its loads of x and w at once and keeps x
// in registers across the block reduction: at batch 1 the norm is one block on the critical path, where each extra
// round trip to memory shows. hidden % 8 == 0.
extern "C" __global__ void rms_norm(bf16* __restrict__ out, const float* __restrict__ x, const bf16* __restrict__ w,
                                    const int* __restrict__ rows, int hidden, float eps) {
    pdl_begin();
    __shared__ float scratch[32];
    const int row = rows ? rows[blockIdx.x] : blockIdx.x;
    const float* xr = x + (int64_t)row * hidden;
    float v[NORM_CHUNKS][8], wv[NORM_CHUNKS][8];
    float sum_sq = 0.f;
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = (c * blockDim.x + threadIdx.x) * 8;
        if (i >= hidden) break;
        const float4 a = *reinterpret_cast<const float4*>(xr + i), b = *reinterpret_cast<const float4*>(xr + i + 4);
        load8(w + i, wv[c]);
        v[c][0] = a.x; v[c][1] = a.y; v[c][2] = a.z; v[c][3] = a.w;
        v[c][4] = b.x; v[c][5] = b.y; v[c][6] = b.z; v[c][7] = b.w;
#pragma unroll
        for (int j = 0; j < 8; ++j) sum_sq += v[c][j] * v[c][j];
    }
    const float inv_rms = rsqrtf(block_reduce<Sum>(sum_sq, scratch) / hidden + eps);
    bf16* o = out + (int64_t)blockIdx.x * hidden;
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = (c * blockDim.x + threadIdx.x) * 8;
        if (i >= hidden) break;
#pragma unroll
        for (int j = 0; j < 8; ++j) v[c][j] = v[c][j] * inv_rms * wv[c][j];
        store8(o + i, v[c]);
    }
}
