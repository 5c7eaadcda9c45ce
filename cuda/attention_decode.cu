// Paged attention for decode: one new query per sequence over its whole cached context (FlashDecoding-style).
// Twin: numpy_backend.paged_attention (its _decode_attention path).
//
// Grouped-query attention: a block serves G query heads that share one KV head, so each K/V row it loads from the
// cache feeds G dot products. Long contexts are split along the sequence into num_splits parts (grid.z) so that
// small batches still fill the GPU; each part keeps an online softmax (running max m and sum l, in the log2
// domain) and writes its normalized partial output, and attention_combine merges the parts. With num_splits == 1
// the block writes the final output itself.
#include "common.cuh"

#define NTHREADS 128  // 4 warps
#define TILE 64       // context tokens per step: scores in shared memory, then softmax update, then P.V

// Launch: grid (num_kv_heads * head_chunks, S, num_splits), block 128, where head_chunks = ceil(group / G): chunk c
// of KV head kvh serves query heads kvh * group + c * G ... (at most G of them).
// q: rows of the fused qkv buffer (row_stride elements apart); caches [slots, kv_heads, D]; block_tables
// [S, *bt_stride] (the stride is read from device memory so that a captured graph serves any table width);
// out [S, num_heads * D]; partial_o [S, num_heads, num_splits, D]; partial_ml [S, num_heads, num_splits] of (m, l).
template <int D, int G>
__device__ void attention_decode(bf16* __restrict__ out, float* __restrict__ partial_o,
                                 float2* __restrict__ partial_ml, const bf16* __restrict__ q,
                                 const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                 const int* __restrict__ block_tables, const int* __restrict__ bt_stride,
                                 const int* __restrict__ context_lens, float scale, int num_heads, int num_kv_heads,
                                 int block_size, int row_stride, int num_splits) {
    constexpr int LANES = D / 8;             // lanes that share one token: 8 dims (16 bytes) each
    constexpr int TOKENS = 32 / LANES;       // tokens a warp scores at once
    constexpr int SLOTS = NTHREADS / LANES;  // token slots of the P.V step
    __shared__ float p_s[G][TILE];           // scores, then probabilities, of the current tile
    __shared__ float m_s[G], l_s[G], alpha_s[G];
    __shared__ float red_s[SLOTS][G * D];    // per-slot partial outputs, summed at the end

    const int group = num_heads / num_kv_heads, head_chunks = (group + G - 1) / G;
    const int kvh = blockIdx.x / head_chunks, chunk = blockIdx.x % head_chunks;
    const int h0 = kvh * group + chunk * G, num_g = min(G, group - chunk * G);
    const int s = blockIdx.y, split = blockIdx.z;
    const int ctx = context_lens[s];
    const int per_split = ((ctx + num_splits - 1) / num_splits + TILE - 1) / TILE * TILE;
    const int start = split * per_split, end = min(ctx, start + per_split);
    const int* table = block_tables + (int64_t)s * bt_stride[0];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int part = lane % LANES;  // score step: this lane's 8 dims of q and k
    const int slot_id = threadIdx.x / LANES, dpart = threadIdx.x % LANES;  // P.V step: token slot, 8 dims of v
    const int64_t kv_stride = (int64_t)num_kv_heads * D;

    // This lane's 8 dims of each served query, pre-scaled so that exp2 gives the softmax.
    float qr[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g < num_g) {
            load8(q + (int64_t)s * row_stride + (h0 + g) * D + part * 8, qr[g]);
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] *= scale * 1.4426950408889634f;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] = 0.f;
        }
    }
    if (threadIdx.x < G) {
        m_s[threadIdx.x] = -INFINITY;
        l_s[threadIdx.x] = 0.f;
        alpha_s[threadIdx.x] = 1.f;
    }
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    __syncthreads();

    for (int t0 = start; t0 < end; t0 += TILE) {
        // 1. Scores: warp w scores tokens t0 + 16w ... t0 + 16w + 15, TOKENS at a time; LANES lanes per token.
#pragma unroll
        for (int it = 0; it < TILE / 4 / TOKENS; ++it) {
            const int j = warp * (TILE / 4) + it * TOKENS + lane / LANES, tok = t0 + j;
            float sc[G];
#pragma unroll
            for (int g = 0; g < G; ++g) sc[g] = 0.f;
            if (tok < end) {
                const int64_t slot = (int64_t)table[tok / block_size] * block_size + tok % block_size;
                float k[8];
                load8(k_cache + slot * kv_stride + kvh * D + part * 8, k);
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int e = 0; e < 8; ++e) sc[g] += qr[g][e] * k[e];
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int o = LANES / 2; o > 0; o >>= 1) sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], o);
                if (part == 0) p_s[g][j] = tok < end ? sc[g] : -INFINITY;
            }
        }
        __syncthreads();
        // 2. Online softmax update, one warp per query head: the tile's max, p = exp2(s - m), rescale factor.
        for (int g = warp; g < num_g; g += NTHREADS / 32) {
            const float s0 = p_s[g][lane], s1 = p_s[g][lane + 32];
            const float m_new = fmaxf(m_s[g], warp_max(fmaxf(s0, s1)));  // finite: the tile has a valid token
            const float p0 = exp2f(s0 - m_new), p1 = exp2f(s1 - m_new);
            p_s[g][lane] = p0;
            p_s[g][lane + 32] = p1;
            const float tile_sum = warp_sum(p0 + p1);
            if (lane == 0) {
                const float alpha = exp2f(m_s[g] - m_new);
                alpha_s[g] = alpha;
                l_s[g] = l_s[g] * alpha + tile_sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();
        // 3. acc = acc * alpha + P.V: each thread owns 8 dims of v for the tokens of its slot.
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float alpha = alpha_s[g];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
        }
        for (int j = slot_id; j < TILE && t0 + j < end; j += SLOTS) {
            const int tok = t0 + j;
            const int64_t slot = (int64_t)table[tok / block_size] * block_size + tok % block_size;
            float v[8];
            load8(v_cache + slot * kv_stride + kvh * D + dpart * 8, v);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = p_s[g][j];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] += p * v[e];
            }
        }
        __syncthreads();  // p_s is overwritten by the next tile
    }

    // Sum the slots' partial outputs, normalize by l, write the output (or this split's part of it).
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) red_s[slot_id][g * D + dpart * 8 + e] = acc[g][e];
    __syncthreads();
    for (int i = threadIdx.x; i < num_g * D; i += NTHREADS) {
        float sum = 0.f;
#pragma unroll
        for (int sl = 0; sl < SLOTS; ++sl) sum += red_s[sl][i];
        const int g = i / D, d = i % D, h = h0 + g;
        const float l = l_s[g];
        const float o = l > 0.f ? sum / l : 0.f;
        if (num_splits == 1) {
            out[((int64_t)s * num_heads + h) * D + d] = __float2bfloat16(o);
        } else {
            const int64_t idx = ((int64_t)s * num_heads + h) * num_splits + split;
            partial_o[idx * D + d] = o;
            if (d == 0) partial_ml[idx] = make_float2(m_s[g], l);
        }
    }
}

