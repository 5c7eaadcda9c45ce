// Causal attention for prefill: the new queries of each sequence (packed back to back, variable lengths) over the
// sequence's whole context read from the paged cache. Twin: numpy_backend.paged_attention (prefill path).
//
// FlashAttention-2 on tensor cores: mma.sync m16n8k16 with bf16 operands and float32 accumulators, online softmax
// in registers. Query i (0-based among the new tokens) of sequence s sits at position context_lens[s] - q_len + i
// and sees keys 0 .. that position, so the same kernel serves a prompt, a prompt whose prefix is already cached and
// a chunk of a long prompt; with a sliding window of W keys it sees the keys position - W + 1 .. position only, and a
// tile loads no key before the first one its rows see (a block that left the window may be freed and reused).
// Attention-logit soft-capping (Gemma 2) turns each scaled score x into softcap * tanh(x / softcap). Grouped-query
// attention: the rows of a tile are (query, head) pairs of the `group`
// query heads of one KV head, token-major, so each K/V tile loaded into shared memory serves all of them.
//
// An fp8 cache (Cache = e4m3, the _fp8 kernels) is widened to bf16 (exactly) as its tiles are staged; the KV head's
// K scale folds into the softmax scale and its V scale into the output (powers of two: exact).
//
// Batch-invariant (the _inv kernels; EngineConfig.batch_invariant): a row's keys are softmaxed in chunks of
// INV_CHUNK keys from key 0, folded in order (mma.cuh, fold_chunk), as attention_decode's _inv kernels do, so that a
// token's attention output has the same bits whether it was prefilled, in any chunk, or decoded.
//
// Compiled with -DBLOCK_M (rows, i.e. (query, head) pairs, per block: 16 per warp) and -DINV_CHUNK from
// backends/cuda/ops.py, which also lists the tiles and launches the kernels.
#include "common.cuh"
#include "mma.cuh"

