// FP8 W8A8 linear layers: e4m3 weights with one float32 scale per output channel (row), activations quantized to
// e4m3 per token (row) with a dynamic scale. Twins: model/fp8.py (quantize_rows, quantize_activations) and
// backends/host_weight.py _matmul_fp8 (the product of the dequantized values, scaled per output column).
//
// A product out[m, n] = sum_k xq[m, k] * wq[n, k] * x_scale[m] * w_scale[n] runs as
// - gemv_fp8 (m <= 8): our kernel, codes times codes in float32, the scales applied at its end;
// - cuBLASLt's FP8 GEMM with unit scales into a float32 buffer (backends/cuda/cublas.py), then scale_rows_cols,
//   which applies outer(x_scale, w_scale) (cuBLASLt's scale pointers take one scale per tensor on sm_90).
// Every product of two e4m3 values is exact in float32, so both compute the twin's sums up to their order.
#include "common.cuh"

// Two e4m3 codes (16 bits) -> two floats, exactly.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)pair, __NV_E4M3)));
}

// out[r, :] = e4m3(x[r, :] / scale[r]), scale[r] = amax(|x[r, :]|) / 448 (1 where the row is all zeros): the
// weights at load (one scale per output channel) and each linear layer's input (one per token).
// Twin: model/fp8.py quantize_rows (x / scale rounded to nearest even, saturating).
// Launch: grid (rows), block 256; a row per block, 8 entries per thread and pass. cols % 8 == 0. x is read with
// plain loads: another kernel writes it.
extern "C" __global__ void quantize_fp8(e4m3* __restrict__ out, float* __restrict__ scales, const bf16* x, int cols) {
    pdl_begin();
    __shared__ float scratch[32];
    const bf16* xr = x + (int64_t)blockIdx.x * cols;
    float amax = 0.f;
    for (int i = threadIdx.x * 8; i < cols; i += blockDim.x * 8) {
        float v[8];
        load8(xr + i, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
    amax = block_reduce<Max>(amax, scratch);
    const float scale = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
    e4m3* o = out + (int64_t)blockIdx.x * cols;
    for (int i = threadIdx.x * 8; i < cols; i += blockDim.x * 8) {
        float v[8];
        load8(xr + i, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fdiv_rn(v[j], scale);
        *reinterpret_cast<uint2*>(o + i) = f32x8_to_e4m3x8(v, 1.f);
    }
}

// out[r, c] (+)= acc[r, c] * row_scale[r] * col_scale[c]: the epilogue of the cuBLASLt FP8 GEMM (float32 acc). out may
// be acc itself (a float32 product that adds to nothing: the LM head's logits): a thread reads its entries first.
// Launch: grid (rows, ceil(n / 2048)), block 256, 8 columns per thread. n % 8 == 0.
template <class T>
__device__ void scale_rows_cols(T* out, const float* acc, const float* row_scale, const float* col_scale, int n,
                                int accumulate) {
    pdl_begin();
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c >= n) return;
    const int64_t at = (int64_t)blockIdx.x * n + c;
    const float rs = row_scale[blockIdx.x];
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = acc[at + j] * rs * col_scale[c + j];
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int j = 0; j < 8; ++j) out[at + j] = accumulate ? out[at + j] + v[j] : v[j];
    } else {
        if (accumulate) {
            float old[8];
            load8(out + at, old);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] += old[j];
        }
        store8(out + at, v);
    }
}

extern "C" __global__ void scale_rows_cols_f32(float* out, const float* acc, const float* row_scale,
                                               const float* col_scale, int n, int accumulate) {
    scale_rows_cols<float>(out, acc, row_scale, col_scale, n, accumulate);
}

extern "C" __global__ void scale_rows_cols_bf16(bf16* out, const float* acc, const float* row_scale,
                                                const float* col_scale, int n, int accumulate) {
    scale_rows_cols<bf16>(out, acc, row_scale, col_scale, n, accumulate);
}

