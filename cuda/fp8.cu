// FP8 W8A8 linear layers: e4m3 weights with one float32 scale per output channel (row), activations quantized to
// e4m3 per token (row) with a dynamic scale. Twins: model/fp8.py (quantize_rows, quantize_activations) and
// backends/host_weight.py _matmul_fp8 (the product of the dequantized values, scaled per output column).
//
// A product out[m, n] = sum_k xq[m, k] * wq[n, k] * x_scale[m] * w_scale[n] runs as
// - gemv_fp8_* (m <= 8): gemv_kernel.cuh's GEMV with e4m3 weights on x quantized by the kernel that wrote it (the
//   f16 values of its codes and a scale per row: rms_norm, else quantize_fp8_values), ending in the scales, or in
//   SwiGLU / GeGLU for the gate/up projection (gemv_swiglu_fp8, ...);
// - else cuBLASLt's FP8 GEMM (backends/cuda/cublas.py) on x's e4m3 codes, written by the kernel that produces x where
//   it sees the whole row (rms_norm_e4m3, silu_and_mul_e4m3), else by quantize_fp8: with the scales as its outer
//   vectors where cuBLASLt offers them, else with unit scales into a float32 buffer and scale_rows_cols after it.
// Every product of two e4m3 values is exact in float32, so both compute the twin's sums up to their order.
#include "gemv_kernel.cuh"

// Row blockIdx.x of bf16 x quantized: scales[r] = fp8_scale(amax(|x[r, :]|)), codes e4m3(x * (1 / scale)) rounded to
// nearest even and saturated, into out as the codes themselves (VALUES false: e4m3) or as their values (f16, the
// FP8 GEMV's input). A multiply by the scale's inverse, not a division: rms_norm quantizes the same way in its
// epilogue. Twin: model/fp8.py quantize_rows. A row per block, 8 entries per thread and pass; x is read with plain
// loads: another kernel writes it.
template <bool VALUES>
__device__ void quantize_row(void* out, float* scales, const bf16* x, int cols) {
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
    const float scale = fp8_scale(block_reduce<Max>(amax, scratch)), inv = __frcp_rn(scale);
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
    const int64_t row = (int64_t)blockIdx.x * cols;
    for (int i = threadIdx.x * 8; i < cols; i += blockDim.x * 8) {
        float v[8];
        load8(xr + i, v);
        const uint2 codes = f32x8_to_e4m3x8(v, inv);
        if constexpr (VALUES) {
            *reinterpret_cast<uint4*>(static_cast<__half*>(out) + row + i) = e4m3x8_to_f16x8(codes);
        } else {
            *reinterpret_cast<uint2*>(static_cast<e4m3*>(out) + row + i) = codes;
        }
    }
}

// e4m3 out [rows, cols] and scales [rows] of bf16 x: the weights at load (one scale per output channel) and a linear
// layer's input beyond 8 rows that its producer did not quantize (one per token: attention's output). Launch: grid
// (rows), block 256. cols % 8 == 0.
extern "C" __global__ void quantize_fp8(e4m3* __restrict__ out, float* __restrict__ scales, const bf16* x, int cols) {
    quantize_row<false>(out, scales, x, cols);
}

// quantize_fp8 with the codes' f16 values as out: the FP8 GEMV's x where the kernel that wrote x does not quantize
// it (attention's output, the activation). Launch: as quantize_fp8's.
extern "C" __global__ void quantize_fp8_values(__half* __restrict__ out, float* __restrict__ scales, const bf16* x,
                                               int cols) {
    quantize_row<true>(out, scales, x, cols);
}

// Rows of bf16 x quantized per 128 columns (an FP8 checkpoint's block-scaled layers' inputs, as
// model/fp8.py quantize_activations with group 128 does): group j of row r gets scales[j * rows + r] =
// fp8_scale(amax(|x[r, 128j : 128(j + 1)]|)) (the groups' scales one after another, as cuBLASLt's VEC128 scales and
// gemv_fp8_block read them) and codes e4m3(x * (1 / scale)), into out as quantize_row's. A group per 16 threads, 8
// entries each, its amax by shuffles among them. Launch: grid (rows, ceil(cols / 1024)), block 128. cols % 8 == 0.
template <bool VALUES>
__device__ void quantize_groups(void* out, float* scales, const bf16* x, int rows, int cols) {
    pdl_begin();
    const int r = blockIdx.x, c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    const int64_t at = (int64_t)r * cols + c;
    float v[8] = {};
    if (c < cols) load8(x + at, v);
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o, 16));
    if (c >= cols) return;
    const float scale = fp8_scale(amax), inv = __frcp_rn(scale);
    if ((threadIdx.x & 15) == 0) scales[(int64_t)(c / 128) * rows + r] = scale;
    const uint2 codes = f32x8_to_e4m3x8(v, inv);
    if constexpr (VALUES) {
        *reinterpret_cast<uint4*>(static_cast<__half*>(out) + at) = e4m3x8_to_f16x8(codes);
    } else {
        *reinterpret_cast<uint2*>(static_cast<e4m3*>(out) + at) = codes;
    }
}

