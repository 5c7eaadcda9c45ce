// Tensor-core helpers shared by the attention kernels, the GEMVs and MoE's grouped GEMM: mma.sync m16n8k16 (bf16 in,
// float32 accumulate), ldmatrix loads of its operands from shared memory, cp.async copies into it, and the online
// softmax of the attention kernels.
#pragma once
#include "common.cuh"

// c += A . B with A 16x16 and B 16x8 bf16, c 16x8 float32. With g = lane / 4 and t = lane % 4, each register holds
// two bf16 of k-columns {2t, 2t+1} (a0, a1, b0) or {2t+8, 2t+9} (a2, a3, b1): a0, a2 of row g, a1, a3 of row g+8,
// b0, b1 of column g. c holds (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// c += A . B as mma_bf16, for f16 operands (the FP8 GEMV's e4m3 values, exact in f16).
__device__ __forceinline__ void mma_f16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same with A as a fragment a[4] (as ldmatrix_x4 loads it).
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    mma_bf16(c, a[0], a[1], a[2], a[3], b0, b1);
}
__device__ __forceinline__ void mma_f16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    mma_f16(c, a[0], a[1], a[2], a[3], b0, b1);
}

// Four 8x8 bf16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const bf16* p) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Two 8x8 bf16 matrices; lanes 0-15 give the row addresses (row l % 8 of matrix l / 8).
__device__ __forceinline__ void ldmatrix_x2(uint32_t r[2], const bf16* p) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const bf16* p) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// 16 bytes global -> shared without passing through registers (cp.async, L2 only); zero-filled where !valid, so
// that gmem must still be a valid address. A stage of copies is a commit group; wait<N> leaves N groups in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The dynamic shared memory this launch was given (a kernel whose extern __shared__ array the launcher sizes checks
// it against what it uses).
__device__ __forceinline__ uint32_t dynamic_shared_bytes() {
    uint32_t bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// S = Q K^T for a warp's 16 query rows and N keys: qf holds Q as A fragments (one per 16 dims), k_s the keys as rows
// [N][LD] of shared memory; s gets one m16n8 accumulator per 8 keys (row lane / 4 (+ 8), keys 2 * (lane % 4) (+ 1)).
template <int D, int N, int LD>
__device__ __forceinline__ void mma_qk(float (&s)[N / 8][4], const uint32_t (&qf)[D / 16][4], const bf16* k_s,
                                       int lane) {
#pragma unroll
    for (int nb = 0; nb < N / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
    const int mi = lane / 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int nb = 0; nb < N / 8; nb += 2) {
            // matrices: keys nb*8.. x dims kk*16.., +8 dims, then keys (nb+1)*8.. x the same dims
            uint32_t b[4];
            ldmatrix_x4(b, &k_s[(nb * 8 + (mi / 2) * 8 + lane % 8) * LD + kk * 16 + (mi % 2) * 8]);
            mma_bf16(s[nb], qf[kk], b[0], b[1]);
            mma_bf16(s[nb + 1], qf[kk], b[2], b[3]);
        }
    }
}

// The same with Q as rows [16][LD] of shared memory, its A fragments loaded per 16 dims as they are used (4 registers
// live instead of D / 4).
template <int D, int N, int LD>
__device__ __forceinline__ void mma_qk_shared_q(float (&s)[N / 8][4], const bf16* q_s, const bf16* k_s, int lane) {
#pragma unroll
    for (int nb = 0; nb < N / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
    const int mi = lane / 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, &q_s[(lane % 16) * LD + kk * 16 + (lane / 16) * 8]);
#pragma unroll
        for (int nb = 0; nb < N / 8; nb += 2) {
            uint32_t b[4];
            ldmatrix_x4(b, &k_s[(nb * 8 + (mi / 2) * 8 + lane % 8) * LD + kk * 16 + (mi % 2) * 8]);
            mma_bf16(s[nb], a, b[0], b[1]);
            mma_bf16(s[nb + 1], a, b[2], b[3]);
        }
    }
}

