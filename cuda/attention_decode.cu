// Paged attention for decode: one new query per sequence over its whole cached context (FlashDecoding-style).
// Twin: numpy_backend.paged_attention (its _decode_attention path).
//
// Grouped-query attention on tensor cores: the query heads that share one KV head are the rows of an mma.sync
// m16n8k16 tile (up to 16; Llama's groups of 4 or 8 leave rows empty, which costs nothing that matters), so
// S = Q K^T and O += P V are each one mma per 8 keys x 16 dims. A CUDA-core version spent ~28 instructions per
// key and head group on dot products, shuffles and conversions and was issue-bound at ~1.6 TB/s; here a key
// costs ~10 warp instructions and the kernel is left to stream K/V.
//
// Shape: a block of NWARPS = 4 warps serves one (sequence, KV head, split). Each warp walks its own tiles of TILE keys
// (every NWARPS-th tile), copying K and V straight to its shared memory with cp.async, one tile ahead (the next K
// arrives during this tile's softmax and P V, the next V during the next Q K^T), and keeps its own online
// softmax: no block barrier inside the loop.
// The warps' states are merged once at the end. Long contexts are split along the sequence into
// num_splits parts (grid.z) so that small batches still fill the GPU; with num_splits == 1 the block writes the
// final output itself, otherwise its normalized partial output and (m, l), merged by attention_combine.
//
// An fp8 cache (Cache = e4m3, the _fp8 kernels) moves half the bytes: each tile's codes land in the tail of the
// warp's bf16 tile, are widened to bf16 in place (exact), and the rest runs as for bf16. The K scale of the KV head
// folds into the softmax scale, the V scale into the output (both are powers of two: exact).
//
// Compiled with -DNWARPS (warps per block) from backends/cuda/ops.py, which also launches the kernels.
#include "common.cuh"
#include "mma.cuh"

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    // 16 bytes global -> shared without passing through registers; zero-filled where !valid
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Launch: grid (num_kv_heads * head_chunks, S, num_splits), block NWARPS * 32, where head_chunks =
// ceil(group / ROWS): chunk c of KV head kvh serves query heads kvh * group + c * ROWS ... (at most ROWS of them).
// ROWS is 8 or 16: with 8, the tile's upper 8 rows are known empty and their softmax is skipped.
// q: rows of the fused qkv buffer (row_stride elements apart); caches [slots, kv_heads, D]; block_tables
// [S, *bt_stride] (the stride is read from device memory so that a captured graph serves any table width);
// out [S, num_heads * D]; partial_o [S, num_heads, num_splits, D]; partial_ml [S, num_heads, num_splits] of (m, l).
// fp8: k_scales, v_scales are this layer's [num_kv_heads] (unused for bf16).
template <int D, int ROWS, class Cache>
__device__ void attention_decode(bf16* __restrict__ out, float* __restrict__ partial_o,
                                 float2* __restrict__ partial_ml, const bf16* __restrict__ q,
                                 const Cache* __restrict__ k_cache, const Cache* __restrict__ v_cache,
                                 const int* __restrict__ block_tables, const int* __restrict__ bt_stride,
                                 const int* __restrict__ context_lens, float scale, int num_heads, int num_kv_heads,
                                 int block_size, int row_stride, int num_splits, const float* __restrict__ k_scales,
                                 const float* __restrict__ v_scales) {
    pdl_begin();
    constexpr bool FP8 = sizeof(Cache) == 1;
    constexpr int VEC = 16 / sizeof(Cache);        // cache entries per 16-byte copy
    constexpr int TILE = 2048 / D;                 // keys per warp step: 4 KB of K and 4 KB of V
    constexpr int LD = D + 8;                      // padded smem row: ldmatrix without bank conflicts
    constexpr int PIECES = TILE * D / VEC / 32;    // 16-byte pieces of a K (or V) tile per lane
    constexpr int HALVES = ROWS / 8;               // row halves of the mma tile in use
    __shared__ __align__(16) bf16 kv_s[NWARPS][2][TILE * LD];
    __shared__ float2 ml_s[NWARPS][ROWS];
    static_assert(NWARPS * ROWS * D * sizeof(float) <= sizeof(kv_s), "the merge reuses kv_s");

    const int group = num_heads / num_kv_heads, head_chunks = (group + ROWS - 1) / ROWS;
    const int kvh = blockIdx.x / head_chunks, chunk = blockIdx.x % head_chunks;
    const int h0 = kvh * group + chunk * ROWS, num_g = min(ROWS, group - chunk * ROWS);
    const int s = blockIdx.y, split = blockIdx.z;
    const int ctx = context_lens[s];
    const int per_split = (ctx + num_splits - 1) / num_splits;
    const int start = split * per_split, end = min(ctx, start + per_split);
    const int* table = block_tables + (int64_t)s * bt_stride[0];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t kv_stride = (int64_t)num_kv_heads * D;
    bf16* k_s = kv_s[warp][0];
    bf16* v_s = kv_s[warp][1];

    // The K/V copies are pipelined: a tile's K is requested as soon as Q K^T of the previous tile is done (it
    // arrives during that tile's softmax and P V) and its V once P V is done; the block-table lookups of a tile are
    // issued before the wait for the previous one. This lane always moves the same 8 dims (`part`) of keys
    // row0 + i * ROW_STEP of a tile; slot[] holds their cache slots (-1 past `end`: zero-filled).
    constexpr int ROW_STEP = 32 / (D / VEC);
    const int part = lane % (D / VEC), row0 = lane / (D / VEC);
    const int64_t dim0 = (int64_t)kvh * D + part * VEC;
    int slot[PIECES];
    auto find_slots = [&](int tile0) {
#pragma unroll
        for (int i = 0; i < PIECES; ++i) {
            const int tok = tile0 + row0 + i * ROW_STEP;
            slot[i] = tok < end ? table[tok / block_size] * block_size + tok % block_size : -1;
        }
    };
    // fp8 codes land as dense rows [TILE][D] in the tail of the bf16 tile, which widen() then fills from the head.
    constexpr int CODES_OFFSET = TILE * LD * 2 - TILE * D;  // bytes
    auto piece = [&](bf16* tile, int i) -> void* {
        const int row = row0 + i * ROW_STEP;
        if constexpr (FP8) return reinterpret_cast<uint8_t*>(tile) + CODES_OFFSET + row * D + part * VEC;
        return &tile[row * LD + part * VEC];
    };
    auto fetch = [&](bf16* dst, const Cache* cache) {
#pragma unroll
        for (int i = 0; i < PIECES; ++i)
            cp_async16(piece(dst, i), cache + max(slot[i], 0) * kv_stride + dim0, slot[i] >= 0);
        cp_async_commit();
    };
    // fp8: this lane's landed pieces (its own copies: visible to it after the wait) -> bf16 rows of the tile.
    auto widen = [&](bf16* tile) {
        if constexpr (FP8) {
            uint4 codes[PIECES];
#pragma unroll
            for (int i = 0; i < PIECES; ++i) codes[i] = *reinterpret_cast<const uint4*>(piece(tile, i));
            __syncwarp();  // every lane has read its codes before any overwrites them
#pragma unroll
            for (int i = 0; i < PIECES; ++i) {
                uint4* dst = reinterpret_cast<uint4*>(&tile[(row0 + i * ROW_STEP) * LD + part * VEC]);
                dst[0] = e4m3x8_to_bf16x8(make_uint2(codes[i].x, codes[i].y));
                dst[1] = e4m3x8_to_bf16x8(make_uint2(codes[i].z, codes[i].w));
            }
            __syncwarp();
        }
    };
    int base = start + warp * TILE;
    if (base < end) {
        find_slots(base);
        fetch(k_s, k_cache);
        fetch(v_s, v_cache);
    }

    // Q tile (rows past num_g are zero), staged once per block while the first K/V tiles are on their way, then
    // held by each warp as mma A fragments.
    __shared__ __align__(16) bf16 q_s[16 * LD];
    for (int c = threadIdx.x; c < 16 * D / 8; c += blockDim.x) {
        const int r = c / (D / 8), p = c % (D / 8);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < num_g) v = *reinterpret_cast<const uint4*>(q + (int64_t)s * row_stride + (h0 + r) * D + p * 8);
        *reinterpret_cast<uint4*>(&q_s[r * LD + p * 8]) = v;
    }
    __syncthreads();
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], &q_s[(lane % 16) * LD + kk * 16 + (lane / 16) * 8]);

    const float scale_log2 = scale * 1.4426950408889634f * (FP8 ? k_scales[kvh] : 1.f);
    const float v_scale = FP8 ? v_scales[kvh] : 1.f;
    float m[HALVES], l[HALVES], o[D / 8][4];
    int key_end[HALVES];  // every row sees the keys before `end`
