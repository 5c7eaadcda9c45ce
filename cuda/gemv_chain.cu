// The batch-invariant GEMV (EngineConfig.batch_invariant, m <= 8 rows): out[m, n] = x[m, k] . w[n, k]^T with each
// output's k added as one chain of mma.sync m16n8k16 in k's natural order and the mma's own fragment layout. That is
// how cuBLASLt's split-free algorithms add (bench/gemm_order.py finds them bit for bit this chain), so a row's product
// has the same bits from this kernel at batch 1..8 as from cuBLAS in a batch of 500, and the invariant mode keeps a
// GEMV at decode. gemv_kernel.cuh's kernels split k among warps and permute it inside each mma: other bits.
//
// Every warp runs a chain of its own: one 16-row weight tile (w the A operand; x^T the B operand, whose 8 columns are
// the m <= 8 rows of x; columns past m are zeros and are not stored), k / 16 dependent mmas. Or (TILE 8, the
// gemv_chain8_* kernels) one 8-row weight tile with the roles swapped: x the A operand (its rows 8..15 zeros, held
// as zero registers), w^T the B operand; the mma adds each output's products in the same order either way
// (bench/gemm_order.py: "x-as-A order0" has cuBLAS's bits at every shape), and a narrow shape gets twice the tiles
// (Llama-3.2-1B's O and down: 256, not 128, for 132 SMs). A dependent mma takes ~24
// cycles (bench/mma_chain.py), so a chain is fed, not computed: the warp streams its tile and x through a ring of
// CHAIN_STAGES stages of CHAIN_K columns in shared memory of its own (CHAIN8_STAGES in 8-row tiles: a stage holds
// half the weights, and the warp's copies in flight, what its pace is bound by at few warps an SM, stay as many
// bytes; cp.async; a stage is the tile's rows, then x's 8), waits only for its own copies (no block barrier), and
// loads stage s + 1's fragments (both by ldmatrix) before it runs stage s's mmas: no global load waits in the chain,
// whose pace is its cost at few tiles an SM. A block is 1 to CHAIN_WARPS warps (the launcher spreads few tiles over
// the SMs a warp a block). The ring's first STAGES - 1 stages of weights are copied before the wait for the previous
// kernel, which writes x
// (programmatic dependent launch): cp.async of weights, which no kernel writes (test_pdl.py lets them go first and
// checks that they do); their x rows after it. Loads into registers there would not do: ptxas moves them below the
// wait, where their values are used.
// Gated (Act not Ungated: SwiGLU, GeGLU), w's rows come interleaved as for gemv (8 units' gate rows, then their up
// rows), so a lane holds a unit's gate and up sums and applies the activation as gemv_kernel.cuh's gated() does.
//
// Compiled with -DCHAIN_WARPS, -DCHAIN_K, -DCHAIN_STAGES and -DCHAIN8_STAGES from backends/cuda/ops.py, which also
// launches it.
#include "gemv_kernel.cuh"

constexpr int CHAIN_STEPS = CHAIN_K / 16;            // mmas per stage
constexpr int CHAIN_ROW = CHAIN_K + 8;               // a row of a stage in bf16 (16 bytes of padding: ldmatrix
                                                     // reads 8 rows without bank conflicts)
constexpr int CHAIN_CHUNKS = CHAIN_K / 8;            // 16-byte chunks of a row in a stage
// a stage in bf16 (the TILE weight rows, then x's 8 rows), and a lane's chunks of a stage's weights: a chunk of
// every 32 / CHUNKS rows
template <int TILE> constexpr int chain_stage = (TILE + 8) * CHAIN_ROW;
template <int TILE> constexpr int chain_pieces = TILE * CHAIN_CHUNKS / 32;
static_assert(CHAIN_K % 16 == 0 && 32 % CHAIN_CHUNKS == 0 && 8 * CHAIN_CHUNKS >= 32,
              "a stage is whole mmas; a warp copies whole rows");
