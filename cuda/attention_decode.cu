// Paged attention for decode: one new query per sequence over its whole cached context (FlashDecoding-style).
// Twin: numpy_backend.paged_attention (its _decode_attention path).
//
// Grouped-query attention on tensor cores: the query heads that share one KV head are the rows of an mma.sync
// m16n8k16 tile (up to 16; Llama's groups of 4 or 8 leave rows empty, which costs nothing that matters), so
// S = Q K^T and O += P V are each one mma per 8 keys x 16 dims. A CUDA-core version spent ~28 instructions per
// key and head group on dot products, shuffles and conversions and was issue-bound at ~1.6 TB/s; here a key
// costs ~10 warp instructions and the kernel is left to stream K/V.
//
// Shape: each warp serves one (sequence, KV head, head chunk, split) on its own: it streams that head's keys and
// values through a STAGES-deep pipeline of TILE-key tiles (cp.async straight to its shared memory) and keeps the
// whole online softmax of its query heads, so there is no block barrier and no merge between warps. A block's
// NWARPS warps take neighbouring KV heads of one sequence: together they read neighbouring bytes of each cache row.
// The block-table entries of 32 tiles come in one load, one per lane, 32 tiles ahead of their use. An earlier shape
// (4 warps splitting one head's keys, merged at the end) paid a block's set-up and merge for 2-4 tiles per warp at
// W1's contexts, held 1-2 tiles in flight per warp and waited on each tile's table loads: ~2.9 TB/s.
// Small batches cut each context into up to num_splits parts (grid.z) of whole tiles, so that they still fill the
// GPU: splits_used() parts, of at least MIN_SPLIT_TILES tiles each where the context has them (the blocks of a
// context's unused parts return at once). A context in one part gets its output written by its warps; parts write
// normalized partial outputs and (m, l), merged by attention_combine.
//
// An fp8 cache (Cache = e4m3, the _fp8 kernels) moves half the bytes: each tile's codes land in the tail of the
// warp's bf16 tile, are widened to bf16 in place (exact), and the rest runs as for bf16. The K scale of the KV head
// folds into the softmax scale, the V scale into the output (both are powers of two: exact).
//
// Head dims: 64 and 128 (lanes split a key's row evenly), 96 (a key's 12 16-byte pieces do not divide the 32 lanes:
// piece c of a tile goes to lane c % 32) and 256 (its 2-stage K/V tiles take 33 KB per warp and its Q 8 KB: one
// warp per block, so that the static shared memory stays under 48 KB; Q stays in shared memory, read at each tile,
// for the registers the output accumulator needs).
//
// Batch-invariant (the attention_decode_*_inv kernels; EngineConfig.batch_invariant): a row must get the bits
// attention_prefill's _inv kernels give it, whatever else runs, so the context is cut where they cut it: into chunks
// of INV_CHUNK keys from key 0, each softmaxed afresh and folded into the row's state in order (mma.cuh,
// fold_chunk); a small batch's parts are whole chunks, whose states attention_combine_inv folds in the same order.
// The online softmax steps over the prefill's key tiles: block_n(D) keys from multiples of block_n(D),
// GROUP = block_n(D) / TILE of the pipeline's tiles at a time, their scores, softmax and P V in the prefill's order
// of additions (mma_qk's per-key chains over the head dims, one online_softmax per step, mma_pv per 16 keys in
// order; the rows of an mma are independent, so the rows the tile holds beside a row do not matter). Its GROUP
// tiles fill the STAGES = GROUP stages; the next group's copies go out once a group is done, so a warp waits on
// memory once per group, which other warps cover at large batches. One warp per block (a warp's 4 stages of D 128
// take 35 KB).
//
// Compiled with -DNWARPS (warps per block for D <= 128), -DNWARPS_WIDE (for D > 128), -DMIN_SPLIT_TILES,
// -DCOMBINE_ROW_THREADS, -DCOMBINE_ROW_GROUPS, -DINV_CHUNK and -DINV_PARTS from backends/cuda/ops.py, which also
// launches the kernels.
#include "common.cuh"
#include "mma.cuh"

constexpr int TILE = 16;  // keys per pipeline stage of attention_decode: one k-step of P V

// attention_decode's warps per block for head dim D (ops.decode_warps); the batch-invariant kernels: one
__host__ __device__ constexpr int decode_warps(int D, bool invariant) {
    return invariant ? 1 : D > 128 ? NWARPS_WIDE : NWARPS;
}
template <int D, bool INVARIANT>
constexpr int decode_threads = decode_warps(D, INVARIANT) * 32;  // its block

// A sliding window of `window` keys (0: none) shows the query at position ctx - 1 the keys from
// window_start(ctx, window) on; the keys attention_decode reads from the cache are those, in tiles from
// first_tile(...) (a multiple of TILE, so that a tile lies in one cache block): keys before window_start are never
// loaded (zero-filled and masked), so their blocks may be freed and reused.
__device__ __forceinline__ int window_start(int ctx, int window) { return window > 0 ? max(0, ctx - window) : 0; }
__device__ __forceinline__ int first_tile(int ctx, int window) { return window_start(ctx, window) / TILE * TILE; }

