// RMSNorm, and the sandwich norms' residual add (Gemma 2 and 3).  Twins: numpy_backend.rms_norm, add_rms_norm.
//
// The residual add that precedes each norm in the numpy forward (x = x + attn @ Wo, x = x + mlp @ Wd) is fused
// one step earlier, into the cuBLAS epilogue: those GEMMs write C = A.B + C straight into the float32 residual
// stream. What is left for this kernel is to read x once and write the bf16 GEMM input. A family with sandwich
// norms normalizes the attention's and the MLP's outputs before they join the residual stream: those GEMMs write a
// float32 scratch row instead, and rms_norm_residual adds its norm to x and normalizes the new x for the next GEMM.
//
// Every norm multiplies by (offset + w) in float32: offset 0 is Llama's gain, Gemma's 1 is HF's (1 + w.float()),
// with no rounding of 1 + w to bf16.
#include "common.cuh"

// A thread's chunks of 8 entries of one row: up to NORM_CHUNKS of them, entries (c * blockDim.x + threadIdx.x) * 8.
__device__ __forceinline__ int chunk_start(int c) { return (c * blockDim.x + threadIdx.x) * 8; }

__device__ __forceinline__ void load8_f32(const float* p, float out[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ void store8_f32(float* p, const float in[8]) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(in[4], in[5], in[6], in[7]);
}

// 1 / sqrt(mean(v^2) + eps) of the row whose chunks the block's threads hold in v.
__device__ __forceinline__ float inv_rms(const float (&v)[NORM_CHUNKS][8], int hidden, float eps, float* scratch) {
    float sum_sq = 0.f;
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        if (chunk_start(c) >= hidden) break;
#pragma unroll
        for (int j = 0; j < 8; ++j) sum_sq += v[c][j] * v[c][j];
    }
    return rsqrtf(block_reduce<Sum>(sum_sq, scratch) / hidden + eps);
}

// The normed value of entry j of chunk c, as the bf16 stored.
__device__ __forceinline__ float normed(const float (&v)[NORM_CHUNKS][8], const float (&wv)[NORM_CHUNKS][8], int c,
                                       int j, float inv, float offset) {
    return __bfloat162float(__float2bfloat16(v[c][j] * inv * (offset + wv[c][j])));
}

// o = v * inv_rms * (offset + w), as bf16. Returns the largest |value| the thread stored.
__device__ __forceinline__ float store_normed(bf16* o, const float (&v)[NORM_CHUNKS][8],
                                             const float (&wv)[NORM_CHUNKS][8], float inv, float offset, int hidden) {
    float amax = 0.f;
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = chunk_start(c);
        if (i >= hidden) break;
        float r[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            r[j] = normed(v, wv, c, j, inv, offset);
            amax = fmaxf(amax, fabsf(r[j]));
        }
        store8(o + i, r);
    }
    return amax;
}

// e4m3 codes of 8 entries into a quantized row: as they are (e4m3: cuBLASLt's FP8 GEMM input beyond 8 rows) or as
// their f16 values (__half: the FP8 GEMV's x).
__device__ __forceinline__ void store_codes(e4m3* p, uint2 codes) { *reinterpret_cast<uint2*>(p) = codes; }
__device__ __forceinline__ void store_codes(__half* p, uint2 codes) {
    *reinterpret_cast<uint4*>(p) = e4m3x8_to_f16x8(codes);
}

// Where quantized is not null, the row just stored quantized for the next FP8 product (fp8.cu): its scale
// fp8_scale(amax) into scales[blockIdx.x] and the e4m3 codes of the bf16 values times 1 / scale (as quantize_fp8
// computes them) into quantized, as codes (Q e4m3) or their f16 values (Q __half). Called by the whole block.
template <class Q>
__device__ __forceinline__ void store_quantized(Q* quantized, float* scales, const float (&v)[NORM_CHUNKS][8],
                                                const float (&wv)[NORM_CHUNKS][8], float inv, float offset,
                                                int hidden, float thread_amax, float* scratch) {
    if (!quantized) return;  // the same for the whole grid
    const float scale = fp8_scale(block_reduce<Max>(thread_amax, scratch)), to_codes = __frcp_rn(scale);
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = chunk_start(c);
        if (i >= hidden) break;
        float r[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] = normed(v, wv, c, j, inv, offset);
        store_codes(quantized + (int64_t)blockIdx.x * hidden + i, f32x8_to_e4m3x8(r, to_codes));
    }
}