static_assert(CHAIN_STEPS % 2 == 0, "a stage's mmas in two halves: copies and the wait, then loads");
static_assert(CHAIN_STAGES >= 3 && CHAIN8_STAGES >= 3,
              "the ring holds the stage multiplied, the next one's fragments and one in flight");

// Launch: grid ceil(n / TILE / warps), block 32 * warps (warps <= CHAIN_WARPS), dynamic shared memory warps * STAGES
// * chain_stage<TILE> bf16 (STAGES: CHAIN_STAGES, or CHAIN8_STAGES at TILE 8). 1 <= m <= 8, k % 16 == 0, x and w
// 16-byte aligned; gated: n % 16 == 0 and TILE 16 (a lane holds a unit's gate and up rows).
template <typename T, class Act, int TILE>
__device__ void gemv_chain(T* __restrict__ out, const bf16* x, const bf16* __restrict__ w, int m, int n, int k,
                           int accumulate) {
    static_assert(TILE == 16 || (TILE == 8 && std::is_same<Act, Ungated>::value), "16 rows, or 8 ungated");
    constexpr int CHAIN_STAGE = chain_stage<TILE>, CHAIN_PIECES = chain_pieces<TILE>;
    constexpr int STAGES = TILE == 16 ? CHAIN_STAGES : CHAIN8_STAGES;
    extern __shared__ __align__(16) bf16 rings[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + warp) * TILE;
    allow_dependents_launch();
    if (row0 >= n) {  // the last block's spare warps
        grid_dependency_wait();
        return;
    }
    bf16* const ring = rings + warp * STAGES * CHAIN_STAGE;
    const int stages = (k + CHAIN_K - 1) / CHAIN_K;
    // the lane's chunk of a row (the same in each of its pieces) and the first of its rows; piece i is 32 / CHUNKS
    // rows further
    const int chunk = lane % CHAIN_CHUNKS, lane_row = lane / CHAIN_CHUNKS;
    constexpr int PIECE_ROWS = 32 / CHAIN_CHUNKS;
    const bf16* rows[CHAIN_PIECES];
#pragma unroll
    for (int i = 0; i < CHAIN_PIECES; ++i) rows[i] = w + (int64_t)min(row0 + lane_row + PIECE_ROWS * i, n - 1) * k;
    auto in_k = [&](int s) { return s * CHAIN_K + chunk * 8 < k; };  // past k: zero-filled
    auto source = [&](int s, int i) { return rows[i] + min(s * CHAIN_K + chunk * 8, k - 8); };
    auto slot = [&](int s, int i) {
        return ring + (s % STAGES) * CHAIN_STAGE + (lane_row + PIECE_ROWS * i) * CHAIN_ROW + chunk * 8;
    };
    // copy i of stage s (CHAIN_COPIES a lane): weight pieces, then x's rows below them, rows past m zero-filled;
    // past k (and past the last stage) zero-filled, reading nothing
    constexpr int X_PIECES = 8 / PIECE_ROWS, CHAIN_COPIES = CHAIN_PIECES + X_PIECES;
    auto copy = [&](int s, int i) {
        if (i < CHAIN_PIECES) {
            cp_async16(slot(s, i), source(s, i), in_k(s));
        } else {
            const int r = lane_row + PIECE_ROWS * (i - CHAIN_PIECES);
            const bf16* from = x + (int64_t)min(r, m - 1) * k + min(s * CHAIN_K + chunk * 8, k - 8);
            cp_async16(slot(s, i - CHAIN_PIECES) + TILE * CHAIN_ROW, from, r < m && in_k(s));
        }
    };
    for (int s = 0; s < STAGES - 1; ++s) {  // weights only before the wait: no kernel writes them
#pragma unroll
        for (int i = 0; i < CHAIN_PIECES; ++i) copy(s, i);
        cp_async_commit();
    }
    grid_dependency_wait();
    for (int s = 0; s < STAGES - 1; ++s) {  // x, which the previous kernel writes
#pragma unroll
        for (int i = CHAIN_PIECES; i < CHAIN_COPIES; ++i) copy(s, i);
        cp_async_commit();
    }

    // Stage s's fragments by ldmatrix. TILE 16: A (lane l gives row l % 16 of the tile at k-offset 8 (l / 16):
    // a0..a3 as the mma takes them), B (lane l gives x row l % 8 at k-offset 8 (l / 8): b0, b1 of two steps; lane
    // g + 4t then holds x row g at k {2t, 2t + 1} and {2t + 8, 2t + 9} of each step, as the mma takes them); load i
    // of a stage: B's CHAIN_STEPS / 2 first (two steps each), then A's CHAIN_STEPS. TILE 8: x's 8 rows loaded the
    // same way are A's rows 0..7 (a0 and a2; a1 and a3, rows 8..15, are zeros), the tile's 8 rows so are B (b0, b1):
    // CHAIN_STEPS / 2 loads each.
    constexpr int CHAIN_LOADS = TILE == 16 ? CHAIN_STEPS / 2 + CHAIN_STEPS : CHAIN_STEPS;
    uint32_t a[2][CHAIN_STEPS][4], b[2][CHAIN_STEPS][2];
    auto load = [&](int s, int i, uint32_t (&af)[CHAIN_STEPS][4], uint32_t (&bf)[CHAIN_STEPS][2]) {
        const bf16* stage = ring + (s % STAGES) * CHAIN_STAGE;
        uint32_t r[4];
        if (i < CHAIN_STEPS / 2) {  // x's rows
            ldmatrix_x4(r, stage + (TILE + (lane & 7)) * CHAIN_ROW + (lane >> 3) * 8 + 32 * i);
            if constexpr (TILE == 16) {
                bf[2 * i][0] = r[0], bf[2 * i][1] = r[1], bf[2 * i + 1][0] = r[2], bf[2 * i + 1][1] = r[3];
            } else {
                af[2 * i][0] = r[0], af[2 * i][2] = r[1], af[2 * i + 1][0] = r[2], af[2 * i + 1][2] = r[3];
                af[2 * i][1] = af[2 * i][3] = af[2 * i + 1][1] = af[2 * i + 1][3] = 0u;
            }
        } else if constexpr (TILE == 16) {
            const int j = i - CHAIN_STEPS / 2;
            ldmatrix_x4(af[j], stage + (lane & 15) * CHAIN_ROW + (lane >> 4) * 8 + 16 * j);
        } else {  // the tile's 8 rows
            const int j = i - CHAIN_STEPS / 2;
            ldmatrix_x4(r, stage + (lane & 7) * CHAIN_ROW + (lane >> 3) * 8 + 32 * j);
            bf[2 * j][0] = r[0], bf[2 * j][1] = r[1], bf[2 * j + 1][0] = r[2], bf[2 * j + 1][1] = r[3];
        }
    };
    cp_async_wait<STAGES - 2>();  // stage 0 has landed (this lane's copies) ...
    __syncwarp();                        // ... and every lane's
#pragma unroll
    for (int i = 0; i < CHAIN_LOADS; ++i) load(0, i, a[0], b[0]);
    float c[4] = {};
    // Stage s: its mmas, each waiting for the one before, with the stage's other work spread between them, so that
    // the warp issues it while an mma runs: in the first half, the copies of stage s + STAGES - 1 into the
    // slot stage s - 1 left (read by ldmatrix before the last __syncwarp), then the wait for stage s + 1; in the
    // second half, stage s + 1's fragments into the other pair of buffers. The pairs alternate by stage, two stages
    // an iteration, so that the buffers stay in registers.
    constexpr int HALF = CHAIN_STEPS / 2;
    auto run = [&](int s, const uint32_t (&af)[CHAIN_STEPS][4], const uint32_t (&bf)[CHAIN_STEPS][2],
                   uint32_t (&an)[CHAIN_STEPS][4], uint32_t (&bn)[CHAIN_STEPS][2]) {
        const int steps = (k - s * CHAIN_K) / 16;  // < CHAIN_STEPS: k's last, partial stage
#pragma unroll
        for (int j = 0; j < CHAIN_STEPS; ++j) {
            if (j < steps) mma_bf16(c, af[j], bf[j][0], bf[j][1]);
            if (j < HALF) {
#pragma unroll
                for (int i = j * CHAIN_COPIES / HALF; i < (j + 1) * CHAIN_COPIES / HALF; ++i)
                    copy(s + STAGES - 1, i);
                if (j == HALF - 1) {
                    cp_async_commit();
                    cp_async_wait<STAGES - 2>();  // stage s + 1 has landed (this lane's copies) ...
                    __syncwarp();                        // ... and every lane's
                }
            } else {  // past the last stage: stale fragments, never multiplied
#pragma unroll
                for (int i = (j - HALF) * CHAIN_LOADS / HALF; i < (j - HALF + 1) * CHAIN_LOADS / HALF; ++i)
                    load(s + 1, i, an, bn);
            }
        }
    };
    for (int s = 0; s < stages; s += 2) {
        run(s, a[0], b[0], a[1], b[1]);
        if (s + 1 < stages) run(s + 1, a[1], b[1], a[0], b[0]);
    }
    cp_async_wait<0>();  // the zero-filling copies past the last stage
    // TILE 16, c: (row g, x row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1); TILE 8: (x row g, row 2t),
    // (x row g, row 2t + 1), then A's zero rows
    if constexpr (TILE == 8) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int row = row0 + 2 * t + j;
            if (row < n && g < m) store_out(out + (int64_t)g * n + row, c[j], accumulate);
        }
    } else if constexpr (std::is_same<Act, Ungated>::value) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int row = row0 + g + 8 * (j >> 1), col = 2 * t + (j & 1);
            if (row < n && col < m) store_out(out + (int64_t)col * n + row, c[j], accumulate);
        }
    } else {  // rows g: unit g's gate, g + 8: its up
        const int unit = row0 / 2 + g;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = 2 * t + j;
            if (unit < n / 2 && col < m) store_out(out + (int64_t)col * (n / 2) + unit, gated<Act>(c[j], c[j + 2]), 0);
        }
    }
}