// The parts the keys of a context of ctx keys with this window are cut into (attention_decode and attention_combine
// agree on it): by the keys from first_tile, so that a windowed context is cut by its window.
__device__ __forceinline__ int splits_used(int ctx, int window, int num_splits) {
    const int keys = ctx - first_tile(ctx, window);
    return min(num_splits, max(1, (keys + TILE * MIN_SPLIT_TILES - 1) / (TILE * MIN_SPLIT_TILES)));
}

// Batch-invariant: the chunks (mma.cuh: INV_CHUNK keys each, from key 0) that hold a context's keys from
// window_start on, the first one's index and their count; the parts a context is cut into: whole chunks, at most
// num_splits of them, each chunk's state written to a slot of its own for attention_combine_inv, or one part (which
// folds its chunks as it goes) where the context has more chunks than a (sequence, head) has slots (INV_PARTS).
__device__ __forceinline__ int first_chunk(int ctx, int window) { return window_start(ctx, window) / INV_CHUNK; }
__device__ __forceinline__ int chunk_count(int ctx, int window) {
    return (ctx + INV_CHUNK - 1) / INV_CHUNK - first_chunk(ctx, window);
}
__device__ __forceinline__ int invariant_parts(int ctx, int window, int num_splits) {
    const int chunks = chunk_count(ctx, window);
    return chunks > INV_PARTS ? 1 : min(num_splits, chunks);
}

