// Sampling and logprobs on the GPU, so that only token ids (and the logprobs asked for) go back to the host.
// Twins: sampler.sample (with sampler.filtered_logits, sampler.gumbel_noise) and sampler.gather_logprobs.
//
// Top-k and top-p need the k-th largest probability and the probability at which the sorted cumulative mass
// reaches top_p. Both are "the largest threshold t such that the weight of the elements >= t reaches a target"
// (weight 1 for top-k, the probability itself for top-p), found without sorting the 128k-entry row by a radix
// select: float bit patterns of non-negative values sort like the values, so 4 passes over the row, each building
// a 256-bin histogram of the next 8 bits among the elements that match the digits chosen so far, pin the threshold
// down exactly. 4 passes instead of the ~31 of a bisection, and exact where a bisection on values is not.
//
// A block reads its row in passes of ROW_UNROLL loads per thread in flight (row_loop): at batch 1 one block is all
// there is, and a pass of one load per thread at a time would wait out ~125 L2 round trips for a greedy token of a
// 128k vocabulary (docs/PERFORMANCE.md, Decisions: "Small kernels keep their loads in flight together").
//
// Compiled with -DNTHREADS (threads per block: one block per row) and -DMAX_TOP_LOGPROBS (the most top logprobs per
// row), from backends/cuda/ops.py, which also launches the kernels.
#include "common.cuh"

// MurmurHash3's finalizer (sampler.mix32).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    x ^= x >> 16;
    return x;
}

// Gumbel(0, 1) noise of (row key, token), bit for bit the float32 arithmetic of sampler.gumbel_noise.
__device__ __forceinline__ float gumbel(uint32_t key, int token) {
    // 23 bits: (bits + 0.5) / 2^23 is exact in float32 and stays below 1 (24 bits would round up to 1.0).
    const uint32_t bits = mix32(key ^ mix32((uint32_t)token)) >> 9;
    const float u = ((float)bits + 0.5f) * (1.f / 8388608.f);
    return -logf(-logf(u));
}

constexpr int ROW_UNROLL = 8;  // loads of the row each thread has in flight (16 spill registers at 1024 threads)

// f(i, x[i]) for this thread's elements i = threadIdx.x + j * blockDim.x of the row x[0, n), ROW_UNROLL loads
// issued before the first call. x is written by the kernel before (PDL): plain loads, issued after the wait.
template <class F>
__device__ __forceinline__ void row_loop(const float* x, int n, F&& f) {
    for (int base = threadIdx.x; base < n; base += blockDim.x * ROW_UNROLL) {
        float v[ROW_UNROLL];
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) {
            const int i = base + u * blockDim.x;
            if (i < n) asm volatile("ld.global.f32 %0, [%1];" : "=f"(v[u]) : "l"(x + i));
        }
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) {
            const int i = base + u * blockDim.x;
            if (i < n) f(i, v[u]);
        }
    }
}

// Block-wide argmax; ties go to the smallest index, as numpy's argmax. Every thread gets the index.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

__device__ int block_argmax(float v, int i, float* scratch, int* scratch_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
        scratch_i[warp] = i;
    }
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : -INFINITY;
    i = lane < (int)(blockDim.x >> 5) ? scratch_i[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    return i;
}

// A histogram's 256 bins, once per lane index: the high digits of a row's keys fall in a few bins (logits and
// probabilities share their sign and most of their exponent bits), and atomics of one shared bin queue one behind
// another: with one copy, a pass of 4 over a 49,152-token row took ~100 us (bench/sampling.py). Lane l adds into
// copy l, whose bins start 257 words apart, so a warp's 32 atomics hit 32 addresses, mostly in different banks.
constexpr int HIST_COPIES = 32, HIST_STRIDE = 257;

