// One warp's share of a GEMV tile, shared by gemv_kernel.cuh (dense layers, bf16 and e4m3 weights) and moe.cu
// (experts): 16 weight rows times the 8 columns of x^T through mma.m16n8k16 (bf16) or m16n8k32 (e4m3), in
// iterations of UNROLL 16-byte loads per row (gemv_kernel.cuh explains the fragment layout: a lane's 16 consecutive
// bytes feed two mmas, w and x permuted alike).
#pragma once
#include "mma.cuh"

// w is read once and bypasses L1, so that L1 keeps x, which every block re-reads.
__device__ __forceinline__ uint4 load_streaming(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// x is written by the kernel before (PDL): a plain load, because ptxas moves a non-coherent (__ldg) load of it
// above the grid_dependency_wait when w's loads come first (tests/gpu/test_pdl.py checks the order in the SASS).
__device__ __forceinline__ uint4 load_coherent(const void* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// An iteration, first half: UNROLL 16-byte loads of each of the lane's two weight rows (w_lo: the A operand's row g,
// w_hi: its row g + 8) from chunk base on (the 4 lanes of a row read 64 contiguous bytes per u); a chunk is 16 bytes
// of any weight dtype (8 bf16 or 16 e4m3 codes) ...
template <int UNROLL, typename W>
__device__ __forceinline__ void load_rows(uint4 (&lo)[UNROLL], uint4 (&hi)[UNROLL], const W* w_lo, const W* w_hi,
                                          int base, int t, int chunks) {
    const uint4* lo_row = reinterpret_cast<const uint4*>(w_lo);
    const uint4* hi_row = reinterpret_cast<const uint4*>(w_hi);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int chunk = base + u * 4 + t;
        const bool in = chunk < chunks;
        lo[u] = in ? load_streaming(lo_row + chunk) : make_uint4(0, 0, 0, 0);
        hi[u] = in ? load_streaming(hi_row + chunk) : make_uint4(0, 0, 0, 0);
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

// Two e4m3 codes (the low or high 16 bits of `word`) -> their values as f16x2, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t word, int high) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(word >> (16 * high)), __NV_E4M3);
    return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// x row g's f16 code values of a lane's UNROLL chunks (32 bytes each; zeros past k), for multiply_e4m3 and
// multiply_e4m3_blocks.
template <int UNROLL>
__device__ __forceinline__ void load_x_values(uint4 (&xv)[UNROLL][2], const __half* x_row, int base, int t,
                                              int chunks) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int chunk = base + u * 4 + t;
        const bool in = chunk < chunks;
        xv[u][0] = in ? load_coherent(x_row + chunk * 16) : make_uint4(0, 0, 0, 0);
        xv[u][1] = in ? load_coherent(x_row + chunk * 16 + 8) : make_uint4(0, 0, 0, 0);
    }
}

// The e4m3 form of multiply: the weights' codes become f16 in registers (sm_90's mma.sync has no FP8 form: an
// e4m3 mma compiles to these conversions and f16 mmas anyway); x row g comes as the f16 values of its e4m3 codes
// (32 bytes per 16-code chunk), as the kernel that wrote x stored them. Word q of a lane's 16 codes of each row feeds
// one m16n8k16 mma: its codes 0-1 as k {2t, 2t+1}, 2-3 as k {2t+8, 2t+9}, and x's values 4q.. alike.
template <int UNROLL>
__device__ __forceinline__ void multiply_e4m3(float (&c)[2][4], const uint4 (&lo)[UNROLL], const uint4 (&hi)[UNROLL],
                                              const __half* x_row, int base, int t, int chunks) {
    uint4 xv[UNROLL][2];
    load_x_values<UNROLL>(xv, x_row, base, t, chunks);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const uint32_t* l = reinterpret_cast<const uint32_t*>(&lo[u]);
        const uint32_t* h = reinterpret_cast<const uint32_t*>(&hi[u]);
        const uint32_t* x = reinterpret_cast<const uint32_t*>(xv[u]);
#pragma unroll
        for (int q = 0; q < 4; ++q)
            mma_f16(c[q & 1], e4m3x2_to_f16x2(l[q], 0), e4m3x2_to_f16x2(h[q], 0), e4m3x2_to_f16x2(l[q], 1),
                    e4m3x2_to_f16x2(h[q], 1), x[2 * q], x[2 * q + 1]);
    }
}

// multiply_e4m3 with weights scaled per 128 x 128 block and x per row and 128 columns (an FP8 checkpoint's block
// scales): each u's mmas (the 4 lanes t read chunks base + 4u .. + 3, 64 codes inside one 128-column block) go into
// an accumulator of their own, which is then added to c times its scales: the block scale of the lane's row g
// (ws_lo[kb]) or g + 8 (ws_hi[kb]) and the group scale of its x rows 2t and 2t + 1 (x_scale[kb * m + col]: x's
// group scales, [ceil(k / 128), m]). base is a multiple of 8 (4 * UNROLL, UNROLL even), so u 2p and 2p + 1 share
// block base / 8 + p; the iteration's scales are loaded together before its mmas, not each before its own.
template <int UNROLL>
__device__ __forceinline__ void multiply_e4m3_blocks(float (&c)[2][4], const uint4 (&lo)[UNROLL],
                                                     const uint4 (&hi)[UNROLL], const __half* x_row, int base, int t,
                                                     int chunks, const float* ws_lo, const float* ws_hi,
                                                     const float* x_scale, int col0, int col1, int m) {
    static_assert(UNROLL % 2 == 0, "two u of 4 lanes' 16 codes make a 128-column block");
    constexpr int PAIRS = UNROLL / 2;
    uint4 xv[UNROLL][2];
    load_x_values<UNROLL>(xv, x_row, base, t, chunks);
    float s_lo[PAIRS], s_hi[PAIRS], x0[PAIRS], x1[PAIRS];
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
        const int kb = (base >> 3) + p;
        const bool in = base + 8 * p < chunks;
        s_lo[p] = in ? ws_lo[kb] : 0.f;
        s_hi[p] = in ? ws_hi[kb] : 0.f;
        x0[p] = in ? x_scale[(int64_t)kb * m + col0] : 0.f;
        x1[p] = in ? x_scale[(int64_t)kb * m + col1] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        if (base + u * 4 >= chunks) break;
        const int p = u >> 1;
        const uint32_t* l = reinterpret_cast<const uint32_t*>(&lo[u]);
        const uint32_t* h = reinterpret_cast<const uint32_t*>(&hi[u]);
        const uint32_t* x = reinterpret_cast<const uint32_t*>(xv[u]);
        float d[2][4] = {};
#pragma unroll
        for (int q = 0; q < 4; ++q)
            mma_f16(d[q & 1], e4m3x2_to_f16x2(l[q], 0), e4m3x2_to_f16x2(h[q], 0), e4m3x2_to_f16x2(l[q], 1),
                    e4m3x2_to_f16x2(h[q], 1), x[2 * q], x[2 * q + 1]);
        // c's elements: (row g, col 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
        c[u & 1][0] += (d[0][0] + d[1][0]) * (s_lo[p] * x0[p]);
        c[u & 1][1] += (d[0][1] + d[1][1]) * (s_lo[p] * x1[p]);
        c[u & 1][2] += (d[0][2] + d[1][2]) * (s_hi[p] * x0[p]);
        c[u & 1][3] += (d[0][3] + d[1][3]) * (s_hi[p] * x1[p]);
    }
}