// Launch: grid (ceil(num_kv_heads * head_chunks / W), S, num_splits), block W * 32 with W = decode_warps(D, INVARIANT),
// where
// head_chunks = ceil(group / ROWS): warp w of block x serves item x * W + w (items past the last one return at once),
// the item's chunk c of KV head kvh the query heads kvh * group + c * ROWS ... (at most ROWS of them).
// ROWS is 8 or 16: with 8, the tile's upper 8 rows are known empty and their softmax is skipped.
// q: rows of the fused qkv buffer (row_stride elements apart); caches [slots, kv_heads, D]; block_tables
// [S, *bt_stride] (the stride is read from device memory so that a captured graph serves any table width);
// out [S, num_heads * D]; partial_o [S, num_heads, num_splits, D]; partial_ml [S, num_heads, num_splits] of (m, l)
// (INVARIANT: INV_PARTS in place of num_splits, a chunk's unnormalized output and whole row sum in each slot).
// fp8: k_scales, v_scales are this layer's [num_kv_heads] (unused for bf16). window: the layer's sliding window
// (0: none); softcap: its attention-logit cap (0: none; scores become softcap * tanh(score / softcap)), both uniform
// branches, so that a layer without them does no per-key work for them. context_lens, block_tables and
// bt_stride are not __restrict__: ptxas would move their non-coherent loads above the wait (test_pdl.py).
template <int D, int ROWS, class Cache, bool INVARIANT>
__device__ void attention_decode(bf16* __restrict__ out, float* __restrict__ partial_o,
                                 float2* __restrict__ partial_ml, const bf16* __restrict__ q,
                                 const Cache* __restrict__ k_cache, const Cache* __restrict__ v_cache,
                                 const int* block_tables, const int* bt_stride, const int* context_lens,
                                 float scale, int num_heads, int num_kv_heads, int block_size, int row_stride,
                                 int num_splits, int window, float softcap, const float* __restrict__ k_scales,
                                 const float* __restrict__ v_scales) {
    grid_dependency_wait();
    // The next kernel may launch only once this one's loop is done (below), unlike pdl_begin: launched at the
    // start, its successors' weight loads compete with this kernel's K/V streaming (common.cuh; docs/PERFORMANCE.md,
    // Decisions: "attention_decode's launch point").
    constexpr bool FP8 = sizeof(Cache) == 1;
    constexpr int VEC = 16 / sizeof(Cache);        // cache entries per 16-byte copy
    constexpr int W = decode_warps(D, INVARIANT);  // warps per block
    constexpr int GROUP = INVARIANT ? block_n(D) / TILE : 1;  // tiles per softmax step
    // K/V ahead of the tile in use: 12 KB (D 64, D 96), 8 KB (D 128) or 16 KB (D 256); INVARIANT: a group's tiles
    constexpr int STAGES = INVARIANT ? GROUP : D == 64 ? 4 : D == 96 ? 3 : 2;
    constexpr int LD = D + 8;                      // padded smem row: ldmatrix without bank conflicts
    constexpr int PIECES = TILE * D / VEC / 32;    // 16-byte pieces of a K (or V) tile per lane
    constexpr int HALVES = ROWS / 8;               // row halves of the mma tile in use
    // 36 KB (D 64), 39 KB (D 96) or 34 KB (D 128) for 2 warps; 33 KB (D 256) for 1, and its 8 KB of Q below;
    // INVARIANT (1 warp): 18 KB (D 64), 27 KB (D 96), 35 KB (D 128), 33 KB (D 256) and Q
    __shared__ __align__(16) bf16 kv_s[W][STAGES][2][TILE * LD];
    // D > 128: Q stays in shared memory (8 KB a warp at D 256) and is read per 16 dims at each tile, instead of
    // being held as D / 4 registers beside the D / 2 of the output accumulator (which spilled)
    constexpr bool Q_SHARED = D > 128;
    __shared__ __align__(16) bf16 q_keep[Q_SHARED ? W : 1][Q_SHARED ? 16 * LD : 8];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = num_heads / num_kv_heads, head_chunks = (group + ROWS - 1) / ROWS;
    const int item = blockIdx.x * W + warp;
    const int s = blockIdx.y, split = blockIdx.z;
    const int ctx = context_lens[s];
    const int used = INVARIANT ? invariant_parts(ctx, window, num_splits) : splits_used(ctx, window, num_splits);
    // INVARIANT: this part's chunks c_lo .. c_hi - 1 of the context's from c0 (a split's last parts may get none)
    const int c0 = first_chunk(ctx, window), chunks = chunk_count(ctx, window), per_part = (chunks + used - 1) / used;
    const int c_lo = c0 + split * per_part, c_hi = min(c0 + chunks, c_lo + per_part);
    // No block barrier below: a warp may leave.
    if (item >= num_kv_heads * head_chunks || split >= used || (INVARIANT && c_lo >= c_hi)) {
        allow_dependents_launch();
        return;
    }
    const int kvh = item / head_chunks, chunk = item % head_chunks;
    const int h0 = kvh * group + chunk * ROWS, num_g = min(ROWS, group - chunk * ROWS);
    // Parts start at multiples of TILE, so that with block_size % TILE == 0 a tile lies in one cache block; keys
    // before `lo` (the window's first) are neither loaded nor seen. INVARIANT: a part is whole chunks, from a
    // multiple of block_n(D) (its first chunk's or the window's first key's), and its tiles come in whole groups
    // (those past the context zero-filled and masked).
    const int lo = window_start(ctx, window);
    const int first = INVARIANT ? lo / block_n(D) * block_n(D) : first_tile(ctx, window);
    const int per_split = ((ctx - first + used - 1) / used + TILE - 1) / TILE * TILE;
    const int start = INVARIANT ? max(first, c_lo * INV_CHUNK) : min(ctx, first + split * per_split);
    const int end = INVARIANT ? min(ctx, c_hi * INV_CHUNK) : min(ctx, start + per_split);
    const int num_tiles = (end - start + TILE * GROUP - 1) / (TILE * GROUP) * GROUP;
    const int* table = block_tables + (int64_t)s * bt_stride[0];
    const int64_t kv_stride = (int64_t)num_kv_heads * D;

    // Piece i of this lane is the 16-byte piece c = lane + 32 i of a tile: entries piece_part(i) * VEC .. of key
    // piece_row(i).
    // Where the lanes split a row evenly (D 64, 128, 256) that is always the same part, of keys row0 + i * ROW_STEP;
    // with D 96 a lane's pieces lie in different parts. slots[i] holds their cache slots (-1 outside lo .. end - 1:
    // zero-filled, never read).
    constexpr int ROW_PIECES = D / VEC;  // 16-byte pieces of a key's row
    constexpr bool EVEN = 32 % ROW_PIECES == 0;
    constexpr int ROW_STEP = EVEN ? 32 / ROW_PIECES : 0;
    const int row0 = lane / ROW_PIECES;
    auto piece_row = [&](int i) { return EVEN ? row0 + i * ROW_STEP : (lane + 32 * i) / ROW_PIECES; };
    auto piece_part = [&](int i) { return EVEN ? lane % ROW_PIECES : (lane + 32 * i) % ROW_PIECES; };
    const int64_t dim0 = (int64_t)kvh * D + piece_part(0) * VEC;  // piece 0's first entry in a cache row
    auto piece_dim = [&](int i) { return EVEN ? dim0 : (int64_t)kvh * D + piece_part(i) * VEC; };
    // With block_size % TILE == 0, lane j holds the slot of the first key of tile 32 c + j for the chunk c of 32
    // tiles in use (first_slot) and the next chunk (next_first_slot, loaded a chunk ahead): a tile's first key may
    // be before lo, but it lies in lo's block then.
    const bool tile_in_one_block = block_size % TILE == 0;
    auto chunk_first_slots = [&](int c) {
        const int tok = start + (c * 32 + lane) * TILE;
        return tok < end ? table[tok / block_size] * block_size + tok % block_size : 0;
    };
    int first_slot = 0, next_first_slot = 0;
    if (tile_in_one_block) {
        first_slot = chunk_first_slots(0);
        if (num_tiles > 32) next_first_slot = chunk_first_slots(1);
    }
    int slots[PIECES];
    auto find_slots = [&](int t) {  // called for t = 0, 1, 2, ... in order
        const int tile0 = start + t * TILE;
        if (tile_in_one_block) {
            if (t % 32 == 0 && t > 0) {
                first_slot = next_first_slot;
                if (t + 32 < num_tiles) next_first_slot = chunk_first_slots(t / 32 + 1);
            }
            const int first_key_slot = __shfl_sync(0xffffffffu, first_slot, t % 32);
#pragma unroll
            for (int i = 0; i < PIECES; ++i)
                slots[i] = (unsigned)(tile0 + piece_row(i) - lo) < (unsigned)(end - lo) ? first_key_slot + piece_row(i)
                                                                                         : -1;
        } else {
#pragma unroll
            for (int i = 0; i < PIECES; ++i) {
                const int tok = tile0 + piece_row(i);
                slots[i] = (unsigned)(tok - lo) < (unsigned)(end - lo)
                               ? table[tok / block_size] * block_size + tok % block_size : -1;
            }
        }
    };
    // fp8 codes land as dense rows [TILE][D] in the tail of the bf16 tile, which widen() then fills from the head.
    constexpr int CODES_OFFSET = TILE * LD * 2 - TILE * D;  // bytes
    auto piece = [&](bf16* tile, int i) -> void* {
        if constexpr (FP8)
            return reinterpret_cast<uint8_t*>(tile) + CODES_OFFSET + piece_row(i) * D + piece_part(i) * VEC;
        return &tile[piece_row(i) * LD + piece_part(i) * VEC];
    };
    auto fetch = [&](int t) {  // tile t's K and V into stage t % STAGES
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
            const Cache* cache = kv == 0 ? k_cache : v_cache;
#pragma unroll
            for (int i = 0; i < PIECES; ++i)
                cp_async16(piece(kv_s[warp][t % STAGES][kv], i),
                           cache + max(slots[i], 0) * kv_stride + piece_dim(i), slots[i] >= 0);
        }
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
                uint4* dst = reinterpret_cast<uint4*>(&tile[piece_row(i) * LD + piece_part(i) * VEC]);
                dst[0] = e4m3x8_to_bf16x8(make_uint2(codes[i].x, codes[i].y));
                dst[1] = e4m3x8_to_bf16x8(make_uint2(codes[i].z, codes[i].w));
            }
            __syncwarp();
        }
    };

    // The first STAGES - 1 tiles, a commit group each (empty past the last tile, so that the waits count tiles).
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < num_tiles) {
            find_slots(t);
            fetch(t);
        }
        cp_async_commit();
    }

    // Q (rows past num_g are zero), staged in the last stage (its first copy is issued in the loop), then held as
    // mma A fragments.
    bf16* q_s = Q_SHARED ? q_keep[warp] : kv_s[warp][STAGES - 1][0];
    for (int c = lane; c < 16 * D / 8; c += 32) {
        const int r = c / (D / 8), p = c % (D / 8);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < num_g) v = *reinterpret_cast<const uint4*>(q + (int64_t)s * row_stride + (h0 + r) * D + p * 8);
        *reinterpret_cast<uint4*>(&q_s[r * LD + p * 8]) = v;
    }
    __syncwarp();
    uint32_t qf[Q_SHARED ? 1 : D / 16][4];
    if constexpr (!Q_SHARED) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            ldmatrix_x4(qf[kk], &q_s[(lane % 16) * LD + kk * 16 + (lane / 16) * 8]);
        __syncwarp();  // every lane has its fragments before the stage is refilled
    }
    if constexpr (INVARIANT) {  // the first group's last tile, into the stage Q left
        if (STAGES - 1 < num_tiles) {
            find_slots(STAGES - 1);
            fetch(STAGES - 1);
        }
        cp_async_commit();
    }

    const float score_scale = scale * (FP8 ? k_scales[kvh] : 1.f);
    // soft-capped, the scores are tanh(raw * score_scale / softcap) (soft_cap_scores), times softcap * log2(e) here
    const float scale_log2 = 1.4426950408889634f * (softcap > 0.f ? softcap : score_scale);
    const float cap_scale = softcap > 0.f ? score_scale / softcap : 0.f;
    const float v_scale = FP8 ? v_scales[kvh] : 1.f;
    float m[HALVES], l[HALVES], o[D / 8][4];
    float M[HALVES], L[HALVES], O[D / 8][2 * HALVES];  // INVARIANT, one part: the chunks folded so far (fold_chunk)
    int key_begin[HALVES], key_end[HALVES];  // every row sees the keys lo .. end - 1
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        m[h] = M[h] = -INFINITY, l[h] = L[h] = 0.f, key_begin[h] = lo, key_end[h] = end;
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) O[nd][2 * h] = O[nd][2 * h + 1] = 0.f;
    }
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;

    // INVARIANT, parts: chunk `slot` (of the context's, from c0) of this thread's rows, its unnormalized output and
    // (m, the row's whole sum) into the row's slot, then the state reset for the next chunk (m stays finite: every
    // chunk of a part holds a key its rows see).
    auto store_chunk = [&](float(&m)[HALVES], float(&l)[HALVES], float(&o)[D / 8][4], int slot) {
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            float sum = l[h] + __shfl_xor_sync(0xffffffffu, l[h], 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = lane / 4 + 8 * h, col = (lane % 4) * 2;
            if (row < num_g) {
                const int64_t idx = ((int64_t)s * num_heads + h0 + row) * INV_PARTS + slot;
#pragma unroll
                for (int nd = 0; nd < D / 8; ++nd)
                    *reinterpret_cast<float2*>(&partial_o[idx * D + nd * 8 + col]) =
                        make_float2(o[nd][2 * h], o[nd][2 * h + 1]);
                if (lane % 4 == 0) partial_ml[idx] = make_float2(m[h], sum);
            }
            m[h] = -INFINITY, l[h] = 0.f;
        }
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
    };

    for (int t = 0; t < num_tiles; t += GROUP) {
        if constexpr (INVARIANT) {
            cp_async_wait<0>();  // the group's tiles
        } else {  // refill the stage the previous tile used, then wait for this tile
            if (t + STAGES - 1 < num_tiles) {
                find_slots(t + STAGES - 1);
                fetch(t + STAGES - 1);
            }
            cp_async_commit();
            cp_async_wait<STAGES - 1>();
        }
        __syncwarp();
        // S = Q K^T: 16 rows x the step's keys; online softmax of this thread's rows (m stays finite: the first
        // step holds a key the rows see, key max(lo, start) < end); O += P V per tile (rows 8-15 of P are zero when
        // only 8 are in use).
        float sacc[GROUP * TILE / 8][4];
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            bf16* k_s = kv_s[warp][(t + j) % STAGES][0];
            widen(k_s);
            widen(kv_s[warp][(t + j) % STAGES][1]);
            float(&s_j)[TILE / 8][4] = *reinterpret_cast<float(*)[TILE / 8][4]>(&sacc[j * TILE / 8]);
            if constexpr (Q_SHARED) mma_qk_shared_q<D, TILE, LD>(s_j, q_s, k_s, lane);
            else mma_qk<D, TILE, LD>(s_j, qf, k_s, lane);
        }
        if (softcap > 0.f) soft_cap_scores<GROUP * TILE, HALVES>(sacc, cap_scale);
        online_softmax<GROUP * TILE, D, HALVES>(sacc, m, l, o, start + t * TILE, lane, scale_log2, key_begin,
                                                key_end);
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            const float(&s_j)[TILE / 8][4] = *reinterpret_cast<float(*)[TILE / 8][4]>(&sacc[j * TILE / 8]);
            const uint32_t p[4] = {pack_bf16(s_j[0][0], s_j[0][1]), HALVES == 2 ? pack_bf16(s_j[0][2], s_j[0][3]) : 0u,
                                   pack_bf16(s_j[1][0], s_j[1][1]), HALVES == 2 ? pack_bf16(s_j[1][2], s_j[1][3]) : 0u};
            mma_pv<D, LD>(o, p, kv_s[warp][(t + j) % STAGES][1], lane);
        }
        if constexpr (INVARIANT) {  // a chunk's last group: its state to its slot (parts) or folded (one part)
            if ((start + (t + GROUP) * TILE) % INV_CHUNK == 0 || t + GROUP >= num_tiles) {
                if (used > 1) store_chunk(m, l, o, (start + t * TILE) / INV_CHUNK - c0);
                else fold_chunk<D, HALVES>(M, L, O, m, l, o);
            }
        }
        __syncwarp();  // every lane is done with the stages before they are refilled
        if constexpr (INVARIANT) {  // the next group
#pragma unroll
            for (int j = 0; j < GROUP; ++j) {
                if (t + GROUP + j < num_tiles) {
                    find_slots(t + GROUP + j);
                    fetch(t + GROUP + j);
                }
            }
            cp_async_commit();
        }
    }

    allow_dependents_launch();
    if constexpr (INVARIANT) {  // one part: the folded chunks' output (parts: attention_combine_inv merges them)
        if (used > 1) return;
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            const int row = lane / 4 + 8 * h, col = (lane % 4) * 2;
            if (row >= num_g) continue;
            const float inv = L[h] > 0.f ? v_scale / L[h] : 0.f;
            bf16* dst = out + ((int64_t)s * num_heads + h0 + row) * D + col;
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd)
                *reinterpret_cast<__nv_bfloat162*>(dst + nd * 8) =
                    __floats2bfloat162_rn(O[nd][2 * h] * inv, O[nd][2 * h + 1] * inv);
        }
        return;
    }
    // A row's l is spread over the 4 lanes of its quad; each lane writes its 2 x D / 8 output entries of the row.
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const int row = lane / 4 + 8 * h, col = (lane % 4) * 2;
        if (row >= num_g) continue;
        const float inv = l[h] > 0.f ? v_scale / l[h] : 0.f;  // l = 0: no key in this part
        if (used == 1) {
            bf16* dst = out + ((int64_t)s * num_heads + h0 + row) * D + col;
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd)
                *reinterpret_cast<__nv_bfloat162*>(dst + nd * 8) =
                    __floats2bfloat162_rn(o[nd][2 * h] * inv, o[nd][2 * h + 1] * inv);
        } else {
            const int64_t idx = ((int64_t)s * num_heads + h0 + row) * num_splits + split;
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd)
                *reinterpret_cast<float2*>(&partial_o[idx * D + nd * 8 + col]) =
                    make_float2(o[nd][2 * h] * inv, o[nd][2 * h + 1] * inv);
            if (lane % 4 == 0) partial_ml[idx] = make_float2(m[h], l[h]);
        }
    }
}