extern "C" __global__ void quantize_fp8_groups(e4m3* __restrict__ out, float* __restrict__ scales, const bf16* x,
                                               int rows, int cols) {
    quantize_groups<false>(out, scales, x, rows, cols);
}

// quantize_fp8_groups with the codes' f16 values as out: gemv_fp8_block's x.
extern "C" __global__ void quantize_fp8_groups_values(__half* __restrict__ out, float* __restrict__ scales,
                                                      const bf16* x, int rows, int cols) {
    quantize_groups<true>(out, scales, x, rows, cols);
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

// The GEMV kernels with e4m3 weights (gemv_kernel.cuh), each in its plain and `_pipelined` form: out (+)= x . w^T
// scaled (bf16 or float32 out), and the gate/up projection's SwiGLU / GeGLU (rows interleaved as gemv.cu's).
#define GEMV_FP8_BF16(SUFFIX, PIPELINED, MIN_BLOCKS)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                      \
    gemv_fp8_bf16##SUFFIX(bf16* out, const __half* x, const e4m3* w, const float* w_scale, const float* x_scale,       \
                          int m, int n, int k, int split, int accumulate) {                                      \
        gemv<bf16, Ungated, PIPELINED, e4m3, __half>(out, x, w, w_scale, x_scale, m, n, k, split, accumulate);             \
    }
#define GEMV_FP8_F32(SUFFIX, PIPELINED, MIN_BLOCKS)                                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                      \
    gemv_fp8_f32##SUFFIX(float* out, const __half* x, const e4m3* w, const float* w_scale, const float* x_scale,       \
                         int m, int n, int k, int split, int accumulate) {                                       \
        gemv<float, Ungated, PIPELINED, e4m3, __half>(out, x, w, w_scale, x_scale, m, n, k, split, accumulate);            \
    }
#define GEMV_FP8_GATED(NAME, ACT, SUFFIX, PIPELINED, MIN_BLOCKS)                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                      \
    gemv_##NAME##_fp8##SUFFIX(bf16* out, const __half* x, const e4m3* w, const float* w_scale, const float* x_scale,  \
                              int m, int n, int k, int split) {                                                   \
        gemv<bf16, ACT, PIPELINED, e4m3, __half>(out, x, w, w_scale, x_scale, m, n, k, split, 0);                          \
    }
// The same with block scales (gemv_kernel.cuh BLOCK: x per 128 columns, w per 128 x 128 block).
#define GEMV_FP8_BLOCK_BF16(SUFFIX, PIPELINED, MIN_BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                      \
    gemv_fp8_block_bf16##SUFFIX(bf16* out, const __half* x, const e4m3* w, const float* w_scale,                   \
                                const float* x_scale, int m, int n, int k, int split, int accumulate) {          \
        gemv<bf16, Ungated, PIPELINED, e4m3, __half, true>(out, x, w, w_scale, x_scale, m, n, k, split, accumulate);  \
    }
#define GEMV_FP8_BLOCK_F32(SUFFIX, PIPELINED, MIN_BLOCKS)                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                      \
    gemv_fp8_block_f32##SUFFIX(float* out, const __half* x, const e4m3* w, const float* w_scale,                   \
                               const float* x_scale, int m, int n, int k, int split, int accumulate) {           \
        gemv<float, Ungated, PIPELINED, e4m3, __half, true>(out, x, w, w_scale, x_scale, m, n, k, split, accumulate); \
    }
#if KEEPS(gemv_fp8_block_bf16)
GEMV_FP8_BLOCK_BF16(, false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_fp8_block_f32)
GEMV_FP8_BLOCK_F32(, false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_fp8_block_bf16_pipelined)
GEMV_FP8_BLOCK_BF16(_pipelined, true, 1)
#endif
#if KEEPS(gemv_fp8_block_f32_pipelined)
GEMV_FP8_BLOCK_F32(_pipelined, true, 1)
#endif
#if KEEPS(gemv_fp8_bf16)
GEMV_FP8_BF16(, false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_fp8_f32)
GEMV_FP8_F32(, false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_swiglu_fp8)
GEMV_FP8_GATED(swiglu, Silu, , false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_geglu_fp8)
GEMV_FP8_GATED(geglu, GeluTanh, , false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_fp8_bf16_pipelined)
GEMV_FP8_BF16(_pipelined, true, 1)
#endif
#if KEEPS(gemv_fp8_f32_pipelined)
GEMV_FP8_F32(_pipelined, true, 1)
#endif
#if KEEPS(gemv_swiglu_fp8_pipelined)
GEMV_FP8_GATED(swiglu, Silu, _pipelined, true, 1)
#endif
#if KEEPS(gemv_geglu_fp8_pipelined)
GEMV_FP8_GATED(geglu, GeluTanh, _pipelined, true, 1)
#endif
