// The batch-invariant GEMV (EngineConfig.batch_invariant, m <= 8 rows): out[m, n] = x[m, k] . w[n, k]^T with each
// output's k walked as one chain of mma.sync m16n8k16, in k's natural order and the mma's own fragment layout: the
// additions of cuBLASLt's split-free algorithms, which bench/gemm_order.py finds bit for bit equal to this chain.
// So a row's product has the same bits from this kernel at batch 1..8 and from cuBLAS in a batch of 500, and the
// invariant mode keeps a GEMV at decode. gemv_kernel.cuh's kernels split k among warps and permute it inside each
// mma, which is faster at batch 1 and gives other bits.
//
// A block of SERIAL_WARPS warps, one 16-row weight tile each (w is the mma's A operand; x^T its B, whose 8 columns
// are the m <= 8 rows of x, zero past m), streams k in stages of SERIAL_K columns through a ring of SERIAL_STAGES
// stages of shared memory, filled by cp.async. Each warp's chain is k / 16 dependent mmas; the stages in flight keep
// the weights streaming while it runs. Rows are padded by 16 bytes so that ldmatrix reads them without bank
// conflicts. The first stages' weights go out before the wait for the previous kernel, which writes x (PDL); x's
// parts of them follow the wait.
//
// Gated (Act not Ungated: SwiGLU, GeGLU), w's rows come interleaved as for gemv (8 units' gate rows, then their up
// rows), so a lane holds a unit's gate and up sums and applies the activation as gemv_kernel.cuh's gated() does.
#include "gemv_kernel.cuh"

constexpr int SERIAL_CHUNKS = SERIAL_K / 8;  // 16-byte chunks of a row per stage
constexpr int SERIAL_ROW = SERIAL_K + 8;  // a row of a stage in shared memory, in bf16 (16 bytes of padding)
constexpr int SERIAL_W_ROWS = SERIAL_WARPS * 16;  // a block's weight rows
constexpr int SERIAL_STAGE = (SERIAL_W_ROWS + GEMV_MAX_ROWS) * SERIAL_ROW;  // a stage: w's rows, then x's, in bf16

// A stage's weight rows from column k0 (rows past n repeat row n - 1; chunks past k are zero-filled).
__device__ __forceinline__ void serial_load_w(bf16* stage, const bf16* w, int row0, int n, int k, int k0) {
    for (int i = threadIdx.x; i < SERIAL_W_ROWS * SERIAL_CHUNKS; i += blockDim.x) {
        const int r = i / SERIAL_CHUNKS, col = k0 + (i % SERIAL_CHUNKS) * 8;
        const bf16* src = w + (int64_t)min(row0 + r, n - 1) * k + (col < k ? col : 0);
        cp_async16(stage + r * SERIAL_ROW + (i % SERIAL_CHUNKS) * 8, src, col < k);
    }
}