// Merge the parts of each (sequence, head) cut into more than one: weights w_z = l_z * 2^(m_z - max m),
// out = sum w_z o_z / sum w_z, rounded to bf16.
// The parts come COMBINE_UNROLL at a time, their (m, l) and outputs loaded together and merged online: at batch 1
// this kernel is on the critical path, where a pass for the max and a second for the sum cost two round trips.
constexpr int COMBINE_UNROLL = 8;

// N floats from p (N 1, or 8 from a 32-byte aligned address).
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float out[N]) {
    if constexpr (N == 1) {
        out[0] = *p;
    } else {
        static_assert(N == 8, "1 or 8 floats");
        const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
        out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
    }
}

// The merged output of dims d0 .. d0 + N - 1 of the (sequence, head) whose parts start at row `base` of partial_o /
// partial_ml: every dim gets the same operations in the same order whatever N, so attention_combine (N 1) and
// attention_combine_quantize (N 8) give the same bits.
template <int N>
__device__ __forceinline__ void combine_dims(float res[N], const float* partial_o, const float2* partial_ml,
                                             int64_t base, int used, int D, int d0) {
    float m = -INFINITY, den = 0.f, num[N];
#pragma unroll
    for (int j = 0; j < N; ++j) num[j] = 0.f;
    for (int z0 = 0; z0 < used; z0 += COMBINE_UNROLL) {
        float2 ml[COMBINE_UNROLL];
        float o[COMBINE_UNROLL][N];
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u) {
            ml[u] = make_float2(-INFINITY, 0.f);  // past the last part: no weight
            if (z0 + u < used) {
                ml[u] = partial_ml[base + z0 + u];
                load_floats<N>(partial_o + (base + z0 + u) * D + d0, o[u]);
            }
        }
        float m_new = m;
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u)
            if (ml[u].y > 0.f) m_new = fmaxf(m_new, ml[u].x);
        if (m_new == -INFINITY) continue;  // no keys so far
        const float rescale = exp2f(m - m_new);
        den *= rescale;