// O += P V over 16 keys: p is P as an A fragment (mma_qk's accumulator layout packed to bf16 is exactly that), v_s the
// 16 value rows [16][LD] in shared memory, read transposed by ldmatrix.
template <int D, int LD>
__device__ __forceinline__ void mma_pv(float (&o)[D / 8][4], const uint32_t (&p)[4], const bf16* v_s, int lane) {
    const int mi = lane / 8;
#pragma unroll
    for (int nd = 0; nd < D / 8; nd += 2) {
        // matrices: keys 0.. x dims nd*8.., keys 8.., then dims (nd+1)*8.. for both key halves
        uint32_t b[4];
        ldmatrix_x4_trans(b, &v_s[((mi % 2) * 8 + lane % 8) * LD + (nd + mi / 2) * 8]);
        mma_bf16(o[nd], p, b[0], b[1]);
        mma_bf16(o[nd + 1], p, b[2], b[3]);
    }
}

// Attention-logit soft-capping (Gemma 2) of mma_qk's raw scores: s <- tanh(s * in_scale), with in_scale = the
// softmax scale / cap; the caller then scores them with scale_log2 = cap * log2(e), so a key's score is
// cap * tanh(q.k * scale / cap). Only the 2 * HALVES accumulator entries of the rows in use are computed.
template <int N, int HALVES>
__device__ __forceinline__ void soft_cap_scores(float (&s)[N / 8][4], float in_scale) {
#pragma unroll
    for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 2 * HALVES; ++e) s[nb][e] = tanhf(s[nb][e] * in_scale);
}

// Keys per step of attention_prefill's online softmax: 64, or 32 for D > 128, so that its K and V tiles stay under the
// 48 KB of static shared memory (D 256: 2 x 32 x 264 x 2 bytes = 33 KB) and the scores of a step fit in the registers
// beside Q and O. Batch-invariant attention_decode takes its softmax steps over the same keys, so that a row adds up
// the same tiles in the same order in both kernels.
__host__ __device__ constexpr int block_n(int D) { return D > 128 ? 32 : 64; }

// One key tile of the online softmax (FlashAttention-2, log2 domain) for the rows of a warp's 16-row tile that this
// thread holds: row lane / 4 for half 0 and row lane / 4 + 8 for half 1 (HALVES is 1 when rows 8-15 are unused).
// s holds mma_qk's raw scores of the N keys from tile0 (this thread's: tile0 + nb * 8 + 2 * (lane % 4) + (0, 1));
// on return it holds their unnormalized probabilities 2^(s * scale_log2 - m), 0 for the keys a row does not see
// (outside key_begin[half] .. key_end[half] - 1: one unsigned compare per key, as a bare upper bound costs). m
// (running row max), l (this lane's share of the running row sum; the caller sums the quad at the end) and the
// output accumulator o are rescaled to the new max. Unless EMPTY_ROWS, every row must see a key of the first tile,
// so m stays finite; with EMPTY_ROWS a row may see none of a tile's keys before its first one (a sliding window
// starting past the tile), at the cost of a select per row and tile.
template <int N, int D, int HALVES, bool EMPTY_ROWS = false>
__device__ __forceinline__ void online_softmax(float (&s)[N / 8][4], float (&m)[HALVES], float (&l)[HALVES],
                                               float (&o)[D / 8][4], int tile0, int lane, float scale_log2,
                                               const int (&key_begin)[HALVES], const int (&key_end)[HALVES]) {
    int first[HALVES];  // the tile's first key relative to each row's first visible key
    unsigned visible[HALVES];  // how many keys each row sees
#pragma unroll
    for (int h = 0; h < HALVES; ++h) first[h] = tile0 - key_begin[h], visible[h] = key_end[h] - key_begin[h];
    float row_max[HALVES], alpha[HALVES], shift[HALVES];  // shift: the max the probabilities are taken from
#pragma unroll
    for (int h = 0; h < HALVES; ++h) row_max[h] = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 2 * HALVES; ++e) {  // element e of an accumulator: half e / 2, key + e % 2
            const unsigned key = first[e / 2] + nb * 8 + (lane % 4) * 2 + e % 2;  // wraps below key_begin
            const float v = key < visible[e / 2] ? s[nb][e] * scale_log2 : -INFINITY;
            s[nb][e] = v;
            row_max[e / 2] = fmaxf(row_max[e / 2], v);
        }
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        // a row's keys live in the 4 lanes of a quad
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
        const float m_new = fmaxf(m[h], row_max[h]);
        shift[h] = EMPTY_ROWS && m_new == -INFINITY ? 0.f : m_new;  // no key yet: p = 0 below, l and o stay 0
        alpha[h] = exp2f(m[h] - shift[h]);
        m[h] = m_new;
        l[h] *= alpha[h];
    }