// Launch: grid (num_tiles, num_kv_heads), block BLOCK_M / 16 warps; head dims 64, 96, 128 and 256. Tile b covers
// rows tile_row0[b] .. tile_row0[b] + BLOCK_M - 1 of sequence tile_seq[b], whose rows are q_len * group (query i,
// head g) pairs, row = i * group + g; the host lists the tiles. Shared memory: K and V tiles [BLOCK_N][D + 8]
// (padding keeps ldmatrix conflict-free); the Q tile [BLOCK_M][D + 8] is staged in them first (its rows past BLOCK_N
// in V's).
// qkv rows are row_stride elements apart; caches [slots, kv_heads, D]; out [T, num_heads * D]. fp8: k_scales,
// v_scales are this layer's [num_kv_heads] (unused for bf16). window (0: none) and softcap (0: none) are the layer's,
// uniform branches: a layer without them does no per-key work for them.
// tile_seq and tile_row0 are not __restrict__: ptxas would move their non-coherent loads, the kernel's first,
// above pdl_begin's wait (common.cuh).
template <int D, class Cache, bool INVARIANT>
__device__ void attention_prefill(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                                  const Cache* __restrict__ k_cache, const Cache* __restrict__ v_cache,
                                  const int* __restrict__ block_tables, int bt_stride,
                                  const int* __restrict__ query_start_loc, const int* __restrict__ context_lens,
                                  const int* tile_seq, const int* tile_row0, float scale,
                                  int num_heads, int num_kv_heads, int block_size, int row_stride, int window,
                                  float softcap, const float* __restrict__ k_scales,
                                  const float* __restrict__ v_scales) {
    pdl_begin();
    constexpr bool FP8 = sizeof(Cache) == 1;
    constexpr int LD = D + 8, BLOCK_N = block_n(D);
    static_assert(BLOCK_M <= 2 * BLOCK_N && BLOCK_N % 16 == 0, "the Q tile is staged in the K and V tiles");
    __shared__ __align__(16) bf16 k_s[BLOCK_N * LD];
    __shared__ __align__(16) bf16 v_s[BLOCK_N * LD];
    auto q_s = [&](int r) -> bf16* {  // Q row r while staged (a warp's 16 rows lie in one of the tiles)
        if constexpr (BLOCK_M <= BLOCK_N) return &k_s[r * LD];
        else return r < BLOCK_N ? &k_s[r * LD] : &v_s[(r - BLOCK_N) * LD];
    };

    const int seq = tile_seq[blockIdx.x], row0 = tile_row0[blockIdx.x], kvh = blockIdx.y;
    const int group = num_heads / num_kv_heads;
    const int q_start = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q_start;
    const int past = context_lens[seq] - q_len;  // tokens before the first new query
    const int num_rows = q_len * group;
    const int* table = block_tables + (int64_t)seq * bt_stride;
    const int64_t kv_stride = (int64_t)num_kv_heads * D;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // Stage the Q tile in q_s (rows past the sequence's end repeat its last row and are never stored), then take
    // each warp's 16 rows as mma A fragments, one per 16 dims.
    for (int c = threadIdx.x; c < BLOCK_M * D / 8; c += blockDim.x) {
        const int r = c / (D / 8), part = c % (D / 8);
        const int row = min(row0 + r, num_rows - 1), i = row / group, g = row % group;
        uint4* dst = reinterpret_cast<uint4*>(q_s(r) + part * 8);
        *dst = *reinterpret_cast<const uint4*>(qkv + (int64_t)(q_start + i) * row_stride + (kvh * group + g) * D
                                               + part * 8);
    }
    __syncthreads();
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], q_s(warp * 16 + lane % 16) + kk * 16 + (lane / 16) * 8);
    __syncthreads();

    // This thread's two rows (lane / 4 and lane / 4 + 8 of the warp's 16), their query positions and the keys they
    // see (up to the position, from the window's first).
    int key_begin[2], key_end[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int pos = past + min(row0 + warp * 16 + lane / 4 + 8 * h, num_rows - 1) / group;
        key_begin[h] = window > 0 ? max(0, pos - window + 1) : 0;
        key_end[h] = pos + 1;
    }
    // The keys any row of the tile sees: from its first row's window start (kv_first) to its last row's position.
    // The key tiles start at multiples of BLOCK_N whatever the rows, so that a row's softmax and P V add up the
    // same tiles in the same order in any tile, chunk or decode step that holds it (batch invariance); keys before
    // kv_first load as zeros (their blocks may be freed), masked like every key outside a row's own range.
    const int kv_first = window > 0 ? max(0, past + row0 / group - window + 1) : 0;
    const int kv_begin = kv_first / BLOCK_N * BLOCK_N;
    const int kv_end = past + min(row0 + BLOCK_M - 1, num_rows - 1) / group + 1;
    const float score_scale = scale * (FP8 ? k_scales[kvh] : 1.f);
    // soft-capped, the scores are tanh(raw * score_scale / softcap) (soft_cap_scores), times softcap * log2(e) here
    const float scale_log2 = 1.4426950408889634f * (softcap > 0.f ? softcap : score_scale);
    const float cap_scale = softcap > 0.f ? score_scale / softcap : 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[D / 8][4];
    // INVARIANT: the chunks before n0's folded (mma.cuh, fold_chunk): the state attention_decode's _inv kernels
    // reach for the same row
    float M[2] = {-INFINITY, -INFINITY}, L[2] = {0.f, 0.f}, O[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
        o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
        O[nd][0] = O[nd][1] = O[nd][2] = O[nd][3] = 0.f;
    }

    for (int n0 = kv_begin; n0 < kv_end; n0 += BLOCK_N) {
        if (INVARIANT && n0 > kv_begin && n0 % INV_CHUNK == 0) fold_chunk<D, 2>(M, L, O, m, l, o);
        // K and V of keys n0 .. n0 + BLOCK_N - 1 through the block table; keys outside kv_first .. kv_end - 1 are
        // zeros (never NaN garbage).
        for (int c = threadIdx.x; c < BLOCK_N * D / 8; c += blockDim.x) {
            const int j = c / (D / 8), part = c % (D / 8), tok = n0 + j;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (tok >= kv_first && tok < kv_end) {
                const int64_t slot = (int64_t)table[tok / block_size] * block_size + tok % block_size;
                const int64_t off = slot * kv_stride + kvh * D + part * 8;
                if constexpr (FP8) {
                    kv = e4m3x8_to_bf16x8(*reinterpret_cast<const uint2*>(k_cache + off));
                    vv = e4m3x8_to_bf16x8(*reinterpret_cast<const uint2*>(v_cache + off));
                } else {
                    kv = *reinterpret_cast<const uint4*>(k_cache + off);
                    vv = *reinterpret_cast<const uint4*>(v_cache + off);
                }
            }
            *reinterpret_cast<uint4*>(&k_s[j * LD + part * 8]) = kv;
            *reinterpret_cast<uint4*>(&v_s[j * LD + part * 8]) = vv;
        }
        __syncthreads();

        // S = Q K^T: 16 rows x BLOCK_N keys per warp, as n-blocks of 8 keys.
        float sacc[BLOCK_N / 8][4];
        mma_qk<D, BLOCK_N, LD>(sacc, qf, k_s, lane);

        // Causal (and window) mask and online softmax. Without a window key 0 is in every row's first tile; with
        // one a row's first keys may come in a later tile (EMPTY_ROWS).
        if (softcap > 0.f) soft_cap_scores<BLOCK_N, 2>(sacc, cap_scale);
        online_softmax<BLOCK_N, D, 2, true>(sacc, m, l, o, n0, lane, scale_log2, key_begin, key_end);

        // O += P V, 16 keys per k-step.
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            const uint32_t p[4] = {pack_bf16(sacc[2 * kk][0], sacc[2 * kk][1]),
                                   pack_bf16(sacc[2 * kk][2], sacc[2 * kk][3]),
                                   pack_bf16(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]),
                                   pack_bf16(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3])};
            mma_pv<D, LD>(o, p, &v_s[kk * 16 * LD], lane);
        }
        __syncthreads();  // the next tile overwrites k_s and v_s
    }

    if constexpr (INVARIANT) fold_chunk<D, 2>(M, L, O, m, l, o);
    // Normalize and store this thread's two rows (rows past the sequence's end are dropped).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if constexpr (!INVARIANT) {
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        }
        const int row = row0 + warp * 16 + lane / 4 + 8 * h;
        if (row >= num_rows) continue;
        const int i = row / group, head = kvh * group + row % group;
        bf16* dst = out + ((int64_t)(q_start + i) * num_heads + head) * D + (lane % 4) * 2;
        const float v_scale = FP8 ? v_scales[kvh] : 1.f;
        if constexpr (INVARIANT) {  // as attention_decode's _inv kernels normalize
            const float inv = L[h] > 0.f ? v_scale / L[h] : 0.f;
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd)
                *reinterpret_cast<__nv_bfloat162*>(dst + nd * 8) =
                    __floats2bfloat162_rn(O[nd][2 * h] * inv, O[nd][2 * h + 1] * inv);
            continue;
        }
        const float inv_l = v_scale / l[h];
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd)
            *reinterpret_cast<__nv_bfloat162*>(dst + nd * 8) =
                __floats2bfloat162_rn(o[nd][2 * h] * inv_l, o[nd][2 * h + 1] * inv_l);
    }
}