#pragma unroll
        for (int j = 0; j < N; ++j) num[j] *= rescale;
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u) {
            if (ml[u].y > 0.f) {
                const float w = ml[u].y * exp2f(ml[u].x - m_new);
#pragma unroll
                for (int j = 0; j < N; ++j) num[j] += w * o[u][j];
                den += w;
            }
        }
        m = m_new;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) res[j] = __bfloat162float(__float2bfloat16(den > 0.f ? num[j] / den : 0.f));
}

// Launch: grid (num_heads, S), block D: one thread per output dim; window: the layer's, as attention_decode was
// given (the parts are cut by it).
#if KEEPS(attention_combine)
extern "C" __global__ void attention_combine(bf16* __restrict__ out, const float* __restrict__ partial_o,
                                             const float2* __restrict__ partial_ml, const int* context_lens,
                                             int num_splits, int window) {
    pdl_begin();
    const int used = splits_used(context_lens[blockIdx.y], window, num_splits);
    if (used == 1) return;  // attention_decode wrote this output itself
    const int num_heads = gridDim.x, D = blockDim.x;
    float res[1];
    combine_dims<1>(res, partial_o, partial_ml, ((int64_t)blockIdx.y * num_heads + blockIdx.x) * num_splits, used, D,
                    threadIdx.x);
    out[((int64_t)blockIdx.y * num_heads + blockIdx.x) * D + threadIdx.x] = __float2bfloat16(res[0]);
}
#endif

