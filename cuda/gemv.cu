// GEMV for small batches (decode): out[m, n] = x[m, k] . w[n, k]^T for m <= 8, the meaning of Cublas.gemm: bf16
// inputs, float32 accumulation, bf16 or float32 out, optionally out += x . w^T (the fused residual add).
//
// Why it is shaped so: at m <= 8 the product is a single pass over w (n * k bf16), so the kernel is about keeping
// enough 16-byte loads of w in flight; everything else must stay off the critical path. The arithmetic goes to
// the tensor cores, one mma.m16n8k16 per 16 rows x 16 k: w is the A operand (16 rows), x^T the B operand, whose 8
// columns are the m <= 8 rows of x (padded by repeating the last one; their outputs are dropped). So there are no
// per-element bf16 -> float conversions and no shuffle reductions, and every m <= 8 costs the same.
//
// The fragment layout gives lane (g = lane / 4, t = lane % 4) k-columns {2t, 2t+1, 2t+8, 2t+9} of rows g and g+8,
// i.e. 4-byte pieces. A dot product does not care about the order of k, so instead each lane loads 8 consecutive
// k (one 16-byte load) of rows g and g+8 and of x row g, and feeds elements 0-3 to one mma and 4-7 to the next:
// w and x are permuted alike, so the sum is unchanged.
//
// Work split: a 16-row tile is shared by `split` warps (1, 2, 4 or 8, chosen by the host so that each warp has at
// least one full iteration of k); a block of GEMV_WARPS warps holds GEMV_WARPS / split tiles. Per iteration a warp
// issues GEMV_UNROLL loads of each of its two rows (512 contiguous bytes per row across the warp) and of x before
// the first mma; at k = 2048 and split 8 that is the whole row, so a block has all of its 64 KB in flight at once.
// The split warps' 16x8 partial tiles are summed through shared memory. w bypasses L1 (it is read once) so that
// L1 keeps x, which every block re-reads. The first iteration's w loads go out before the wait for the previous
// kernel (programmatic dependent launch, common.cuh), so they overlap its end; and the next kernel may launch at
// once, so that its blocks are resident and its own first loads in flight as this one ends (common.cuh).
//
// The gate/up projection (gemv_swiglu_bf16, gemv_geglu_bf16) ends in SwiGLU or GeGLU instead of storing gate_up
// (activation.cu's silu_and_mul and gelu_tanh_and_mul, a kernel and a boundary fewer per layer): its weight rows
// come interleaved so that a 16-row tile holds 8 units' gate rows and their up rows.
//
// A warp with more than one iteration of k (Llama-3.2-1B's down projection: 4) loads an iteration, waits for it,
// multiplies, and only then loads the next, so HBM idles between iterations. The `_pipelined` kernels keep a second
// register buffer: the next iteration's loads go out before this one's mmas. That needs ~210 registers, so one
// block per SM; ops.py picks them only where the grid fits on the SMs at that (8B's QKV and O, at 2-3 blocks per SM
// in the plain form, would lose occupancy; docs/PERFORMANCE.md, Decisions: "gemv's pipelined form").
//
// Compiled with -DGEMV_WARPS (warps per block) and -DGEMV_UNROLL (16-byte loads per row (two rows) and of x that a
// lane has in flight) from backends/cuda/ops.py, which also picks `split` and launches the kernels.
#include <type_traits>

#include "gemv_tile.cuh"

// Asking for 2 blocks per SM (so 128 registers) is what makes ptxas keep all 3 * GEMV_UNROLL loads of an iteration
// in flight: left to itself it picks ~50 registers and issues each load just before its mma, one memory latency
// per load.
#define GEMV_MIN_BLOCKS 2

// Act(gate, up) (common.cuh: Silu, GeluTanh) from float32 sums, each first rounded to bf16 as the GEMM's bf16 output
// is before activation.cu's kernels read it, so that both paths give the same activation.
template <class Act>
__device__ __forceinline__ float gated(float gate, float up) {
    return Act::apply(__bfloat162float(__float2bfloat16(gate)), __bfloat162float(__float2bfloat16(up)));
}