// Merge the splits of each (sequence, head): weights w_z = l_z * 2^(m_z - max m), out = sum w_z o_z / sum w_z.
// Launch: grid (num_heads, S), block D: one thread per output dim.
extern "C" __global__ void attention_combine(bf16* __restrict__ out, const float* __restrict__ partial_o,
                                             const float2* __restrict__ partial_ml, int num_splits) {
    const int num_heads = gridDim.x, D = blockDim.x;
    const int64_t base = ((int64_t)blockIdx.y * num_heads + blockIdx.x) * num_splits;
    float m = -INFINITY;
    for (int z = 0; z < num_splits; ++z) m = fmaxf(m, partial_ml[base + z].x);
    float num = 0.f, den = 0.f;
    for (int z = 0; z < num_splits; ++z) {
        const float2 ml = partial_ml[base + z];
        const float w = ml.y > 0.f ? ml.y * exp2f(ml.x - m) : 0.f;
        num += w * partial_o[(base + z) * D + threadIdx.x];
        den += w;
    }
    out[((int64_t)blockIdx.y * num_heads + blockIdx.x) * D + threadIdx.x] =
        __float2bfloat16(den > 0.f ? num / den : 0.f);
}

#define DECODE_KERNEL(D, G)                                                                                       \
    extern "C" __global__ void __launch_bounds__(NTHREADS) attention_decode_d##D##_g##G(                         \
        bf16* out, float* partial_o, float2* partial_ml, const bf16* q, const bf16* k_cache, const bf16* v_cache, \
        const int* block_tables, const int* bt_stride, const int* context_lens, float scale, int num_heads,       \
        int num_kv_heads, int block_size, int row_stride, int num_splits) {                                       \
        attention_decode<D, G>(out, partial_o, partial_ml, q, k_cache, v_cache, block_tables, bt_stride,         \
                               context_lens, scale, num_heads, num_kv_heads, block_size, row_stride, num_splits); \
    }
DECODE_KERNEL(64, 1)
DECODE_KERNEL(64, 2)
DECODE_KERNEL(64, 4)
DECODE_KERNEL(64, 8)
DECODE_KERNEL(128, 1)
DECODE_KERNEL(128, 2)
DECODE_KERNEL(128, 4)
DECODE_KERNEL(128, 8)
