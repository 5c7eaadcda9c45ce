// Write the new tokens' K and V into the paged cache (vLLM's reshape_and_cache).  Twin: numpy_backend.write_kv_cache.
#include "common.cuh"

// For token t with slot = slot_mapping[t] >= 0: k_cache[slot] = K heads of qkv row t, v_cache[slot] = V heads.
// Caches are [num_slots, kv_heads, D] (slot = block * block_size + offset); qkv rows hold [q heads | k | v].
// A negative slot (a padded row of a captured decode batch) writes nothing.
// Launch: grid (T), block 128; each thread copies 16-byte chunks of K and V. kv_width % 8 == 0.
extern "C" __global__ void reshape_and_cache(bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                             const bf16* __restrict__ qkv, const int* __restrict__ slot_mapping,
                                             int q_width, int kv_width, int row_stride) {
    const int64_t slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;
    const bf16* k = qkv + (int64_t)blockIdx.x * row_stride + q_width;
    const bf16* v = k + kv_width;
    for (int i = threadIdx.x * 8; i < kv_width; i += blockDim.x * 8) {
        *reinterpret_cast<uint4*>(k_cache + slot * kv_width + i) = *reinterpret_cast<const uint4*>(k + i);
        *reinterpret_cast<uint4*>(v_cache + slot * kv_width + i) = *reinterpret_cast<const uint4*>(v + i);
    }
}