// Radix select: the largest key t such that the total weight of the elements with key >= t reaches `target`.
// F gives key(v) (uint32, ordered like the values) and weight(v) (> 0 to count) of an element of the row x, from
// its logit v. Per 8-bit digit, high first: a histogram of weights by digit among the elements matching the chosen
// prefix (per lane index, then the copies summed in copy order into copy 0), then warp 0 scans the digits from 255
// down for the first at which `above` (the weight of elements above the prefix) plus the running sum reaches the
// target. If rounding keeps the target out of reach, digit 0 keeps the whole range.
// Shared memory: hist [HIST_COPIES * HIST_STRIDE], result [2].
template <class F>
__device__ uint32_t radix_select(const F& f, const float* x, int n, float target, float* hist, uint32_t* result) {
    uint32_t prefix = 0;
    float above = 0.f;
    float* mine = hist + (threadIdx.x & 31) * HIST_STRIDE;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t hi_mask = shift == 24 ? 0u : ~0u << (shift + 8);
        for (int d = threadIdx.x; d < HIST_COPIES * HIST_STRIDE; d += blockDim.x) hist[d] = 0.f;
        __syncthreads();
        row_loop(x, n, [&](int, float v) {
            const uint32_t k = f.key(v);
            if ((k & hi_mask) == prefix) {
                const float w = f.weight(v);
                if (w > 0.f) atomicAdd(&mine[(k >> shift) & 255], w);
            }
        });
        __syncthreads();
        for (int d = threadIdx.x; d < 256; d += blockDim.x) {  // bin d of every copy, into copy 0's
            float sum = 0.f;
#pragma unroll 8
            for (int c = 0; c < HIST_COPIES; ++c) sum += hist[c * HIST_STRIDE + d];
            hist[d] = sum;
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            float c[8], total = 0.f;  // this lane's digits: 255 - 8 lane - j, j = 0..7 (descending)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = hist[255 - 8 * lane - j];
                total += c[j];
            }
            float incl = total;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            float run = above + incl - total, before = 0.f;
            int hit = -1;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (hit < 0 && run + c[j] >= target) {
                    hit = j;
                    before = run;
                }
                run += c[j];
            }
            const uint32_t ballot = __ballot_sync(0xffffffffu, hit >= 0);
            if (ballot == 0 && lane == 0) {
                result[0] = 0;
                result[1] = __float_as_uint(above);
            } else if (ballot != 0 && lane == __ffs(ballot) - 1) {
                result[0] = 255 - 8 * lane - hit;
                result[1] = __float_as_uint(before);
            }
        }
        __syncthreads();
        prefix |= result[0] << shift;
        above = __uint_as_float(result[1]);
    }
    return prefix;
}

// The temperature-scaled distribution of one row, computed as sampler.filtered_logits does:
// p_i = exp((x_i / T - max) - log(sum exp(x_j / T - max))).
struct Probs {  // of a logit v
    float temperature, max, log_z;
    __device__ float scaled(float v) const { return v / temperature; }
    __device__ float operator()(float v) const { return expf((scaled(v) - max) - log_z); }
};

struct TopKWeights {  // count the tokens, keyed by probability
    Probs p;
    __device__ uint32_t key(float v) const { return __float_as_uint(p(v)); }
    __device__ float weight(float) const { return 1.f; }
};

struct TopPWeights {  // the probability mass of the tokens that survived top-k (p >= cutoff)
    Probs p;
    float cutoff;
    __device__ uint32_t key(float v) const { return __float_as_uint(p(v)); }
    __device__ float weight(float v) const {
        const float q = p(v);
        return q >= cutoff ? q : 0.f;
    }
};

// One token per row: argmax when temperature == 0; otherwise keep the tokens with p >= max(k-th largest p (top-k),
// top-p threshold, min_p * max p) and take argmax(x / T + gumbel(noise_keys[row], token)) over them.
// Launch: grid (S), block NTHREADS: one row per block; every pass re-reads the row (L2-resident for small batches).
#if KEEPS(sample)
extern "C" __global__ void __launch_bounds__(NTHREADS)
    sample(int* __restrict__ out, const float* __restrict__ logits, int vocab, const float* __restrict__ temperature,
           const float* __restrict__ top_p, const int* __restrict__ top_k, const float* __restrict__ min_p,
           const uint32_t* __restrict__ noise_keys) {
    pdl_begin();
    __shared__ float scratch[32], hist[HIST_COPIES * HIST_STRIDE];
    __shared__ int scratch_i[32];
    __shared__ uint32_t result[2];
    const int row = blockIdx.x;
    const float* x = logits + (int64_t)row * vocab;
    const float t = temperature[row];
    if (!(t > 0.f)) {
        float best = -INFINITY;
        int best_i = 0x7fffffff;
        row_loop(x, vocab, [&](int i, float v) { argmax_merge(best, best_i, v, i); });
        best_i = block_argmax(best, best_i, scratch, scratch_i);
        if (threadIdx.x == 0) out[row] = best_i;
        return;
    }
    Probs p{t, -INFINITY, 0.f};
    float m = -INFINITY;
    row_loop(x, vocab, [&](int, float v) { m = fmaxf(m, p.scaled(v)); });
    p.max = block_reduce<Max>(m, scratch);
    float z = 0.f;
    row_loop(x, vocab, [&](int, float v) { z += expf(p.scaled(v) - p.max); });
    p.log_z = logf(block_reduce<Sum>(z, scratch));

    float threshold = 0.f;
    const int k = top_k[row];
    if (k > 0 && k < vocab)
        threshold = __uint_as_float(radix_select(TopKWeights{p}, x, vocab, (float)k, hist, result));
    if (top_p[row] < 1.f) {
        float mass = 0.f;
        row_loop(x, vocab, [&](int, float v) {
            const float q = p(v);
            mass += q >= threshold ? q : 0.f;
        });
        const float target = top_p[row] * block_reduce<Sum>(mass, scratch);
        threshold = fmaxf(threshold,
                          __uint_as_float(radix_select(TopPWeights{p, threshold}, x, vocab, target, hist, result)));
    }
    if (min_p[row] > 0.f) threshold = fmaxf(threshold, min_p[row] * expf(-p.log_z));

    const uint32_t key = noise_keys[row];
    float best = -INFINITY;
    int best_i = 0x7fffffff;
    row_loop(x, vocab, [&](int i, float v) {
        if (p(v) >= threshold) argmax_merge(best, best_i, p.scaled(v) + gumbel(key, i), i);
    });
    best_i = block_argmax(best, best_i, scratch, scratch_i);
    if (threadIdx.x == 0) out[row] = best_i;
}
#endif