// ... and x's rows (zero-filled past m: the B operand's padding columns, whose outputs are not stored).
__device__ __forceinline__ void serial_load_x(bf16* stage, const bf16* x, int m, int k, int k0) {
    for (int i = threadIdx.x; i < GEMV_MAX_ROWS * SERIAL_CHUNKS; i += blockDim.x) {
        const int r = i / SERIAL_CHUNKS, col = k0 + (i % SERIAL_CHUNKS) * 8;
        const bf16* src = x + (int64_t)min(r, m - 1) * k + (col < k ? col : 0);
        cp_async16(stage + (SERIAL_W_ROWS + r) * SERIAL_ROW + (i % SERIAL_CHUNKS) * 8, src, col < k && r < m);
    }
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t r[2], const bf16* p) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// Launch: grid ceil(n / SERIAL_W_ROWS), block SERIAL_WARPS * 32, dynamic shared memory SERIAL_STAGES * SERIAL_STAGE
// bf16. 1 <= m <= 8, k % 16 == 0, x and w 16-byte aligned; gated: n % 16 == 0.
template <typename T, class Act>
__device__ void gemv_serial(T* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w, int m, int n,
                            int k, int accumulate) {
    extern __shared__ __align__(16) bf16 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * SERIAL_W_ROWS, steps = k / 16, stages = (k + SERIAL_K - 1) / SERIAL_K;
    allow_dependents_launch();
    for (int s = 0; s < SERIAL_STAGES - 1 && s < stages; ++s)
        serial_load_w(smem + s * SERIAL_STAGE, w, row0, n, k, s * SERIAL_K);
    grid_dependency_wait();
    for (int s = 0; s < SERIAL_STAGES - 1; ++s) {  // a group per stage (the first holds the weights above too)
        if (s < stages) serial_load_x(smem + s * SERIAL_STAGE, x, m, k, s * SERIAL_K);
        cp_async_commit();
    }
    float c[4] = {};
    for (int s = 0; s < stages; ++s) {
        const int next = s + SERIAL_STAGES - 1;  // into the slot that stage s - 1 left
        if (next < stages) {
            bf16* slot = smem + (next % SERIAL_STAGES) * SERIAL_STAGE;
            serial_load_w(slot, w, row0, n, k, next * SERIAL_K);
            serial_load_x(slot, x, m, k, next * SERIAL_K);
        }
        cp_async_commit();
        cp_async_wait<SERIAL_STAGES - 1>();  // stage s has landed (this thread's copies) ...
        __syncthreads();  // ... and every thread's
        const bf16* slot = smem + (s % SERIAL_STAGES) * SERIAL_STAGE;
        // ldmatrix: lane l gives row l % 16 of the warp's tile at k-offset 8 (l / 16) (a0..a3), and row l % 8 of x
        // at k-offset 8 ((l / 8) % 2) (b0, b1): the mma's fragments as they are, k in natural order
        const bf16* a = slot + (warp * 16 + (lane & 15)) * SERIAL_ROW + (lane >> 4) * 8;
        const bf16* b = slot + (SERIAL_W_ROWS + (lane & 7)) * SERIAL_ROW + ((lane >> 3) & 1) * 8;
        const int here = min(SERIAL_K / 16, steps - s * (SERIAL_K / 16));
#pragma unroll
        for (int j = 0; j < SERIAL_K / 16; ++j) {
            if (j < here) {
                uint32_t af[4], bf[2];
                ldmatrix_x4(af, a + j * 16);
                ldmatrix_x2(bf, b + j * 16);
                mma_bf16(c, af, bf[0], bf[1]);
            }
        }
        __syncthreads();  // every warp is done with the slot before it is refilled
    }
    // c: (row g, column 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1): weight rows, x rows
    const int tile_row = row0 + warp * 16;
    if constexpr (std::is_same<Act, Ungated>::value) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int row = tile_row + g + 8 * (j >> 1), col = 2 * t + (j & 1);
            if (row < n && col < m) store_out(out + (int64_t)col * n + row, c[j], accumulate);
        }
    } else {  // rows g: unit g's gate, g + 8: its up
        const int unit = tile_row / 2 + g;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = 2 * t + j;
            if (unit < n / 2 && col < m) store_out(out + (int64_t)col * (n / 2) + unit, gated<Act>(c[j], c[j + 2]), 0);
        }
    }
}

// The kernels: bf16 or float32 out (optionally adding to it), and the gated MLP's two activations
#define GEMV_SERIAL_BF16()                                                                                          \
    extern "C" __global__ void __launch_bounds__(SERIAL_WARPS * 32)                                                 \
    gemv_serial_bf16(bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate) {               \
        gemv_serial<bf16, Ungated>(out, x, w, m, n, k, accumulate);                                                \
    }
#define GEMV_SERIAL_F32()                                                                                           \
    extern "C" __global__ void __launch_bounds__(SERIAL_WARPS * 32)                                                 \
    gemv_serial_f32(float* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate) {               \
        gemv_serial<float, Ungated>(out, x, w, m, n, k, accumulate);                                               \
    }
#define GEMV_SERIAL_GATED(NAME, ACT)                                                                                \
    extern "C" __global__ void __launch_bounds__(SERIAL_WARPS * 32)                                                 \
    gemv_##NAME##_serial_bf16(bf16* out, const bf16* x, const bf16* w, int m, int n, int k) {                      \
        gemv_serial<bf16, ACT>(out, x, w, m, n, k, 0);                                                             \
    }
#if KEEPS(gemv_serial_bf16)
GEMV_SERIAL_BF16()
#endif
#if KEEPS(gemv_serial_f32)
GEMV_SERIAL_F32()
#endif
#if KEEPS(gemv_swiglu_serial_bf16)
GEMV_SERIAL_GATED(swiglu, Silu)
#endif
#if KEEPS(gemv_geglu_serial_bf16)
GEMV_SERIAL_GATED(geglu, GeluTanh)
#endif