// SUFFIX: empty (INVARIANT false) or _inv (true)
#define PREFILL_KERNEL(D, SUFFIX, INVARIANT)                                                                       \
    extern "C" __global__ void __launch_bounds__(BLOCK_M / 16 * 32) attention_prefill_d##D##SUFFIX(              \
        bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache, const int* block_tables,             \
        int bt_stride, const int* query_start_loc, const int* context_lens, const int* tile_seq,                    \
        const int* tile_row0, float scale, int num_heads, int num_kv_heads, int block_size, int row_stride,         \
        int window, float softcap) {                                                                               \
        attention_prefill<D, bf16, INVARIANT>(out, qkv, k_cache, v_cache, block_tables, bt_stride,               \
                                              query_start_loc, context_lens, tile_seq, tile_row0, scale,           \
                                              num_heads, num_kv_heads, block_size, row_stride, window, softcap,    \
                                              nullptr, nullptr);                                                   \
    }
#define PREFILL_KERNEL_FP8(D, SUFFIX, INVARIANT)                                                                   \
    extern "C" __global__ void __launch_bounds__(BLOCK_M / 16 * 32) attention_prefill_fp8_d##D##SUFFIX(          \
        bf16* out, const bf16* qkv, const e4m3* k_cache, const e4m3* v_cache, const int* block_tables,             \
        int bt_stride, const int* query_start_loc, const int* context_lens, const int* tile_seq,                    \
        const int* tile_row0, float scale, int num_heads, int num_kv_heads, int block_size, int row_stride,         \
        int window, float softcap, const float* k_scales, const float* v_scales) {                                 \
        attention_prefill<D, e4m3, INVARIANT>(out, qkv, k_cache, v_cache, block_tables, bt_stride,               \
                                              query_start_loc, context_lens, tile_seq, tile_row0, scale,           \
                                              num_heads, num_kv_heads, block_size, row_stride, window, softcap,    \
                                              k_scales, v_scales);                                                 \
    }
#if KEEPS(attention_prefill_d64)
PREFILL_KERNEL(64, , false)
#endif
#if KEEPS(attention_prefill_d64_inv)
PREFILL_KERNEL(64, _inv, true)
#endif
#if KEEPS(attention_prefill_fp8_d64)
PREFILL_KERNEL_FP8(64, , false)
#endif
#if KEEPS(attention_prefill_fp8_d64_inv)
PREFILL_KERNEL_FP8(64, _inv, true)
#endif
#if KEEPS(attention_prefill_d128)
PREFILL_KERNEL(128, , false)
#endif
#if KEEPS(attention_prefill_d128_inv)
PREFILL_KERNEL(128, _inv, true)
#endif
#if KEEPS(attention_prefill_fp8_d128)
PREFILL_KERNEL_FP8(128, , false)
#endif
#if KEEPS(attention_prefill_fp8_d128_inv)
PREFILL_KERNEL_FP8(128, _inv, true)
#endif
#if KEEPS(attention_prefill_d96)
PREFILL_KERNEL(96, , false)
#endif
#if KEEPS(attention_prefill_d96_inv)
PREFILL_KERNEL(96, _inv, true)
#endif
#if KEEPS(attention_prefill_fp8_d96)
PREFILL_KERNEL_FP8(96, , false)
#endif
#if KEEPS(attention_prefill_fp8_d96_inv)
PREFILL_KERNEL_FP8(96, _inv, true)
#endif
#if KEEPS(attention_prefill_d256)
PREFILL_KERNEL(256, , false)
#endif
#if KEEPS(attention_prefill_d256_inv)
PREFILL_KERNEL(256, _inv, true)
#endif
#if KEEPS(attention_prefill_fp8_d256)
PREFILL_KERNEL_FP8(256, , false)
#endif
#if KEEPS(attention_prefill_fp8_d256_inv)
PREFILL_KERNEL_FP8(256, _inv, true)
#endif