// float -> uint32 with the same order (negatives flipped below the positives).
__device__ __forceinline__ uint32_t ordered_key(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct LogitKeys {  // count the tokens, keyed by logit
    __device__ uint32_t key(float v) const { return ordered_key(v); }
    __device__ float weight(float) const { return 1.f; }
};

// Log-softmax of the raw logits: token_lp[row] = logprob of token_ids[row]; top_ids / top_lp [N, k] the k most
// likely tokens in descending order (ties at the k-th value broken arbitrarily, as argpartition does).
// Launch: grid (R), block NTHREADS; k <= MAX_TOP_LOGPROBS. Block b takes row rows[b] (rows null: row b), so that a
// step computes the rows that ask for logprobs alone; the others' outputs are left as they were. The k-th largest
// logit comes from the radix select; the (fewer than k) larger ones and enough ties are gathered in shared memory
// and sorted by one thread.
#if KEEPS(logprobs)
extern "C" __global__ void __launch_bounds__(NTHREADS)
    logprobs(float* __restrict__ token_lp, int* __restrict__ top_ids, float* __restrict__ top_lp,
             const float* __restrict__ logits, const int* __restrict__ token_ids, const int* __restrict__ rows,
             int vocab, int k) {
    pdl_begin();
    __shared__ float scratch[32], hist[HIST_COPIES * HIST_STRIDE];
    __shared__ uint32_t result[2];
    __shared__ int ids_s[MAX_TOP_LOGPROBS], ties_s[MAX_TOP_LOGPROBS], count_s[2];
    const int row = rows != nullptr ? rows[blockIdx.x] : blockIdx.x;
    const float* x = logits + (int64_t)row * vocab;
    float m = -INFINITY;
    row_loop(x, vocab, [&](int, float v) { m = fmaxf(m, v); });
    m = block_reduce<Max>(m, scratch);
    float z = 0.f;
    row_loop(x, vocab, [&](int, float v) { z += expf(v - m); });
    const float log_z = logf(block_reduce<Sum>(z, scratch));
    if (threadIdx.x == 0) {
        token_lp[row] = (x[token_ids[row]] - m) - log_z;
        count_s[0] = count_s[1] = 0;
    }
    if (k == 0) return;

    const uint32_t kth = radix_select(LogitKeys{}, x, vocab, (float)k, hist, result);
    row_loop(x, vocab, [&](int i, float v) {
        const uint32_t key = ordered_key(v);
        if (key > kth) {
            ids_s[atomicAdd(&count_s[0], 1)] = i;  // fewer than k by the choice of kth
        } else if (key == kth) {
            const int slot = atomicAdd(&count_s[1], 1);
            if (slot < k) ties_s[slot] = i;
        }
    });
    __syncthreads();
    if (threadIdx.x == 0) {
        int n = count_s[0];
        for (int j = 0; n < k; ++j) ids_s[n++] = ties_s[j];
        for (int a = 1; a < k; ++a) {  // insertion sort, descending logit, then ascending id
            const int id = ids_s[a];
            int b = a - 1;
            while (b >= 0 && (x[ids_s[b]] < x[id] || (x[ids_s[b]] == x[id] && ids_s[b] > id))) {
                ids_s[b + 1] = ids_s[b];
                --b;
            }
            ids_s[b + 1] = id;
        }
        for (int j = 0; j < k; ++j) {
            top_ids[(int64_t)row * k + j] = ids_s[j];
            top_lp[(int64_t)row * k + j] = (x[ids_s[j]] - m) - log_z;
        }
    }
}
#endif
