// What some families do to the fused QKV GEMM's output before RoPE, in place on each row [Q heads | K heads | V heads].
// Qwen2's Q/K/V biases (add_qkv_bias) and Qwen3's per-head RMSNorm of Q and K (qk_norm); Llama needs neither.
#include "common.cuh"

// row += bias over the whole row (the biases of Q, K and V, concatenated as the rows of the fused weight).
// Launch: grid (T), block 128; width % 8 == 0 (16-byte vectors).  Twin: numpy_backend forward's `qkv += qkv_bias`.
extern "C" __global__ void add_qkv_bias(bf16* __restrict__ qkv, const bf16* __restrict__ bias, int width) {
    pdl_begin();
    bf16* row = qkv + (int64_t)blockIdx.x * width;
    for (int i = threadIdx.x * 8; i < width; i += blockDim.x * 8) {
        float x[8], b[8];
        load8(row + i, x);
        load8(bias + i, b);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] += b[j];
        store8(row + i, x);
    }
}

// Each Q head x <- x / sqrt(mean(x^2) + eps) * (offset + q_weight), each K head likewise with k_weight (one gain
// vector of head_dim for all heads; offset as norm.cu's: Gemma 3's 1, in float32); V is untouched.
// Launch: grid (T), block 128: one warp per head at a time; a lane reads and writes the same elements. The forward
// runs it only where cache.cu's rope_and_cache cannot apply the norms itself (ops.rope_fuses_qk_norm).
// Twin: numpy_backend.qk_norm.
extern "C" __global__ void qk_norm(bf16* __restrict__ qkv, const bf16* __restrict__ q_weight,
                                   const bf16* __restrict__ k_weight, int num_heads, int num_kv_heads, int head_dim,
                                   int row_stride, float eps, float offset) {
    pdl_begin();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    bf16* row = qkv + (int64_t)blockIdx.x * row_stride;
    for (int h = warp; h < num_heads + num_kv_heads; h += num_warps) {
        bf16* x = row + h * head_dim;
        const bf16* w = h < num_heads ? q_weight : k_weight;
        float sum_sq = 0.f;
        for (int i = lane; i < head_dim; i += 32) {
            const float v = __bfloat162float(x[i]);
            sum_sq += v * v;
        }
        const float inv_rms = rsqrtf(warp_reduce<Sum>(sum_sq) / head_dim + eps);
        for (int i = lane; i < head_dim; i += 32) x[i] = __float2bfloat16(__bfloat162float(x[i]) * inv_rms *
                                                                          (offset + __bfloat162float(w[i])));
    }
}

// Each token's whole Q x <- x / sqrt(mean(x^2) + eps) * q_weight over its q_width entries, its whole K likewise over
// kv_width with k_weight (OLMoE: one norm over all heads); V is untouched. A block per token; a thread reads and
// writes the same elements.  Twin: numpy_backend.qk_norm (per_head=False).
extern "C" __global__ void qk_norm_projection(bf16* __restrict__ qkv, const bf16* __restrict__ q_weight,
                                              const bf16* __restrict__ k_weight, int q_width, int kv_width,
                                              int row_stride, float eps) {
    pdl_begin();
    __shared__ float scratch[32];
    bf16* row = qkv + (int64_t)blockIdx.x * row_stride;
    for (int part = 0; part < 2; ++part) {
        bf16* x = row + (part ? q_width : 0);
        const bf16* w = part ? k_weight : q_weight;
        const int width = part ? kv_width : q_width;
        float sum_sq = 0.f;
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            const float v = __bfloat162float(x[i]);
            sum_sq += v * v;
        }
        const float inv_rms = rsqrtf(block_reduce<Sum>(sum_sq, scratch) / width + eps);
        for (int i = threadIdx.x; i < width; i += blockDim.x)
            x[i] = __float2bfloat16(__bfloat162float(x[i]) * inv_rms * __bfloat162float(w[i]));
    }
}