// Batch-invariant: the chunk states attention_decode's parts wrote (INV_PARTS slots a (sequence, head)) folded in
// the chunks' order by the functions its one-part form folds them with (mma.cuh), then normalized as it does: the
// bits of the one-part form. The states come COMBINE_UNROLL at a time, loaded together before they are folded (as
// combine_dims loads the parts), the first group while the context's length is still on its way: a load behind each
// fold would make a round trip to L2 per chunk, at batch 1 on the critical path. Launch: grid (num_heads, S), block
// D (a thread per output dim); num_splits and window as attention_decode was given them; v_scales: an fp8 cache's V
// scales of this layer [num_kv_heads] (null: a bf16 cache), group: query heads per KV head.
#if KEEPS(attention_combine_inv)
// partial_o and partial_ml come from attention_decode, the kernel before (PDL): plain loads, which ptxas keeps after
// the wait (a non-coherent one it may move above it: gemv_tile.cuh), and volatile, so that none sinks into a branch
// behind the context's length.
__device__ __forceinline__ float load_after_wait(const float* p) {
    float v;
    asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float2 load_after_wait(const float2* p) {
    float2 v;
    asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}

static_assert(INV_PARTS % COMBINE_UNROLL == 0, "a (sequence, head)'s slots hold whole groups of chunk states");
extern "C" __global__ void attention_combine_inv(bf16* __restrict__ out, const float* __restrict__ partial_o,
                                                 const float2* __restrict__ partial_ml, const int* context_lens,
                                                 int num_splits, int window, const float* __restrict__ v_scales,
                                                 int group) {
    pdl_begin();
    const int num_heads = gridDim.x, D = blockDim.x;
    const int64_t base = ((int64_t)blockIdx.y * num_heads + blockIdx.x) * INV_PARTS;
    float2 ml[COMBINE_UNROLL];
    float o[COMBINE_UNROLL];
    // the group of chunks from c0 (the first before the context's length arrives: its slots exist whatever it is)
    auto load = [&](int c0) {
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u) {
            ml[u] = load_after_wait(partial_ml + base + c0 + u);
            o[u] = load_after_wait(partial_o + (base + c0 + u) * D + threadIdx.x);
        }
    };
    load(0);
    const int ctx = context_lens[blockIdx.y];
    // in one part attention_decode wrote this output itself (the fold then takes no chunk)
    const bool in_parts = invariant_parts(ctx, window, num_splits) > 1;
    const int chunks = in_parts ? chunk_count(ctx, window) : 0;
    float M = -INFINITY, L = 0.f, O = 0.f;
    auto fold = [&](int c0) {
#pragma unroll
        for (int u = 0; u < COMBINE_UNROLL; ++u)  // a slot past the last chunk holds another step's state: skipped
            if (c0 + u < chunks && ml[u].y > 0.f) O = fold_entry(O, o[u], chunk_weights(M, L, ml[u].x, ml[u].y));
    };
    fold(0);
    for (int c0 = COMBINE_UNROLL; c0 < chunks; c0 += COMBINE_UNROLL) {
        load(c0);
        fold(c0);
    }
    const float inv = L > 0.f ? (v_scales ? v_scales[blockIdx.x / group] : 1.f) / L : 0.f;
    if (in_parts) out[((int64_t)blockIdx.y * num_heads + blockIdx.x) * D + threadIdx.x] = __float2bfloat16(O * inv);
}
#endif

