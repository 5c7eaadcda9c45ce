// Rotary position embedding of the new tokens' q and k heads, and their K and V written into the paged cache (vLLM's
// rotary_embedding and reshape_and_cache in one kernel), as bf16 or as fp8 (e4m3) codes.
// Twins: numpy_backend.apply_rope, then numpy_backend.write_kv_cache.
#include "common.cuh"

// Cache entries from bf16 values: the values themselves, or in an fp8 cache the e4m3 codes of value / scale, with
// the scale of the layer and KV head, computed as value times the float32 1 / scale (as the numpy twin does; exact
// for the cache's own power-of-two scales), rounded to nearest even and saturated to +-448.
__device__ __forceinline__ void store_entries8(bf16* p, const bf16* v, float) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
}

__device__ __forceinline__ void store_entries8(e4m3* p, const bf16* v, float inv_scale) {
    float x[8];
    load8(v, x);
    *reinterpret_cast<uint2*>(p) = f32x8_to_e4m3x8(x, inv_scale);
}

// Four entries from four bf16 values (8 bytes).
__device__ __forceinline__ void store_entries4(bf16* p, const __nv_bfloat162 v[2], float) {
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(v);
}

__device__ __forceinline__ void store_entries4(e4m3* p, const __nv_bfloat162 v[2], float inv_scale) {
    const float2 a = __bfloat1622float2(v[0]), b = __bfloat1622float2(v[1]);
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a.x * inv_scale, a.y * inv_scale),
                                                             __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(b.x * inv_scale, b.y * inv_scale),
                                                             __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint32_t*>(p) = (uint32_t)lo | (uint32_t)hi << 16;
}

// A head's per-head RMSNorm (Qwen3's and Gemma 3's q_norm and k_norm) fused ahead of its rotation: lane group
// `quads` (a power of two <= 32, consecutive lanes) holds the whole head, 4 pairs (j .. j + 3 and j + R/2 ..) a
// lane, so the sum of squares is a shuffle within the group. x <- bf16(x / sqrt(mean(x^2) + eps) * (offset + w))
// as qkv.cu's qk_norm rounds it; w: q_weight for a Q head, k_weight for a K head. Every lane of the warp calls it.
__device__ __forceinline__ void norm_head(uint2& lo, uint2& hi, bool rotating, bool is_q, int j, int half, int quads,
                                          const bf16* __restrict__ q_weight, const bf16* __restrict__ k_weight,
                                          float eps, float offset) {
    __nv_bfloat162* a = reinterpret_cast<__nv_bfloat162*>(&lo);
    __nv_bfloat162* b = reinterpret_cast<__nv_bfloat162*>(&hi);
    float2 v[4] = {__bfloat1622float2(a[0]), __bfloat1622float2(a[1]), __bfloat1622float2(b[0]),
                   __bfloat1622float2(b[1])};
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) sum_sq += v[i].x * v[i].x + v[i].y * v[i].y;
    for (int o = quads / 2; o > 0; o >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, o);
    if (!rotating) return;
    const float inv_rms = rsqrtf(sum_sq / (8 * quads) + eps);
    const bf16* w = is_q ? q_weight : k_weight;
    const uint2 w_lo = *reinterpret_cast<const uint2*>(w + j), w_hi = *reinterpret_cast<const uint2*>(w + j + half);
    const __nv_bfloat162* wa = reinterpret_cast<const __nv_bfloat162*>(&w_lo);
    const __nv_bfloat162* wb = reinterpret_cast<const __nv_bfloat162*>(&w_hi);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 g = __bfloat1622float2(i < 2 ? wa[i] : wb[i - 2]);
        const __nv_bfloat162 r =
            __floats2bfloat162_rn(v[i].x * inv_rms * (offset + g.x), v[i].y * inv_rms * (offset + g.y));
        if (i < 2) a[i] = r; else b[i - 2] = r;
    }
}