#pragma unroll
    for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 2 * HALVES; ++e) {
            s[nb][e] = exp2f(s[nb][e] - shift[e / 2]);
            l[e / 2] += s[nb][e];
        }
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
        o[nd][0] *= alpha[0];
        o[nd][1] *= alpha[0];
        if (HALVES == 2) {
            o[nd][2] *= alpha[HALVES - 1];
            o[nd][3] *= alpha[HALVES - 1];
        }
    }
}

// Batch-invariant attention cuts a row's keys into chunks of INV_CHUNK keys from key 0 (a multiple of block_n(D)
// for every D): each chunk's online softmax starts afresh, and the chunks' states fold into the row's running state
// in the chunks' order by these functions alone, whether a warp folds them as it goes (attention_prefill's _inv
// kernels, attention_decode's in one part) or attention_combine_inv folds the chunk states the parts wrote. The
// explicitly rounded operations keep the compiler from contracting them differently in different kernels, so the
// bits of a row depend on its own keys only. A chunk folded into an empty state (M -infinity, L 0, O 0) is copied
// exactly (weights 0 and 1), so a row of one chunk gets the bits it would without the fold.

// The weights of the running state (x) and of a chunk's (y) for a chunk of row max m and row sum l > 0 (the
// quad's whole sum); updates the running max M and sum L.
__device__ __forceinline__ float2 chunk_weights(float& M, float& L, float m, float l) {
    const float m_new = fmaxf(M, m);
    const float2 w = make_float2(exp2f(M - m_new), exp2f(m - m_new));
    L = __fmaf_rn(l, w.y, __fmul_rn(L, w.x));
    M = m_new;
    return w;
}

// One output entry of the running state O folded with the chunk's unnormalized o.
__device__ __forceinline__ float fold_entry(float O, float o, float2 w) { return __fmaf_rn(o, w.y, __fmul_rn(O, w.x)); }

// A thread's rows of a warp's 16-row tile (as online_softmax holds them): the chunk's state (m, l: this lane's share,
// o) folded into the running state (M, L: the row's whole sum, O), then reset to empty for the next chunk. A row
// that saw no key of the chunk (l 0) leaves the running state as it was.
template <int D, int HALVES>
__device__ __forceinline__ void fold_chunk(float (&M)[HALVES], float (&L)[HALVES], float (&O)[D / 8][2 * HALVES],
                                           float (&m)[HALVES], float (&l)[HALVES], float (&o)[D / 8][4]) {
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        float sum = l[h] + __shfl_xor_sync(0xffffffffu, l[h], 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (sum > 0.f) {
            const float2 w = chunk_weights(M[h], L[h], m[h], sum);
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd) {
                O[nd][2 * h] = fold_entry(O[nd][2 * h], o[nd][2 * h], w);
                O[nd][2 * h + 1] = fold_entry(O[nd][2 * h + 1], o[nd][2 * h + 1], w);
            }
        }
        m[h] = -INFINITY, l[h] = 0.f;
    }
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
}
