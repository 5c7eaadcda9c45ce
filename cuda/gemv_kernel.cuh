// GEMV for small batches (decode): out[m, n] = x[m, k] . w[n, k]^T for m <= 8, the meaning of Cublas.gemm: bf16
// inputs, float32 accumulation, bf16 or float32 out, optionally out += x . w^T (the fused residual add). The
// kernels of gemv.cu (bf16 weights) and fp8.cu (e4m3 weights, W8A8) are this template.
//
// Why it is shaped so: at m <= 8 the product is a single pass over w (n * k weights), so the kernel is about keeping
// enough 16-byte loads of w in flight; everything else must stay off the critical path. The arithmetic goes to
// the tensor cores, one mma per 16 rows x 16 bytes of k (m16n8k16 for bf16, m16n8k32 for e4m3): w is the A operand
// (16 rows), x^T the B operand, whose 8 columns are the m <= 8 rows of x (padded by repeating the last one; their
// outputs are dropped). So there are no per-element conversions and no shuffle reductions, and every m <= 8 costs
// the same.
//
// The fragment layout gives lane (g = lane / 4, t = lane % 4) 4-byte pieces of rows g and g+8: k-columns {2t, 2t+1,
// 2t+8, 2t+9} (bf16) or {4t..4t+3, 16+4t..16+4t+3} (e4m3). A dot product does not care about the order of k, so
// instead each lane loads 16 consecutive bytes (one load) of rows g and g+8 and of x row g, and feeds bytes 0-7 to
// one mma and 8-15 to the next: w and x are permuted alike, so the sum is unchanged.
//
// Work split: a 16-row tile is shared by `split` warps (1, 2, 4 or 8, chosen by the host so that each warp has at
// least one full iteration of k); a block of GEMV_WARPS warps holds GEMV_WARPS / split tiles. Per iteration a warp
// issues GEMV_UNROLL loads of each of its two rows (512 contiguous bytes per row across the warp) and of x before
// the first mma; at 4 KB rows and split 8 that is the whole row, so a block has all of its 64 KB in flight at once.
// The split warps' 16x8 partial tiles are summed through shared memory. w bypasses L1 (it is read once) so that
// L1 keeps x, which every block re-reads. The first iteration's w loads go out before the wait for the previous
// kernel (programmatic dependent launch, common.cuh), so they overlap its end; and the next kernel may launch at
// once, so that its blocks are resident and its own first loads in flight as this one ends (common.cuh).
//
// e4m3 weights (W8A8, one float32 scale per weight row): x comes quantized, as the f16 values of its e4m3 codes
// (exact) with one scale per row, written by the kernel that produces x (rms_norm; else quantize_fp8_values, a kernel
// of its own), with quantize_fp8's arithmetic (fp8.cu). So the kernel reads x as the bf16 one does, as the mma's B
// operand, with nothing between its wait and its first mma: a block that quantized x itself into shared memory
// exposed ~2.5 us per launch at batch 1, and lanes that quantized what they load spent ~40 instructions per 32
// bytes of weights on it (docs/PERFORMANCE.md, Decisions: "FP8 GEMV: x quantized by its producer"). sm_90's
// mma.sync has no FP8 form (an e4m3 mma is compiled into conversions to f16 and f16 mmas), so w's codes become f16
// in registers as they arrive, and the products run as f16 mmas; each product of two e4m3 values is exact in
// float32. The sums are scaled at the end by the x row's and the weight row's scales, the latter loaded before the
// wait with the first weights.
//
// The gate/up projection (gemv_swiglu_*, gemv_geglu_*) ends in SwiGLU or GeGLU instead of storing gate_up
// (activation.cu's silu_and_mul and gelu_tanh_and_mul, a kernel and a boundary fewer per layer): its weight rows
// come interleaved so that a 16-row tile holds 8 units' gate rows and their up rows.
//
// A warp with more than one iteration of k (Llama-3.2-1B's bf16 down projection: 4) loads an iteration, waits for
// it, multiplies, and only then loads the next, so HBM idles between iterations. The `_pipelined` kernels keep a
// second register buffer: the next iteration's loads go out before this one's mmas. That needs ~210 registers, so
// one block per SM; for bf16 weights ops.py picks them only where the grid fits on the SMs at that (8B's QKV and O,
// at 2-3 blocks per SM in the plain form, would lose occupancy; docs/PERFORMANCE.md, Decisions: "gemv's pipelined
// form").
//
// Compiled with -DGEMV_WARPS (warps per block) and -DGEMV_UNROLL (16-byte loads per row (two rows) and of x that a
// lane has in flight) from backends/cuda/ops.py, which also picks `split` and launches the kernels.
#pragma once
#include <type_traits>

