// One warp's share of a GEMV tile, shared by gemv.cu (dense layers) and moe.cu (experts): 16 weight rows times the
// 8 columns of x^T through mma.m16n8k16, in iterations of UNROLL 16-byte loads per row (gemv.cu explains the
// fragment layout: a lane's 8 consecutive k feed two mmas, w and x permuted alike).
#pragma once
#include "mma.cuh"

// w is read once and bypasses L1, so that L1 keeps x, which every block re-reads.
__device__ __forceinline__ uint4 load_streaming(const bf16* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// x is written by the kernel before (PDL): a plain load, because ptxas moves a non-coherent (__ldg) load of it
// above the grid_dependency_wait when w's loads come first (tests/gpu/test_pdl.py checks the order in the SASS).
__device__ __forceinline__ uint4 load_coherent(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// An iteration, first half: UNROLL 16-byte loads of each of the lane's two weight rows (w_lo: the A operand's row g,
// w_hi: its row g + 8) from chunk base on (the 4 lanes of a row read 64 contiguous bytes per u) ...
template <int UNROLL>
__device__ __forceinline__ void load_rows(uint4 (&lo)[UNROLL], uint4 (&hi)[UNROLL], const bf16* w_lo,
                                          const bf16* w_hi, int base, int t, int chunks) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int chunk = base + u * 4 + t;
        const bool in = chunk < chunks;
        lo[u] = in ? load_streaming(w_lo + chunk * 8) : make_uint4(0, 0, 0, 0);
        hi[u] = in ? load_streaming(w_hi + chunk * 8) : make_uint4(0, 0, 0, 0);
    }
}

// ... second half: as many of x row g (zeros where !x_ok: a padding column), then the mmas (A: a0, a2 from row g
// (lo), a1, a3 from row g + 8 (hi); B: x) into two accumulators, which halve the chain of dependent mmas.
template <int UNROLL>
__device__ __forceinline__ void multiply(float (&c)[2][4], const uint4 (&lo)[UNROLL], const uint4 (&hi)[UNROLL],
                                         const bf16* x_row, bool x_ok, int base, int t, int chunks) {
    uint4 xv[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int chunk = base + u * 4 + t;
        xv[u] = x_ok && chunk < chunks ? load_coherent(x_row + chunk * 8) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        mma_bf16(c[0], lo[u].x, hi[u].x, lo[u].y, hi[u].y, xv[u].x, xv[u].y);
        mma_bf16(c[1], lo[u].z, hi[u].z, lo[u].w, hi[u].w, xv[u].z, xv[u].w);
    }
}