// attention_combine and then fp8.cu's quantize_row in one launch, for an FP8 O projection: a block per sequence
// merges every head's parts 8 dims a thread (or, where attention_decode wrote the row itself, reads it), takes the
// row's amax and writes its scale and codes, as e4m3 (VALUES false: cuBLASLt's input) or as their f16 values (the
// FP8 GEMV's), not the bf16 row. The same bits as the two kernels. Launch: grid (S), block COMBINE_ROW_THREADS;
// num_heads * D <= COMBINE_ROW_THREADS * 8 * COMBINE_ROW_GROUPS (both -D defines from ops.py).
template <bool VALUES>
__device__ void combine_quantize(void* codes, float* scales, const bf16* out, const float* partial_o,
                                 const float2* partial_ml, const int* context_lens, int num_heads, int D,
                                 int num_splits, int window) {
    pdl_begin();
    __shared__ float scratch[32];
    const int s = blockIdx.x, width = num_heads * D;
    const int used = splits_used(context_lens[s], window, num_splits);
    float v[COMBINE_ROW_GROUPS][8], amax = 0.f;
#pragma unroll
    for (int g = 0; g < COMBINE_ROW_GROUPS; ++g) {
        const int i = (g * COMBINE_ROW_THREADS + threadIdx.x) * 8;
        if (i >= width) continue;
        if (used == 1) {
            load8(out + (int64_t)s * width + i, v[g]);
        } else {
            const int h = i / D;
            combine_dims<8>(v[g], partial_o, partial_ml, ((int64_t)s * num_heads + h) * num_splits, used, D, i - h * D);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[g][j]));
    }
    const float scale = fp8_scale(block_reduce<Max>(amax, scratch)), inv = __frcp_rn(scale);
    if (threadIdx.x == 0) scales[s] = scale;
#pragma unroll
    for (int g = 0; g < COMBINE_ROW_GROUPS; ++g) {
        const int i = (g * COMBINE_ROW_THREADS + threadIdx.x) * 8;
        if (i >= width) continue;
        const uint2 c = f32x8_to_e4m3x8(v[g], inv);
        if constexpr (VALUES) {
            *reinterpret_cast<uint4*>(static_cast<__half*>(codes) + (int64_t)s * width + i) = e4m3x8_to_f16x8(c);
        } else {
            *reinterpret_cast<uint2*>(static_cast<e4m3*>(codes) + (int64_t)s * width + i) = c;
        }
    }
}

#if KEEPS(attention_combine_quantize)
extern "C" __global__ void __launch_bounds__(COMBINE_ROW_THREADS)
attention_combine_quantize(e4m3* __restrict__ codes, float* __restrict__ scales, const bf16* out,
                           const float* __restrict__ partial_o, const float2* __restrict__ partial_ml,
                           const int* context_lens, int num_heads, int head_dim, int num_splits, int window) {
    combine_quantize<false>(codes, scales, out, partial_o, partial_ml, context_lens, num_heads, head_dim, num_splits,
                            window);
}
#endif
#if KEEPS(attention_combine_quantize_values)
extern "C" __global__ void __launch_bounds__(COMBINE_ROW_THREADS)
attention_combine_quantize_values(__half* __restrict__ codes, float* __restrict__ scales, const bf16* out,
                                  const float* __restrict__ partial_o, const float2* __restrict__ partial_ml,
                                  const int* context_lens, int num_heads, int head_dim, int num_splits, int window) {
    combine_quantize<true>(codes, scales, out, partial_o, partial_ml, context_lens, num_heads, head_dim, num_splits,
                           window);
}
#endif

// SUFFIX: empty (INVARIANT false) or _inv (true)
#define DECODE_KERNEL(D, ROWS, SUFFIX, INVARIANT)                                                                 \
    extern "C" __global__ void __launch_bounds__(decode_threads<D, INVARIANT>)                                    \
    attention_decode_d##D##_r##ROWS##SUFFIX(                                                                      \
        bf16* out, float* partial_o, float2* partial_ml, const bf16* q, const bf16* k_cache, const bf16* v_cache, \
        const int* block_tables, const int* bt_stride, const int* context_lens, float scale, int num_heads,       \
        int num_kv_heads, int block_size, int row_stride, int num_splits, int window, float softcap) {            \
        attention_decode<D, ROWS, bf16, INVARIANT>(out, partial_o, partial_ml, q, k_cache, v_cache, block_tables, \
                                                   bt_stride, context_lens, scale, num_heads, num_kv_heads,       \
                                                   block_size, row_stride, num_splits, window, softcap, nullptr,  \
                                                   nullptr);                                                      \
    }
