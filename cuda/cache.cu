// Rotary position embedding of the new tokens' q and k heads, and their K and V written into the paged cache (vLLM's
// rotary_embedding and reshape_and_cache in one kernel), as bf16 or as fp8 (e4m3) codes.
// Twins: numpy_backend.apply_rope, then numpy_backend.write_kv_cache.
#include "common.cuh"

// A cache entry from a bf16 value: itself, or in an fp8 cache the e4m3 code of value / scale, with the scale of
// its layer and KV head (powers of two, so that multiplying by 1 / scale is exact: the numpy twin divides), rounded
// to nearest even and saturated to +-448.
__device__ __forceinline__ void store_entry(bf16* p, bf16 v, float) { *p = v; }

__device__ __forceinline__ void store_entry(e4m3* p, bf16 v, float inv_scale) {
    *p = __nv_cvt_float_to_fp8(__bfloat162float(v) * inv_scale, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ void store_entries8(bf16* p, const bf16* v, float) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
}

__device__ __forceinline__ void store_entries8(e4m3* p, const bf16* v, float inv_scale) {
    float x[8];
    load8(v, x);
    *reinterpret_cast<uint2*>(p) = f32x8_to_e4m3x8(x, inv_scale);
}

// For token t (a qkv row [q heads | k heads | v heads]) at position positions[t]: q and k heads are rotated in place
// (rotate-half layout: for j < D/2, (x[j], x[j + D/2]) <- (x[j] cos - x[j + D/2] sin, x[j + D/2] cos + x[j] sin),
// angle = pos * inv_freq[j]); then, if slot = slot_mapping[t] >= 0, k_cache[slot] = the rotated K heads and
// v_cache[slot] = the V heads. A negative slot (a padded row of a captured decode batch) writes no cache entry.
// cos_sin [max_positions, D/2] is computed once on the host in float64 from rope_inv_freq, so Llama 3's frequency
// scaling costs nothing here and long positions keep their precision. Caches are [num_slots, kv_heads, D]
// (slot = block * block_size + offset); k_scales, v_scales: an fp8 cache's scales of this layer ([kv_heads] each),
// null for bf16.
// Launch: grid (T), block 128; threads stride over the (head, j) pairs of the row (consecutive threads touch
// consecutive j, so accesses coalesce), then over 16-byte chunks of V. D % 8 == 0.
template <typename C>
__device__ void rope_and_cache(bf16* __restrict__ qkv, C* __restrict__ k_cache, C* __restrict__ v_cache,
                               const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                               const float2* __restrict__ cos_sin, int num_heads, int num_kv_heads, int head_dim,
                               int row_stride, const float* __restrict__ k_scales,
                               const float* __restrict__ v_scales) {
    pdl_begin();
    const int half = head_dim / 2, kv_width = num_kv_heads * head_dim;
    const int64_t slot = slot_mapping[blockIdx.x];
    const float2* cs = cos_sin + (int64_t)positions[blockIdx.x] * half;
    bf16* row = qkv + (int64_t)blockIdx.x * row_stride;
    for (int i = threadIdx.x; i < (num_heads + num_kv_heads) * half; i += blockDim.x) {
        const int head = i / half, j = i % half;
        bf16* x = row + head * head_dim;
        const float x1 = __bfloat162float(x[j]), x2 = __bfloat162float(x[j + half]);
        const float2 c = cs[j];
        const bf16 r1 = __float2bfloat16(x1 * c.x - x2 * c.y), r2 = __float2bfloat16(x2 * c.x + x1 * c.y);
        x[j] = r1;
        x[j + half] = r2;
        const int kv_head = head - num_heads;
        if (kv_head >= 0 && slot >= 0) {
            C* k = k_cache + slot * kv_width + kv_head * head_dim;
            const float inv_scale = k_scales ? 1.f / k_scales[kv_head] : 1.f;
            store_entry(k + j, r1, inv_scale);
            store_entry(k + j + half, r2, inv_scale);
        }
    }
    if (slot < 0) return;
    const bf16* v = row + (num_heads + num_kv_heads) * head_dim;
    for (int i = threadIdx.x * 8; i < kv_width; i += blockDim.x * 8)
        store_entries8(v_cache + slot * kv_width + i, v + i, v_scales ? 1.f / v_scales[i / head_dim] : 1.f);
}

extern "C" __global__ void rope_and_cache_bf16(bf16* qkv, bf16* k_cache, bf16* v_cache, const int* positions,
                                               const int* slot_mapping, const float2* cos_sin, int num_heads,
                                               int num_kv_heads, int head_dim, int row_stride) {
    rope_and_cache(qkv, k_cache, v_cache, positions, slot_mapping, cos_sin, num_heads, num_kv_heads, head_dim,
                   row_stride, nullptr, nullptr);
}

extern "C" __global__ void rope_and_cache_fp8(bf16* qkv, e4m3* k_cache, e4m3* v_cache, const int* positions,
                                              const int* slot_mapping, const float2* cos_sin, int num_heads,
                                              int num_kv_heads, int head_dim, int row_stride, const float* k_scales,
                                              const float* v_scales) {
    rope_and_cache(qkv, k_cache, v_cache, positions, slot_mapping, cos_sin, num_heads, num_kv_heads, head_dim,
                   row_stride, k_scales, v_scales);
}