#pragma unroll
    for (int h = 0; h < HALVES; ++h) m[h] = -INFINITY, l[h] = 0.f, key_end[h] = end;
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;

    for (; base < end; base += NWARPS * TILE) {
        const int next = base + NWARPS * TILE;
        if (next < end) find_slots(next);  // the table loads overlap the wait below
        cp_async_wait<1>();  // this tile's K has landed (its V may still be in flight)
        __syncwarp();
        widen(k_s);

        // S = Q K^T: 16 rows x TILE keys, as n-blocks of 8 keys.
        float sacc[TILE / 8][4];
        mma_qk<D, TILE, LD>(sacc, qf, k_s, lane);
        __syncwarp();  // every lane is done with k_s
        if (next < end) fetch(k_s, k_cache);

        // Online softmax of this thread's rows; m stays finite: key `base` < end is in this tile.
        online_softmax<TILE, D, HALVES>(sacc, m, l, o, base, lane, scale_log2, key_end);

        if (next < end) {
            cp_async_wait<1>();  // this tile's V has landed (the next K may not have)
        } else {
            cp_async_wait<0>();
        }
        __syncwarp();
        widen(v_s);
        // O += P V, 16 keys per k-step (rows 8-15 of P are zero when only 8 are in use).
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
            const uint32_t p[4] = {pack_bf16(sacc[2 * kk][0], sacc[2 * kk][1]),
                                   HALVES == 2 ? pack_bf16(sacc[2 * kk][2], sacc[2 * kk][3]) : 0u,
                                   pack_bf16(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]),
                                   HALVES == 2 ? pack_bf16(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]) : 0u};
            mma_pv<D, LD>(o, p, &v_s[kk * 16 * LD], lane);
        }
        __syncwarp();  // every lane is done with v_s
        if (next < end) fetch(v_s, v_cache);
    }

    // Merge the warps: each one's (m, l) and unnormalized output rows through shared memory.
    __syncthreads();  // every warp is done with kv_s
    float* o_s = reinterpret_cast<float*>(&kv_s[0][0][0]);  // [NWARPS][ROWS][D]
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const int row = lane / 4 + 8 * h;
        if (lane % 4 == 0) ml_s[warp][row] = make_float2(m[h], l[h]);
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd)
            *reinterpret_cast<float2*>(&o_s[(warp * ROWS + row) * D + nd * 8 + (lane % 4) * 2]) =
                make_float2(o[nd][2 * h], o[nd][2 * h + 1]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_g * D; i += blockDim.x) {
        const int g = i / D, d = i % D, h = h0 + g;
        float block_m = -INFINITY;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) block_m = fmaxf(block_m, ml_s[w][g].x);
        float sum = 0.f, l_total = 0.f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float2 ml = ml_s[w][g];
            if (ml.x == -INFINITY) continue;  // this warp saw no key
            const float weight = exp2f(ml.x - block_m);
            sum += o_s[(w * ROWS + g) * D + d] * weight;
            l_total += ml.y * weight;
        }
        const float o_final = l_total > 0.f ? sum / l_total * v_scale : 0.f;
        if (num_splits == 1) {
            out[((int64_t)s * num_heads + h) * D + d] = __float2bfloat16(o_final);
        } else {
            const int64_t idx = ((int64_t)s * num_heads + h) * num_splits + split;
            partial_o[idx * D + d] = o_final;
            if (d == 0) partial_ml[idx] = make_float2(block_m, l_total);
        }
    }
}