struct Ungated {};  // gemv's Act for a plain product (no activation)

__device__ __forceinline__ void store_out(float* p, float v, int accumulate) { *p = accumulate ? *p + v : v; }

__device__ __forceinline__ void store_out(bf16* p, float v, int accumulate) {
    *p = __float2bfloat16(accumulate ? __bfloat162float(*p) + v : v);
}

// Launch: grid (ceil(ceil(n / 16) / (GEMV_WARPS / split))), block GEMV_WARPS * 32. 1 <= m <= 8, k % 8 == 0,
// x and w 16-byte aligned; split in {1, 2, 4, 8}; a gated Act (not Ungated): n % 16 == 0.
template <typename T, class Act, bool PIPELINED>
__device__ void gemv(T* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w, int m, int n,
                     int k, int split, int accumulate) {
    __shared__ __align__(16) float partial[GEMV_WARPS][128];  // each warp's c fragment, 4 floats per lane
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tiles = GEMV_WARPS / split, tile0 = blockIdx.x * tiles;
    const int row0 = (tile0 + warp / split) * 16;
    const int chunks = row0 < n ? k / 8 : 0;  // 16-byte chunks per row; a tile wholly past n loads nothing
    // Rows past n (last tile) repeat row n-1 and columns past m repeat x row m-1: loads stay in bounds, and the
    // outputs they feed are not stored.
    const bf16* w_lo = w + (int64_t)min(row0 + g, n - 1) * k;
    const bf16* w_hi = w + (int64_t)min(row0 + g + 8, n - 1) * k;
    const bf16* x_row = x + (int64_t)min(g, m - 1) * k;
    float c[2][4] = {};  // two accumulators halve the chain of dependent mmas
    uint4 lo[GEMV_UNROLL], hi[GEMV_UNROLL];
    // The first iteration's w loads go out before the wait for the previous kernel, which writes x (PDL): no
    // kernel writes w, so they overlap that kernel's end. That iteration is peeled so that the one wait is
    // straight-line code after them: with the wait behind a branch in the loop, ptxas issued 2 of the 16 before it
    // (tests/gpu/test_pdl.py counts them; docs/PERFORMANCE.md, Decisions: "gemv's first iteration of weights
    // before the wait").
    const int stride = split * GEMV_UNROLL * 4;
    int base = (warp % split) * GEMV_UNROLL * 4;
    allow_dependents_launch();  // at the start (docs/PERFORMANCE.md, Decisions: "gemv's launch point")
    if (base < chunks) load_rows<GEMV_UNROLL>(lo, hi, w_lo, w_hi, base, t, chunks);
    grid_dependency_wait();  // a warp without k to load still waits before it stores out
    if (PIPELINED) {  // the next iteration's loads go out before this one's mmas (two register buffers)
        uint4 lo2[GEMV_UNROLL], hi2[GEMV_UNROLL];
        for (; base < chunks; base += 2 * stride) {
            if (base + stride < chunks) load_rows<GEMV_UNROLL>(lo2, hi2, w_lo, w_hi, base + stride, t, chunks);
            multiply<GEMV_UNROLL>(c, lo, hi, x_row, true, base, t, chunks);
            if (base + stride >= chunks) break;
            if (base + 2 * stride < chunks) load_rows<GEMV_UNROLL>(lo, hi, w_lo, w_hi, base + 2 * stride, t, chunks);
            multiply<GEMV_UNROLL>(c, lo2, hi2, x_row, true, base + stride, t, chunks);
        }
    } else {
        if (base < chunks) multiply<GEMV_UNROLL>(c, lo, hi, x_row, true, base, t, chunks);
        for (base += stride; base < chunks; base += stride) {
            load_rows<GEMV_UNROLL>(lo, hi, w_lo, w_hi, base, t, chunks);
            multiply<GEMV_UNROLL>(c, lo, hi, x_row, true, base, t, chunks);
        }
    }
    *reinterpret_cast<float4*>(&partial[warp][lane * 4]) =
        make_float4(c[0][0] + c[1][0], c[0][1] + c[1][1], c[0][2] + c[1][2], c[0][3] + c[1][3]);
    __syncthreads();
    if constexpr (!std::is_same<Act, Ungated>::value) {
        // a tile's rows g are gate rows, g + 8 the same units' up rows: out [m, n / 2]
        for (int e = threadIdx.x; e < tiles * 64; e += blockDim.x) {
            const int tile = e >> 6, l = (e & 63) >> 1, j = e & 1;  // lane l's gate (c element j), up (j + 2)
            float gate = 0.f, up = 0.f;
            for (int i = 0; i < split; ++i) {
                gate += partial[tile * split + i][l * 4 + j];
                up += partial[tile * split + i][l * 4 + j + 2];
            }
            const int unit = (tile0 + tile) * 8 + (l >> 2), col = (l & 3) * 2 + j;
            if (unit < n / 2 && col < m) store_out(out + (int64_t)col * (n / 2) + unit, gated<Act>(gate, up), 0);
        }
    } else {
        // Element f = 4 * lane + j of a tile's fragment, summed over the tile's split warps, is out[col, row] with
        // row = g + 8 * (j / 2), col = 2t + j % 2 (the mma's c layout).
        for (int e = threadIdx.x; e < tiles * 128; e += blockDim.x) {
            const int tile = e >> 7, f = e & 127, l = f >> 2, j = f & 3;
            float sum = 0.f;
            for (int i = 0; i < split; ++i) sum += partial[tile * split + i][f];
            const int row = (tile0 + tile) * 16 + (l >> 2) + (j >> 1) * 8, col = (l & 3) * 2 + (j & 1);
            if (row < n && col < m) store_out(out + (int64_t)col * n + row, sum, accumulate);
        }
    }
}