#include "gemv_tile.cuh"

// Asking for 2 blocks per SM (so 128 registers) is what makes ptxas keep all 3 * GEMV_UNROLL loads of an iteration
// in flight: left to itself it picks ~50 registers and issues each load just before its mma, one memory latency
// per load.
#define GEMV_MIN_BLOCKS 2
#define GEMV_MAX_ROWS 8  // the mma's n: x rows per launch

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

// Launch: grid (ceil(ceil(n / 16) / (GEMV_WARPS / split))), block GEMV_WARPS * 32. 1 <= m <= 8, x and w 16-byte
// aligned; bf16 weights (W = bf16): x bf16, k % 8 == 0, w_scale and x_scale unused; e4m3 (W = e4m3): x the f16
// values of e4m3 codes, x_scale [m] their scales, k % 16 == 0, w_scale [n]; split in {1, 2, 4, 8}; a gated Act (not
// Ungated): n % 16 == 0. BLOCK (e4m3, ungated): w_scale [ceil(n / 128), kbp] one per 128 x 128 block of w (kbp:
// ceil(k / 128) rounded up to a multiple of 4, as cuBLASLt's block scales are laid out), x_scale [ceil(k / 128), m]
// one per x row and 128 columns (multiply_e4m3_blocks).
template <typename T, class Act, bool PIPELINED, typename W, typename X, bool BLOCK = false>
__device__ void gemv(T* __restrict__ out, const X* __restrict__ x, const W* __restrict__ w,
                     const float* __restrict__ w_scale, const float* x_scale, int m, int n, int k, int split,
                     int accumulate) {
    constexpr bool FP8 = std::is_same<W, e4m3>::value;
    constexpr bool GATED = !std::is_same<Act, Ungated>::value;
    __shared__ __align__(16) float partial[GEMV_WARPS][128];  // each warp's c fragment, 4 floats per lane
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tiles = GEMV_WARPS / split, tile0 = blockIdx.x * tiles, row0 = (tile0 + warp / split) * 16;
    // 16-byte chunks per row (none past n). Rows past n (last tile) repeat row n-1 and columns past m repeat x row
    // m-1: loads stay in bounds, and the outputs they feed are not stored.
    const int chunks = row0 < n ? k / (16 / (int)sizeof(W)) : 0;
    const W* w_lo = w + (int64_t)min(row0 + g, n - 1) * k;
    const W* w_hi = w + (int64_t)min(row0 + g + 8, n - 1) * k;
    const X* x_row = x + (int64_t)min(g, m - 1) * k;
    const int block_stride = ((k + 127) / 128 + 3) / 4 * 4;  // BLOCK: kbp
    const float* ws_lo = w_scale + (int64_t)(min(row0 + g, n - 1) / 128) * block_stride;
    const float* ws_hi = w_scale + (int64_t)(min(row0 + g + 8, n - 1) / 128) * block_stride;
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
    // The epilogue's elements: this thread stores e = threadIdx.x + i * blockDim.x, i < PER_THREAD (a tile's 128
    // products, or its 64 gated units); e4m3: their weight rows' scales are loaded here, with the first weights and
    // before the wait (no kernel writes them), not by the epilogue, which would wait on HBM for them.
    constexpr int PER_THREAD = GATED ? 2 : 4;  // tiles * 64 (or 128) / blockDim.x, at most
    const int elements = tiles * (GATED ? 64 : 128);
    auto weight_row = [&](int e) {  // element e's weight row (gated: its gate's; the up row is 8 after it)
        return GATED ? (tile0 + (e >> 6)) * 16 + ((e & 63) >> 3)
                     : (tile0 + (e >> 7)) * 16 + ((e & 127) >> 4) + ((e & 3) >> 1) * 8;
    };
    float row_scale[PER_THREAD][2] = {};
    if constexpr (FP8 && !BLOCK) {
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int e = threadIdx.x + i * blockDim.x, row = weight_row(e);
            if (e >= elements) break;
            // __ldg: a read-only load (LDG.CONSTANT), which test_pdl.py lets go before the wait
            row_scale[i][0] = __ldg(w_scale + min(row, n - 1));
            if (GATED) row_scale[i][1] = __ldg(w_scale + min(row + 8, n - 1));
        }
    }
    grid_dependency_wait();  // a warp without k to load still waits before it stores out
    float c[2][4] = {};  // two accumulators halve the chain of dependent mmas
    auto mul = [&](const uint4 (&a)[GEMV_UNROLL], const uint4 (&b)[GEMV_UNROLL], int at) {
        if constexpr (BLOCK) {
            multiply_e4m3_blocks<GEMV_UNROLL>(c, a, b, x_row, at, t, chunks, ws_lo, ws_hi, x_scale,
                                              min(2 * t, m - 1), min(2 * t + 1, m - 1), m);
        } else if constexpr (FP8) {
            multiply_e4m3<GEMV_UNROLL>(c, a, b, x_row, at, t, chunks);
        } else {
            multiply<GEMV_UNROLL>(c, a, b, x_row, true, at, t, chunks);
        }
    };
    if (PIPELINED) {  // the next iteration's loads go out before this one's mmas (two register buffers)
        uint4 lo2[GEMV_UNROLL], hi2[GEMV_UNROLL];
        for (; base < chunks; base += 2 * stride) {
            if (base + stride < chunks) load_rows<GEMV_UNROLL>(lo2, hi2, w_lo, w_hi, base + stride, t, chunks);
            mul(lo, hi, base);
            if (base + stride >= chunks) break;
            if (base + 2 * stride < chunks) load_rows<GEMV_UNROLL>(lo, hi, w_lo, w_hi, base + 2 * stride, t, chunks);
            mul(lo2, hi2, base + stride);
        }
    } else {
        if (base < chunks) mul(lo, hi, base);
        for (base += stride; base < chunks; base += stride) {
            load_rows<GEMV_UNROLL>(lo, hi, w_lo, w_hi, base, t, chunks);
            mul(lo, hi, base);
        }
    }
    *reinterpret_cast<float4*>(&partial[warp][lane * 4]) =
        make_float4(c[0][0] + c[1][0], c[0][1] + c[1][1], c[0][2] + c[1][2], c[0][3] + c[1][3]);
    __syncthreads();
    // a sum of x row `col` times its weight row's scale and the x row's (e4m3), as stored
    auto scaled = [&](float sum, float w_row_scale, int col) {
        if constexpr (FP8 && !BLOCK) return sum * x_scale[col] * w_row_scale;
        return sum;
    };
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int e = threadIdx.x + i * blockDim.x, row = weight_row(e);
        if (e >= elements) break;
        if constexpr (GATED) {
            // a tile's rows g are gate rows, g + 8 the same units' up rows: out [m, n / 2]
            const int tile = e >> 6, l = (e & 63) >> 1, j = e & 1;  // lane l's gate (c element j), up (j + 2)
            float gate = 0.f, up = 0.f;
            for (int z = 0; z < split; ++z) {
                gate += partial[tile * split + z][l * 4 + j];
                up += partial[tile * split + z][l * 4 + j + 2];
            }
            const int unit = (tile0 + tile) * 8 + (l >> 2), col = (l & 3) * 2 + j;
            if (unit < n / 2 && col < m)
                store_out(out + (int64_t)col * (n / 2) + unit,
                          gated<Act>(scaled(gate, row_scale[i][0], col), scaled(up, row_scale[i][1], col)), 0);
        } else {
            // Element f = 4 * lane + j of a tile's fragment, summed over the tile's split warps, is out[col, row]
            // with row = g + 8 * (j / 2), col = 2t + j % 2 (the mma's c layout).
            const int tile = e >> 7, f = e & 127, l = f >> 2, j = f & 3, col = (l & 3) * 2 + (j & 1);
            float sum = 0.f;
            for (int z = 0; z < split; ++z) sum += partial[tile * split + z][f];
            if (row < n && col < m)
                store_out(out + (int64_t)col * n + row, scaled(sum, row_scale[i][0], col), accumulate);
        }
    }
}