#define DECODE_KERNEL_FP8(D, ROWS, SUFFIX, INVARIANT)                                                             \
    extern "C" __global__ void __launch_bounds__(decode_threads<D, INVARIANT>)                                    \
    attention_decode_fp8_d##D##_r##ROWS##SUFFIX(                                                                  \
        bf16* out, float* partial_o, float2* partial_ml, const bf16* q, const e4m3* k_cache, const e4m3* v_cache, \
        const int* block_tables, const int* bt_stride, const int* context_lens, float scale, int num_heads,       \
        int num_kv_heads, int block_size, int row_stride, int num_splits, int window, float softcap,               \
        const float* k_scales, const float* v_scales) {                                                           \
        attention_decode<D, ROWS, e4m3, INVARIANT>(out, partial_o, partial_ml, q, k_cache, v_cache, block_tables, \
                                                   bt_stride, context_lens, scale, num_heads, num_kv_heads,       \
                                                   block_size, row_stride, num_splits, window, softcap, k_scales, \
                                                   v_scales);                                                     \
    }
#if KEEPS(attention_decode_d64_r8)
DECODE_KERNEL(64, 8, , false)
#endif
#if KEEPS(attention_decode_d64_r16)
DECODE_KERNEL(64, 16, , false)
#endif
#if KEEPS(attention_decode_fp8_d64_r8)
DECODE_KERNEL_FP8(64, 8, , false)
#endif
#if KEEPS(attention_decode_fp8_d64_r16)
DECODE_KERNEL_FP8(64, 16, , false)
#endif
#if KEEPS(attention_decode_d128_r8)
DECODE_KERNEL(128, 8, , false)
#endif
#if KEEPS(attention_decode_d128_r16)
DECODE_KERNEL(128, 16, , false)
#endif
#if KEEPS(attention_decode_fp8_d128_r8)
DECODE_KERNEL_FP8(128, 8, , false)
#endif
#if KEEPS(attention_decode_fp8_d128_r16)
DECODE_KERNEL_FP8(128, 16, , false)
#endif
#if KEEPS(attention_decode_d96_r8)
DECODE_KERNEL(96, 8, , false)
#endif
#if KEEPS(attention_decode_d96_r16)
DECODE_KERNEL(96, 16, , false)
#endif
#if KEEPS(attention_decode_fp8_d96_r8)
DECODE_KERNEL_FP8(96, 8, , false)
#endif
#if KEEPS(attention_decode_fp8_d96_r16)
DECODE_KERNEL_FP8(96, 16, , false)
#endif
#if KEEPS(attention_decode_d256_r8)
DECODE_KERNEL(256, 8, , false)
#endif
#if KEEPS(attention_decode_d256_r16)
DECODE_KERNEL(256, 16, , false)
#endif
#if KEEPS(attention_decode_fp8_d256_r8)
DECODE_KERNEL_FP8(256, 8, , false)
#endif
#if KEEPS(attention_decode_fp8_d256_r16)
DECODE_KERNEL_FP8(256, 16, , false)
#endif
#if KEEPS(attention_decode_d64_r8_inv)
DECODE_KERNEL(64, 8, _inv, true)
#endif
#if KEEPS(attention_decode_d64_r16_inv)
DECODE_KERNEL(64, 16, _inv, true)
#endif
#if KEEPS(attention_decode_fp8_d64_r8_inv)
DECODE_KERNEL_FP8(64, 8, _inv, true)
#endif
#if KEEPS(attention_decode_fp8_d64_r16_inv)
DECODE_KERNEL_FP8(64, 16, _inv, true)
#endif
#if KEEPS(attention_decode_d128_r8_inv)
DECODE_KERNEL(128, 8, _inv, true)
#endif
#if KEEPS(attention_decode_d128_r16_inv)
DECODE_KERNEL(128, 16, _inv, true)
#endif
#if KEEPS(attention_decode_fp8_d128_r8_inv)
DECODE_KERNEL_FP8(128, 8, _inv, true)
#endif
#if KEEPS(attention_decode_fp8_d128_r16_inv)
DECODE_KERNEL_FP8(128, 16, _inv, true)
#endif
#if KEEPS(attention_decode_d96_r8_inv)
DECODE_KERNEL(96, 8, _inv, true)
#endif
#if KEEPS(attention_decode_d96_r16_inv)
DECODE_KERNEL(96, 16, _inv, true)
#endif
#if KEEPS(attention_decode_fp8_d96_r8_inv)
DECODE_KERNEL_FP8(96, 8, _inv, true)
#endif
#if KEEPS(attention_decode_fp8_d96_r16_inv)
DECODE_KERNEL_FP8(96, 16, _inv, true)
#endif
#if KEEPS(attention_decode_d256_r8_inv)
DECODE_KERNEL(256, 8, _inv, true)
#endif
#if KEEPS(attention_decode_d256_r16_inv)
DECODE_KERNEL(256, 16, _inv, true)
#endif
#if KEEPS(attention_decode_fp8_d256_r8_inv)
DECODE_KERNEL_FP8(256, 8, _inv, true)
#endif
#if KEEPS(attention_decode_fp8_d256_r16_inv)
DECODE_KERNEL_FP8(256, 16, _inv, true)
#endif