// Each kernel in two forms: plain, 2 blocks per SM (128 registers), and `_pipelined`, one block per SM (see the top).
#define GEMV_BF16(SUFFIX, PIPELINED, MIN_BLOCKS)                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                       \
    gemv_bf16##SUFFIX(bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int split, int accumulate) {   \
        gemv<bf16, Ungated, PIPELINED>(out, x, w, m, n, k, split, accumulate);                                       \
    }
#define GEMV_F32(SUFFIX, PIPELINED, MIN_BLOCKS)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                       \
    gemv_f32##SUFFIX(float* out, const bf16* x, const bf16* w, int m, int n, int k, int split, int accumulate) {   \
        gemv<float, Ungated, PIPELINED>(out, x, w, m, n, k, split, accumulate);                                      \
    }
// out [m, n / 2] = Act(x . w^T) (SwiGLU: swiglu, GeGLU: geglu), w the gate/up projection with its rows interleaved in
// groups of 8 (8 gate rows, then the same units' 8 up rows; backends/cuda/forward.py packs it so)
#define GEMV_GATED(NAME, ACT, SUFFIX, PIPELINED, MIN_BLOCKS)                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                       \
    gemv_##NAME##_bf16##SUFFIX(bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int split) {          \
        gemv<bf16, ACT, PIPELINED>(out, x, w, m, n, k, split, 0);                                                  \
    }
#if KEEPS(gemv_bf16)
GEMV_BF16(, false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_f32)
GEMV_F32(, false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_swiglu_bf16)
GEMV_GATED(swiglu, Silu, , false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_geglu_bf16)
GEMV_GATED(geglu, GeluTanh, , false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_bf16_pipelined)
GEMV_BF16(_pipelined, true, 1)
#endif
#if KEEPS(gemv_f32_pipelined)
GEMV_F32(_pipelined, true, 1)
#endif
#if KEEPS(gemv_swiglu_bf16_pipelined)
GEMV_GATED(swiglu, Silu, _pipelined, true, 1)
#endif
#if KEEPS(gemv_geglu_bf16_pipelined)
GEMV_GATED(geglu, GeluTanh, _pipelined, true, 1)
#endif