// For token t (a qkv row [q heads | k heads | v heads]) at position positions[t]: the first R = rotary_dim dims of
// the q and k heads are rotated in place (rotate-half layout within them: for j < R/2, (x[j], x[j + R/2]) <-
// (x[j] c - x[j + R/2] s, x[j + R/2] c + x[j] s), (c, s) = cos_sin[pos, j]); dims R .. D - 1 pass unrotated
// (partial_rotary_factor < 1: Phi-4-mini). Then, if slot = slot_mapping[t] >= 0, k_cache[slot] = the rotated K heads
// and v_cache[slot] = the V heads. A negative slot (a padded row of a captured decode batch) writes no cache entry.
// cos_sin [max_positions, R/2] is computed once on the host in float64 (model/rope.py Rope.cos_sin), so frequency
// scaling (Llama 3's, LongRoPE's short and long factors and its attention factor) costs nothing here and long
// positions keep their precision; a layer with a RoPE of its own (Gemma 3's sliding layers) gets its own table.
// Caches are [num_slots, kv_heads, D] (slot = block * block_size + offset); k_scales, v_scales: an fp8 cache's scales
// of this layer ([kv_heads] each), null for bf16.
// q_weight, k_weight: the heads' RMSNorm gains (norm_head, before the rotation; rotary_dim == head_dim, head_dim / 8
// a power of two <= 32), or null for none.
// Launch: grid (T, ceil(items / blockDim.x)), block 128, with items = (num_heads + num_kv_heads) * R / 8 rotations
// of 4 pairs (j .. j + 3 of one head), then num_kv_heads * (D - R) / 8 copies of 8 unrotated K entries, then
// num_kv_heads * D / 8 copies of 8 V entries: one item per thread, so that a thread's loads are all in flight at
// once (at batch 1 this kernel is on the critical path; a loop over scalar pairs was ~12 dependent round trips).
// D % 8 == 0, R % 8 == 0.
template <typename C>
__device__ void rope_and_cache(bf16* __restrict__ qkv, C* __restrict__ k_cache, C* __restrict__ v_cache,
                               const int* __restrict__ positions, const int* __restrict__ slot_mapping,
                               const float2* __restrict__ cos_sin, int num_heads, int num_kv_heads, int head_dim,
                               int rotary_dim, int row_stride, const bf16* __restrict__ q_weight,
                               const bf16* __restrict__ k_weight, float eps, float offset,
                               const float* __restrict__ k_scales, const float* __restrict__ v_scales) {
    pdl_begin();
    const int half = rotary_dim / 2, quads = half / 4, kv_width = num_kv_heads * head_dim;
    const int tail = head_dim - rotary_dim, k_tails = num_kv_heads * tail;  // the unrotated K entries
    const int rotations = (num_heads + num_kv_heads) * quads, item = blockIdx.y * blockDim.x + threadIdx.x;
    const int64_t slot = slot_mapping[blockIdx.x];
    bf16* row = qkv + (int64_t)blockIdx.x * row_stride;
    const bool rotating = item < rotations;
    const int head = item / quads, j = item % quads * 4;
    bf16* x = row + head * head_dim;
    uint2 lo = make_uint2(0, 0), hi = make_uint2(0, 0);
    if (rotating) lo = *reinterpret_cast<const uint2*>(x + j), hi = *reinterpret_cast<const uint2*>(x + j + half);
    if (q_weight) norm_head(lo, hi, rotating, head < num_heads, j, half, quads, q_weight, k_weight, eps, offset);
    if (rotating) {
        // cos_sin[pos, j .. j + 3] as (cos, sin) pairs: 32 bytes, 32-byte aligned since half % 4 == 0
        const float4* cs = reinterpret_cast<const float4*>(cos_sin + (int64_t)positions[blockIdx.x] * half + j);
        const float4 cs01 = cs[0], cs23 = cs[1];
        const float c[4] = {cs01.x, cs01.z, cs23.x, cs23.z}, s[4] = {cs01.y, cs01.w, cs23.y, cs23.w};
        const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&lo);
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&hi);
        __nv_bfloat162 r1[2], r2[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const float2 x1 = __bfloat1622float2(a[k]), x2 = __bfloat1622float2(b[k]);
            const float c0 = c[2 * k], c1 = c[2 * k + 1], s0 = s[2 * k], s1 = s[2 * k + 1];
            r1[k] = __floats2bfloat162_rn(x1.x * c0 - x2.x * s0, x1.y * c1 - x2.y * s1);
            r2[k] = __floats2bfloat162_rn(x2.x * c0 + x1.x * s0, x2.y * c1 + x1.y * s1);
        }
        *reinterpret_cast<uint2*>(x + j) = *reinterpret_cast<const uint2*>(r1);
        *reinterpret_cast<uint2*>(x + j + half) = *reinterpret_cast<const uint2*>(r2);
        const int kv_head = head - num_heads;
        if (kv_head >= 0 && slot >= 0) {
            C* k = k_cache + slot * kv_width + kv_head * head_dim;
            const float inv_scale = k_scales ? 1.f / k_scales[kv_head] : 1.f;
            store_entries4(k + j, r1, inv_scale);
            store_entries4(k + j + half, r2, inv_scale);
        }
    } else if (slot >= 0) {
        int i = (item - rotations) * 8;
        if (i < k_tails) {  // never with tail 0 (the division)
            const int kv_head = i / tail, d = rotary_dim + i % tail;
            store_entries8(k_cache + slot * kv_width + kv_head * head_dim + d,
                           row + (num_heads + kv_head) * head_dim + d, k_scales ? 1.f / k_scales[kv_head] : 1.f);
            return;
        }
        i -= k_tails;
        if (i < kv_width)
            store_entries8(v_cache + slot * kv_width + i, row + (num_heads + num_kv_heads) * head_dim + i,
                           v_scales ? 1.f / v_scales[i / head_dim] : 1.f);
    }
}

extern "C" __global__ void rope_and_cache_bf16(bf16* qkv, bf16* k_cache, bf16* v_cache, const int* positions,
                                               const int* slot_mapping, const float2* cos_sin, int num_heads,
                                               int num_kv_heads, int head_dim, int rotary_dim, int row_stride,
                                               const bf16* q_weight, const bf16* k_weight, float eps, float offset) {
    rope_and_cache(qkv, k_cache, v_cache, positions, slot_mapping, cos_sin, num_heads, num_kv_heads, head_dim,
                   rotary_dim, row_stride, q_weight, k_weight, eps, offset, nullptr, nullptr);
}

extern "C" __global__ void rope_and_cache_fp8(bf16* qkv, e4m3* k_cache, e4m3* v_cache, const int* positions,
                                              const int* slot_mapping, const float2* cos_sin, int num_heads,
                                              int num_kv_heads, int head_dim, int rotary_dim, int row_stride,
                                              const bf16* q_weight, const bf16* k_weight, float eps, float offset,
                                              const float* k_scales, const float* v_scales) {
    rope_and_cache(qkv, k_cache, v_cache, positions, slot_mapping, cos_sin, num_heads, num_kv_heads, head_dim,
                   rotary_dim, row_stride, q_weight, k_weight, eps, offset, k_scales, v_scales);
}