// The kernels: bf16 or float32 out (optionally adding to it), and the gated MLP's two activations
#if KEEPS(gemv_chain_bf16)
extern "C" __global__ void __launch_bounds__(32 * CHAIN_WARPS)
gemv_chain_bf16(bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate) {
    gemv_chain<bf16, Ungated, 16>(out, x, w, m, n, k, accumulate);
}
#endif
#if KEEPS(gemv_chain_f32)
extern "C" __global__ void __launch_bounds__(32 * CHAIN_WARPS)
gemv_chain_f32(float* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate) {
    gemv_chain<float, Ungated, 16>(out, x, w, m, n, k, accumulate);
}
#endif
#if KEEPS(gemv_chain8_bf16)
extern "C" __global__ void __launch_bounds__(32 * CHAIN_WARPS)
gemv_chain8_bf16(bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate) {
    gemv_chain<bf16, Ungated, 8>(out, x, w, m, n, k, accumulate);
}
#endif
#if KEEPS(gemv_chain8_f32)
extern "C" __global__ void __launch_bounds__(32 * CHAIN_WARPS)
gemv_chain8_f32(float* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate) {
    gemv_chain<float, Ungated, 8>(out, x, w, m, n, k, accumulate);
}
#endif
#define GEMV_CHAIN_GATED(NAME, ACT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * CHAIN_WARPS)                                                  \
    gemv_##NAME##_chain(bf16* out, const bf16* x, const bf16* w, int m, int n, int k) {                            \
        gemv_chain<bf16, ACT, 16>(out, x, w, m, n, k, 0);                                                          \
    }
#if KEEPS(gemv_swiglu_chain)
GEMV_CHAIN_GATED(swiglu, Silu)
#endif
#if KEEPS(gemv_geglu_chain)
GEMV_CHAIN_GATED(geglu, GeluTanh)
#endif