// out[r, :] = x[row, :] / sqrt(mean(x[row, :]^2) + eps) * (offset + w), with row = rows ? rows[r] : r (rows picks
// the positions that need logits before the LM head); quantized, scales: store_quantized's (null: none): f16 code
// values in rms_norm, e4m3 codes in rms_norm_e4m3.
// Launch: grid (R), block a multiple of 32 with blockDim.x * 8 * NORM_CHUNKS >= hidden: one row per block, each
// thread holds up to NORM_CHUNKS chunks of 8 entries. A thread issues all its loads of x and w at once and keeps x
// in registers across the block reduction: at batch 1 the norm is one block on the critical path, where each extra
// round trip to memory shows. hidden % 8 == 0.
template <class Q>
__device__ void rms_norm_rows(bf16* out, Q* quantized, float* scales, const float* x, const bf16* w, const int* rows,
                              int hidden, float eps, float offset) {
    pdl_begin();
    __shared__ float scratch[32];
    const int row = rows ? rows[blockIdx.x] : blockIdx.x;
    const float* xr = x + (int64_t)row * hidden;
    float v[NORM_CHUNKS][8], wv[NORM_CHUNKS][8];
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = chunk_start(c);
        if (i >= hidden) break;
        load8_f32(xr + i, v[c]);
        load8(w + i, wv[c]);
    }
    const float inv = inv_rms(v, hidden, eps, scratch);
    const float amax = store_normed(out + (int64_t)blockIdx.x * hidden, v, wv, inv, offset, hidden);
    store_quantized(quantized, scales, v, wv, inv, offset, hidden, amax, scratch);
}

extern "C" __global__ void rms_norm(bf16* __restrict__ out, __half* __restrict__ values, float* __restrict__ scales,
                                    const float* __restrict__ x, const bf16* __restrict__ w,
                                    const int* __restrict__ rows, int hidden, float eps, float offset) {
    rms_norm_rows(out, values, scales, x, w, rows, hidden, eps, offset);
}

extern "C" __global__ void rms_norm_e4m3(bf16* __restrict__ out, e4m3* __restrict__ codes, float* __restrict__ scales,
                                         const float* __restrict__ x, const bf16* __restrict__ w,
                                         const int* __restrict__ rows, int hidden, float eps, float offset) {
    rms_norm_rows(out, codes, scales, x, w, rows, hidden, eps, offset);
}

// x[t, :] += rms_norm(part[t, :]) * (offset + part_w), then, where out is not null, out[t, :] = rms_norm(x[t, :]) *
// (offset + w) of the new x (the next GEMM's input), with store_quantized's quantized rows and scales (null: none;
// f16 code values in rms_norm_residual, e4m3 codes in rms_norm_residual_e4m3). part: the float32 product of the O or
// down GEMM.
// Launch: as rms_norm's, grid (T).
template <class Q>
__device__ void rms_norm_residual_rows(bf16* out, Q* quantized, float* scales, float* x, const float* part,
                                       const bf16* part_w, const bf16* w, int hidden, float eps, float offset) {
    pdl_begin();
    __shared__ float scratch[32];
    float* xr = x + (int64_t)blockIdx.x * hidden;
    const float* pr = part + (int64_t)blockIdx.x * hidden;
    float v[NORM_CHUNKS][8], wv[NORM_CHUNKS][8], xv[NORM_CHUNKS][8];
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = chunk_start(c);
        if (i >= hidden) break;
        load8_f32(pr + i, v[c]);
        load8_f32(xr + i, xv[c]);
        load8(part_w + i, wv[c]);
    }
    const float inv_part = inv_rms(v, hidden, eps, scratch);
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; ++c) {
        const int i = chunk_start(c);
        if (i >= hidden) break;
#pragma unroll
        for (int j = 0; j < 8; ++j) xv[c][j] += v[c][j] * inv_part * (offset + wv[c][j]);
        store8_f32(xr + i, xv[c]);
        if (out) load8(w + i, wv[c]);
    }
    if (!out) return;  // the same for the whole grid: no thread of the block reaches the reduction
    const float inv = inv_rms(xv, hidden, eps, scratch);
    const float amax = store_normed(out + (int64_t)blockIdx.x * hidden, xv, wv, inv, offset, hidden);
    store_quantized(quantized, scales, xv, wv, inv, offset, hidden, amax, scratch);
}

extern "C" __global__ void __launch_bounds__(1024)
rms_norm_residual(bf16* __restrict__ out, __half* __restrict__ values, float* __restrict__ scales,
                  float* __restrict__ x, const float* __restrict__ part, const bf16* __restrict__ part_w,
                  const bf16* __restrict__ w, int hidden, float eps, float offset) {
    rms_norm_residual_rows(out, values, scales, x, part, part_w, w, hidden, eps, offset);
}

extern "C" __global__ void __launch_bounds__(1024)
rms_norm_residual_e4m3(bf16* __restrict__ out, e4m3* __restrict__ codes, float* __restrict__ scales,
                       float* __restrict__ x, const float* __restrict__ part, const bf16* __restrict__ part_w,
                       const bf16* __restrict__ w, int hidden, float eps, float offset) {
    rms_norm_residual_rows(out, codes, scales, x, part, part_w, w, hidden, eps, offset);
}