// Merge the splits of each (sequence, head): weights w_z = l_z * 2^(m_z - max m), out = sum w_z o_z / sum w_z.
// Launch: grid (num_heads, S), block D: one thread per output dim.
extern "C" __global__ void attention_combine(bf16* __restrict__ out, const float* __restrict__ partial_o,
                                             const float2* __restrict__ partial_ml, int num_splits) {
    pdl_begin();
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

#define DECODE_KERNEL(D, ROWS)                                                                                    \
    extern "C" __global__ void __launch_bounds__(NWARPS * 32) attention_decode_d##D##_r##ROWS(                    \
        bf16* out, float* partial_o, float2* partial_ml, const bf16* q, const bf16* k_cache, const bf16* v_cache, \
        const int* block_tables, const int* bt_stride, const int* context_lens, float scale, int num_heads,       \
        int num_kv_heads, int block_size, int row_stride, int num_splits) {                                       \
        attention_decode<D, ROWS, bf16>(out, partial_o, partial_ml, q, k_cache, v_cache, block_tables, bt_stride,\
                                        context_lens, scale, num_heads, num_kv_heads, block_size, row_stride,    \
                                        num_splits, nullptr, nullptr);                                            \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(NWARPS * 32) attention_decode_fp8_d##D##_r##ROWS(                \
        bf16* out, float* partial_o, float2* partial_ml, const bf16* q, const e4m3* k_cache, const e4m3* v_cache, \
        const int* block_tables, const int* bt_stride, const int* context_lens, float scale, int num_heads,       \
        int num_kv_heads, int block_size, int row_stride, int num_splits, const float* k_scales,                  \
        const float* v_scales) {                                                                                  \
        attention_decode<D, ROWS, e4m3>(out, partial_o, partial_ml, q, k_cache, v_cache, block_tables, bt_stride,\
                                        context_lens, scale, num_heads, num_kv_heads, block_size, row_stride,    \
                                        num_splits, k_scales, v_scales);                                          \
    }
DECODE_KERNEL(64, 8)
DECODE_KERNEL(64, 16)
DECODE_KERNEL(128, 8)
DECODE_KERNEL(128, 16)
