// Write the new tokens' K and V into the paged cache (vLLM's reshape_and_cache), as bf16 or as fp8 (e4m3) codes.
// Twin: numpy_backend.write_kv_cache.
#include "common.cuh"

// For token t with slot = slot_mapping[t] >= 0: k_cache[slot] = K heads of qkv row t, v_cache[slot] = V heads.
// Caches are [num_slots, kv_heads, D] (slot = block * block_size + offset); qkv rows hold [q heads | k | v].
// A negative slot (a padded row of a captured decode batch) writes nothing.
// Launch: grid (T), block 128; each thread copies 16-byte chunks of K and V. kv_width % 8 == 0.
extern "C" __global__ void reshape_and_cache(bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                             const bf16* __restrict__ qkv, const int* __restrict__ slot_mapping,
                                             int q_width, int kv_width, int row_stride) {
    pdl_begin();
    const int64_t slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;
    const bf16* k = qkv + (int64_t)blockIdx.x * row_stride + q_width;
    const bf16* v = k + kv_width;
    for (int i = threadIdx.x * 8; i < kv_width; i += blockDim.x * 8) {
        *reinterpret_cast<uint4*>(k_cache + slot * kv_width + i) = *reinterpret_cast<const uint4*>(k + i);
        *reinterpret_cast<uint4*>(v_cache + slot * kv_width + i) = *reinterpret_cast<const uint4*>(v + i);
    }
}

// The same into an fp8 cache: each entry is the e4m3 code of value / scale, with the scale of its layer and KV head
// (k_scales, v_scales: this layer's [kv_heads], powers of two, so that multiplying by 1 / scale is exact: the numpy
// twin divides). head_dim % 8 == 0, so a thread's 8 entries share one head.
// Launch: grid (T), block 128; each thread converts 8 entries of K and of V at a time.
extern "C" __global__ void reshape_and_cache_fp8(e4m3* __restrict__ k_cache, e4m3* __restrict__ v_cache,
                                                 const bf16* __restrict__ qkv, const int* __restrict__ slot_mapping,
                                                 int q_width, int kv_width, int row_stride,
                                                 const float* __restrict__ k_scales,
                                                 const float* __restrict__ v_scales, int head_dim) {
    pdl_begin();
    const int64_t slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;
    const bf16* k = qkv + (int64_t)blockIdx.x * row_stride + q_width;
    const bf16* v = k + kv_width;
    for (int i = threadIdx.x * 8; i < kv_width; i += blockDim.x * 8) {
        const int head = i / head_dim;
        float x[8];
        load8(k + i, x);
        *reinterpret_cast<uint2*>(k_cache + slot * kv_width + i) = f32x8_to_e4m3x8(x, 1.f / k_scales[head]);
        load8(v + i, x);
        *reinterpret_cast<uint2*>(v_cache + slot * kv_width + i) = f32x8_to_e4m3x8(x, 1.f / v_scales[head]);
    }
}
