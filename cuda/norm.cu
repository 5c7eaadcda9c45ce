// RMSNorm.  Twin: numpy_backend.rms_norm.
//
// The residual add that precedes each norm in the numpy forward (x = x + attn @ Wo, x = x + mlp @ Wd) is fused
// one step earlier, into the cuBLAS epilogue: those GEMMs write C = A.B + C straight into the float32 residual
// stream. What is left for this kernel is to read x once and write the bf16 GEMM input.
#include "common.cuh"

// out[r, :] = x[row, :] / sqrt(mean(x[row, :]^2) + eps) * w, with row = rows ? rows[r] : r (rows picks the
// positions that need logits before the LM head).
// Launch: grid (R), block 256: one row per block, float4 loads, one block reduction. hidden % 8 == 0.
extern "C" __global__ void rms_norm(bf16* __restrict__ out, const float* __restrict__ x, const bf16* __restrict__ w,
                                    const int* __restrict__ rows, int hidden, float eps) {
    pdl_begin();
    __shared__ float scratch[32];
    const int row = rows ? rows[blockIdx.x] : blockIdx.x;
    const float* xr = x + (int64_t)row * hidden;
    float sum_sq = 0.f;
    for (int i = threadIdx.x * 4; i < hidden; i += blockDim.x * 4) {
        float4 v = *reinterpret_cast<const float4*>(xr + i);
        sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float inv_rms = rsqrtf(block_reduce<Sum>(sum_sq, scratch) / hidden + eps);
    bf16* o = out + (int64_t)blockIdx.x * hidden;
    for (int i = threadIdx.x * 8; i < hidden; i += blockDim.x * 8) {
        float wv[8], v[8];
        load8(w + i, wv);
        float4 a = *reinterpret_cast<const float4*>(xr + i), b = *reinterpret_cast<const float4*>(xr + i + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = v[j] * inv_rms * wv[j];
        store8(o + i, v);
    }
}
