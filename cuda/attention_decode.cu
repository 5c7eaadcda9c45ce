// Paged attention for decode: one new query per sequence over its whole cached context (FlashDecoding-style).
// Twin: numpy_backend.paged_attention (its _decode_attention path).
//
// Grouped-query attention: a block serves G query heads that share one KV head, so each K/V row it loads from the
// cache feeds G dot products. Long contexts are split along the sequence into num_splits parts (grid.z) so that
// small batches still fill the GPU; with num_splits == 1 the block writes the final output itself, otherwise its
// normalized partial output and (m, l), merged by attention_combine.
//
// Why it is shaped so: decode attention only streams K/V from memory, so the kernel is about keeping many loads in
// flight. The block's threads form "token groups" of D/8 lanes (8 dims, one 16-byte load each per token row). Each
// group walks its own tokens U at a time, issuing the loads of U K rows and U V rows before using any, and keeps
// its own online softmax (running max m and sum l, log2 domain) and output accumulator: no barrier inside the
// loop. The groups' states are merged once at the end through shared memory.
#include "common.cuh"

#define NTHREADS 128  // 4 warps

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
    constexpr int LANES = D / 8;                      // lanes of one token group: 8 dims each
    constexpr int GROUPS = NTHREADS / LANES;          // token groups in the block
    constexpr int U = G <= 4 ? 4 : 2;                 // tokens a group has in flight (K and V rows each)
    constexpr int WARP_TOKENS = 32 / LANES * U;       // tokens a warp covers per iteration
    constexpr int STRIDE = NTHREADS / 32 * WARP_TOKENS;
    __shared__ float2 ml_s[GROUPS][G];                // each group's (m, l)
    __shared__ float red_s[GROUPS][G * D];            // each group's rescaled accumulator

    const int group = num_heads / num_kv_heads, head_chunks = (group + G - 1) / G;
    const int kvh = blockIdx.x / head_chunks, chunk = blockIdx.x % head_chunks;
    const int h0 = kvh * group + chunk * G, num_g = min(G, group - chunk * G);
    const int s = blockIdx.y, split = blockIdx.z;
    const int ctx = context_lens[s];
    const int per_split = (ctx + num_splits - 1) / num_splits;
    const int start = split * per_split, end = min(ctx, start + per_split);
    const int* table = block_tables + (int64_t)s * bt_stride[0];
    const int warp = threadIdx.x >> 5, group_id = threadIdx.x / LANES, part = threadIdx.x % LANES;
    const int group_in_warp = (threadIdx.x & 31) / LANES;
    const int64_t kv_stride = (int64_t)num_kv_heads * D;
    const int64_t dim0 = (int64_t)kvh * D + part * 8;

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
    float m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }

    // The loop bound is the same for all lanes of a warp (the shuffles need the whole warp); tokens past `end`
    // are masked instead.
    for (int base = start + warp * WARP_TOKENS; base < end; base += STRIDE) {
        const int t0 = base + group_in_warp * U;
        uint4 k_raw[U], v_raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int tok = t0 + u;
            if (tok < end) {
                const int64_t row = ((int64_t)table[tok / block_size] * block_size + tok % block_size) * kv_stride;
                k_raw[u] = *reinterpret_cast<const uint4*>(k_cache + row + dim0);
                v_raw[u] = *reinterpret_cast<const uint4*>(v_cache + row + dim0);
            } else {
                k_raw[u] = make_uint4(0, 0, 0, 0);
                v_raw[u] = make_uint4(0, 0, 0, 0);
            }
        }
        float sc[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&k_raw[u]);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 k = __bfloat1622float2(k2[i]);
                    dot += qr[g][2 * i] * k.x + qr[g][2 * i + 1] * k.y;
                }
#pragma unroll
                for (int o = LANES / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                sc[u][g] = t0 + u < end ? dot : -INFINITY;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float m_new = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) m_new = fmaxf(m_new, sc[u][g]);
            if (m_new == -INFINITY) continue;  // this group has seen no token yet
            const float alpha = exp2f(m[g] - m_new);
            l[g] *= alpha;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float p = exp2f(sc[u][g] - m_new);  // 0 for masked tokens
                const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v_raw[u]);
                l[g] += p;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 v = __bfloat1622float2(v2[i]);
                    acc[g][2 * i] += p * v.x;
                    acc[g][2 * i + 1] += p * v.y;
                }
            }
            m[g] = m_new;
        }
    }

    // Merge the groups: rescale each to the block's max, sum the accumulators and the sums, normalize.
    if (part == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) ml_s[group_id][g] = make_float2(m[g], l[g]);
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float block_m = -INFINITY;
#pragma unroll
        for (int i = 0; i < GROUPS; ++i) block_m = fmaxf(block_m, ml_s[i][g].x);
        const float w = m[g] == -INFINITY ? 0.f : exp2f(m[g] - block_m);
#pragma unroll
        for (int e = 0; e < 8; ++e) red_s[group_id][g * D + part * 8 + e] = acc[g][e] * w;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_g * D; i += NTHREADS) {
        const int g = i / D, d = i % D, h = h0 + g;
        float block_m = -INFINITY;
#pragma unroll
        for (int j = 0; j < GROUPS; ++j) block_m = fmaxf(block_m, ml_s[j][g].x);
        float sum = 0.f, l_total = 0.f;
#pragma unroll
        for (int j = 0; j < GROUPS; ++j) {
            sum += red_s[j][i];
            const float2 ml = ml_s[j][g];
            l_total += ml.x == -INFINITY ? 0.f : ml.y * exp2f(ml.x - block_m);
        }
        const float o = l_total > 0.f ? sum / l_total : 0.f;
        if (num_splits == 1) {
            out[((int64_t)s * num_heads + h) * D + d] = __float2bfloat16(o);
        } else {
            const int64_t idx = ((int64_t)s * num_heads + h) * num_splits + split;
            partial_o[idx * D + d] = o;
            if (d == 0) partial_ml[idx] = make_float2(block_m, l_total);
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