// out[i, r] (+)= x_scale[i] * w_scale[r] * sum_k x[i, k] * w[r, k], for m <= 8 rows of e4m3 codes x and e4m3
// weights w [n, k] (codes; per-row scales). A warp takes FP8_GEMV_ROWS weight rows and runs along k, 16 codes
// (16 bytes) of each row and of each x row per lane and step, float32 products and sums; the warp's sums meet by
// shuffles and lane (i, r) writes out[i, r].
// Launch: grid (ceil(n / (FP8_GEMV_WARPS * FP8_GEMV_ROWS))), block FP8_GEMV_WARPS * 32. k % 16 == 0.
template <class T>
__device__ void gemv_fp8(T* out, const e4m3* x, const float* x_scale, const e4m3* w,
                         const float* w_scale, int m, int n, int k, int accumulate) {
    pdl_begin();
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * FP8_GEMV_WARPS + (threadIdx.x >> 5)) * FP8_GEMV_ROWS;
    if (row0 >= n) return;
    float acc[8][FP8_GEMV_ROWS];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int r = 0; r < FP8_GEMV_ROWS; ++r) acc[i][r] = 0.f;
    for (int k0 = lane * 16; k0 < k; k0 += 32 * 16) {
        uint4 wv[FP8_GEMV_ROWS], xv[8];
#pragma unroll
        for (int r = 0; r < FP8_GEMV_ROWS; ++r)
            wv[r] = row0 + r < n ? *reinterpret_cast<const uint4*>(w + (int64_t)(row0 + r) * k + k0)
                                 : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i < m) xv[i] = *reinterpret_cast<const uint4*>(x + (int64_t)i * k + k0);
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // each 32-bit word: 4 codes, 2 pairs
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float2 wf[FP8_GEMV_ROWS];
#pragma unroll
                for (int r = 0; r < FP8_GEMV_ROWS; ++r)
                    wf[r] = e4m3x2_to_float2((reinterpret_cast<const uint32_t*>(&wv[r])[q] >> (16 * half)) & 0xFFFF);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if (i >= m) break;
                    const float2 xf =
                        e4m3x2_to_float2((reinterpret_cast<const uint32_t*>(&xv[i])[q] >> (16 * half)) & 0xFFFF);
#pragma unroll
                    for (int r = 0; r < FP8_GEMV_ROWS; ++r) acc[i][r] = fmaf(xf.y, wf[r].y, fmaf(xf.x, wf[r].x, acc[i][r]));
                }
            }
        }
    }
    float mine = 0.f;  // lane i * FP8_GEMV_ROWS + r keeps the sum of (i, r)
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int r = 0; r < FP8_GEMV_ROWS; ++r) {
            const float sum = warp_reduce<Sum>(acc[i][r]);
            if (lane == i * FP8_GEMV_ROWS + r) mine = sum;
        }
    const int i = lane / FP8_GEMV_ROWS, row = row0 + lane % FP8_GEMV_ROWS;
    if (i >= m || row >= n) return;
    const float v = mine * x_scale[i] * w_scale[row];
    T* o = out + (int64_t)i * n + row;
    if constexpr (sizeof(T) == 4) {
        *o = accumulate ? *o + v : v;
    } else {
        *o = __float2bfloat16_rn(accumulate ? __bfloat162float(*o) + v : v);
    }
}

extern "C" __global__ void gemv_fp8_f32(float* out, const e4m3* x, const float* x_scale, const e4m3* w,
                                        const float* w_scale, int m, int n, int k, int accumulate) {
    gemv_fp8<float>(out, x, x_scale, w, w_scale, m, n, k, accumulate);
}

extern "C" __global__ void gemv_fp8_bf16(bf16* out, const e4m3* x, const float* x_scale, const e4m3* w,
                                         const float* w_scale, int m, int n, int k, int accumulate) {
    gemv_fp8<bf16>(out, x, x_scale, w, w_scale, m, n, k, accumulate);
}
