// Sampling and logprobs on the GPU, so that only token ids (and the logprobs asked for) go back to the host.
// Twins: sampler.sample (with sampler.filtered_logits, sampler.gumbel_noise) and sampler.gather_logprobs.
//
// Top-k and top-p need the k-th largest probability and the probability at which the sorted cumulative mass
// reaches top_p. Both are "the largest threshold t such that the weight of the elements >= t reaches a target"
// (weight 1 for top-k, the probability in fixed point for top-p), found without sorting the 128k-entry row by a radix
// select: float bit patterns of non-negative values sort like the values, so 4 passes over the row, each building
// a 256-bin histogram of the next 8 bits among the elements that match the digits chosen so far, pin the threshold
// down exactly. 4 passes instead of the ~31 of a bisection, and exact where a bisection on values is not.
//
// A block reads its part of a row in passes of ROW_UNROLL loads per thread in flight (row_loop): a pass of one load
// per thread at a time would wait out one L2 round trip per 1,024 elements (~125 for a greedy token of a 128k
// vocabulary on one block; docs/PERFORMANCE.md, Decisions: "Small kernels keep their loads in flight together").
//
// A row is one block's (`sample`, `logprobs`), or, for a few rows, ROW_SPLIT blocks' (`sample_split`,
// `logprobs_split`): a thread-block cluster whose blocks each take a contiguous part of the row and combine their
// reductions and histograms through distributed shared memory, every block the same values in rank order. One block
// a row leaves the GPU's other SMs idle at batch 1 (a 128k-token row took 270 us of top-p on one SM); split, a pass
// has fewer loads per thread to wait for. The two orders of adding give other bits, so the batch-invariant mode
// keeps one block a row (ops.py chooses).
//
// Compiled with -DNTHREADS (threads per block), -DMAX_TOP_LOGPROBS (the most top logprobs per row) and -DROW_SPLIT
// (blocks per row when split), from backends/cuda/ops.py, which also launches the kernels.
#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

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

// This block's part of a row of n and, with SPLIT > 1, the cluster of the row's blocks: rank r takes the r-th of
// SPLIT contiguous parts; at(p, r) is p in block r's shared memory; sync() is the cluster's barrier.
template <int SPLIT>
struct RowPart {
    const float* x;  // the whole row
    int begin, end, rank;
    __device__ RowPart(const float* row, int n) : x(row) {
        rank = SPLIT == 1 ? 0 : (int)cg::this_cluster().block_rank();
        const int chunk = (n + SPLIT - 1) / SPLIT;
        begin = min(n, rank * chunk);
        end = min(n, begin + chunk);
    }
    __device__ void sync() const {
        if constexpr (SPLIT > 1) cg::this_cluster().sync();
    }
    template <class T>
    __device__ T* at(T* p, int r) const {
        if constexpr (SPLIT > 1) return cg::this_cluster().map_shared_rank(p, r);
        return p;
    }
};

// f(i, x[i]) for this thread's elements i = begin + threadIdx.x + j * blockDim.x of the part, ROW_UNROLL loads
// issued before the first call. x is written by the kernel before (PDL): plain loads, issued after the wait.
template <int SPLIT, class F>
__device__ __forceinline__ void row_loop(const RowPart<SPLIT>& part, F&& f) {
    for (int base = part.begin + threadIdx.x; base < part.end; base += blockDim.x * ROW_UNROLL) {
        float v[ROW_UNROLL];
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) {
            const int i = base + u * blockDim.x;
            if (i < part.end) asm volatile("ld.global.f32 %0, [%1];" : "=f"(v[u]) : "l"(part.x + i));
        }
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) {
            const int i = base + u * blockDim.x;
            if (i < part.end) f(i, v[u]);
        }
    }
}

// The row's shared memory for its reductions.
struct RowScratch {
    float v[32];
    int i[32];
    float part_v;  // this block's share, read by the row's other blocks
    int part_i;
};

// Op over the whole row, returned to every thread of its blocks: each block's, then the blocks' in rank order.
template <class Op, int SPLIT>
__device__ float row_reduce(const RowPart<SPLIT>& part, float v, RowScratch& s) {
    v = block_reduce<Op>(v, s.v);
    if constexpr (SPLIT > 1) {
        if (threadIdx.x == 0) s.part_v = v;
        part.sync();
        v = Op::identity();
#pragma unroll
        for (int r = 0; r < SPLIT; ++r) v = Op::apply(v, *part.at(&s.part_v, r));
        part.sync();  // every block has read the shares before any writes its next
    }
    return v;
}

// Block-wide argmax; ties go to the smallest index, as numpy's argmax. Every thread gets the index.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// The block's (v, i) argmax, to every thread.
__device__ void block_argmax(float& v, int& i, RowScratch& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    __syncthreads();
    if (lane == 0) {
        s.v[warp] = v;
        s.i[warp] = i;
    }
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? s.v[lane] : -INFINITY;
    i = lane < (int)(blockDim.x >> 5) ? s.i[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
}

// The row's argmax index, to every thread of its blocks.
template <int SPLIT>
__device__ int row_argmax(const RowPart<SPLIT>& part, float v, int i, RowScratch& s) {
    block_argmax(v, i, s);
    if constexpr (SPLIT > 1) {
        if (threadIdx.x == 0) {
            s.part_v = v;
            s.part_i = i;
        }
        part.sync();
#pragma unroll
        for (int r = 0; r < SPLIT; ++r) argmax_merge(v, i, *part.at(&s.part_v, r), *part.at(&s.part_i, r));
        part.sync();
    }
    return i;
}

// A histogram's 256 bins, once per lane index: the high digits of a row's keys fall in a few bins (logits and
// probabilities share their sign and most of their exponent bits), and atomics of one shared bin queue one behind
// another: with one copy, a pass of 4 over a 49,152-token row took ~100 us (bench/sampling.py). Lane l adds into
// copy l, whose bins start 257 words apart, so a warp's 32 atomics hit 32 addresses, mostly in different banks.
constexpr int HIST_COPIES = 32, HIST_STRIDE = 257;

// Weights are integers, so that a histogram's sums are exact whatever order its atomics land in (warps sharing a
// copy add in the order they get there): the same row gives the same threshold in any batch and any run. Top-k and
// the logprobs count tokens (weight 1); top-p weighs a token by its probability in fixed point, q * 2^31 rounded
// (sampler.MASS_SCALE; a row's total stays below 2^32: sum q = 1 up to rounding, plus half a unit a token).
constexpr float MASS_SCALE = 2147483648.f;

// The radix select's shared memory: the per-lane histograms (copy 0 ends up holding the block's sums), the row's
// bins summed over its blocks (SPLIT > 1), and pick_digit's result: the digit chosen, the weight above it, the
// target, the digit's own weight (after the last pass: the weight above the key found, and at it).
struct RadixScratch {
    uint32_t hist[HIST_COPIES * HIST_STRIDE];
    uint32_t merged[256];
    uint32_t result[4];
};

// Warp 0: the highest digit of `bins` at which `above` plus the weight of the digits from 255 down to it reaches
// `target` (digit 0 if it is out of reach), into result: the digit, the weight above it, the target and the
// digit's weight. With `fraction` > 0 the target is instead ceil(fraction x the bins' total): on the first pass,
// which bins every weight, that fraction of the row's total weight.
__device__ void pick_digit(const uint32_t* bins, uint32_t above, uint32_t target, float fraction, uint32_t* result) {
    const int lane = threadIdx.x;
    uint32_t c[8], total = 0;  // this lane's digits: 255 - 8 lane - j, j = 0..7 (descending)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        c[j] = bins[255 - 8 * lane - j];
        total += c[j];
    }
    uint32_t incl = total;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (fraction > 0.f)
        target = (uint32_t)ceil((double)fraction * (double)__shfl_sync(0xffffffffu, incl, 31));
    uint32_t run = above + incl - total, before = 0, at = 0;
    int hit = -1;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (hit < 0 && run + c[j] >= target) {
            hit = j;
            before = run;
            at = c[j];
        }
        run += c[j];
    }
    const uint32_t ballot = __ballot_sync(0xffffffffu, hit >= 0);
    if (lane == 0) result[2] = target;
    if (ballot == 0 && lane == 31) {  // digit 0 (lane 31's last)
        result[0] = 0;
        result[1] = above;
        result[3] = c[7];
    } else if (ballot != 0 && lane == __ffs(ballot) - 1) {
        result[0] = 255 - 8 * lane - hit;
        result[1] = before;
        result[3] = at;
    }
}

// Radix select: the largest key t such that the total weight of the row's elements with key >= t reaches `target`
// (fraction > 0: ceil(fraction x the row's total weight); pick_digit). F gives key(i, v) (uint32) and weight(i, v)
// (uint32, > 0 to count) of element i, of logit v. Per 8-bit digit, high first: a histogram of weights by digit
// among the elements matching the chosen prefix (per lane index, the copies summed into copy 0; with SPLIT > 1 the
// blocks' copy 0 summed), from which warp 0 picks the digit. Every block of the row picks the same.
template <class F, int SPLIT>
__device__ uint32_t radix_select(const F& f, const RowPart<SPLIT>& part, uint32_t target, float fraction,
                                 RadixScratch& s) {
    uint32_t prefix = 0, above = 0;
    uint32_t* mine = s.hist + (threadIdx.x & 31) * HIST_STRIDE;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t hi_mask = shift == 24 ? 0u : ~0u << (shift + 8);
        for (int d = threadIdx.x; d < HIST_COPIES * HIST_STRIDE; d += blockDim.x) s.hist[d] = 0;
        __syncthreads();
        row_loop(part, [&](int i, float v) {
            const uint32_t k = f.key(i, v);
            if ((k & hi_mask) == prefix) {
                const uint32_t w = f.weight(i, v);
                if (w > 0) atomicAdd(&mine[(k >> shift) & 255], w);
            }
        });
        __syncthreads();
        for (int d = threadIdx.x; d < 256; d += blockDim.x) {  // bin d of every copy, into copy 0's
            uint32_t sum = 0;
#pragma unroll 8
            for (int c = 0; c < HIST_COPIES; ++c) sum += s.hist[c * HIST_STRIDE + d];
            s.hist[d] = sum;
        }
        const uint32_t* bins = s.hist;
        if constexpr (SPLIT > 1) {
            part.sync();
            for (int d = threadIdx.x; d < 256; d += blockDim.x) {
                uint32_t sum = 0;
#pragma unroll
                for (int r = 0; r < SPLIT; ++r) sum += part.at(s.hist, r)[d];
                s.merged[d] = sum;
            }
            part.sync();  // every block has read the others' bins before any clears its own
            bins = s.merged;
        } else {
            __syncthreads();
        }
        if (threadIdx.x < 32) pick_digit(bins, above, target, shift == 24 ? fraction : 0.f, s.result);
        __syncthreads();
        prefix |= s.result[0] << shift;
        above = s.result[1];
        target = s.result[2];
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
    __device__ uint32_t key(int, float v) const { return __float_as_uint(p(v)); }
    __device__ uint32_t weight(int, float) const { return 1; }
};

struct TopPWeights {  // the probability mass of the tokens that survived top-k (p >= cutoff)
    Probs p;
    float cutoff;
    __device__ uint32_t key(int, float v) const { return __float_as_uint(p(v)); }
    __device__ uint32_t weight(int, float v) const {
        const float q = p(v);
        return q >= cutoff ? __float2uint_rn(q * MASS_SCALE) : 0;
    }
};

// One token per row: argmax when temperature == 0; otherwise keep the tokens with p >= max(k-th largest p (top-k),
// top-p threshold, min_p * max p) and take argmax(x / T + gumbel(noise_keys[row], token)) over them. Every pass
// re-reads the row (L2-resident for small batches).
template <int SPLIT>
__device__ void sample_row(int* out, const float* logits, int vocab, const float* temperature, const float* top_p,
                           const int* top_k, const float* min_p, const uint32_t* noise_keys) {
    pdl_begin();
    __shared__ RowScratch scratch;
    __shared__ RadixScratch radix;
    const int row = blockIdx.x / SPLIT;
    const RowPart<SPLIT> part(logits + (int64_t)row * vocab, vocab);
    const float t = temperature[row];
    if (!(t > 0.f)) {
        float best = -INFINITY;
        int best_i = 0x7fffffff;
        row_loop(part, [&](int i, float v) { argmax_merge(best, best_i, v, i); });
        best_i = row_argmax(part, best, best_i, scratch);
        if (threadIdx.x == 0 && part.rank == 0) out[row] = best_i;
        return;
    }
    Probs p{t, -INFINITY, 0.f};
    float m = -INFINITY;
    row_loop(part, [&](int, float v) { m = fmaxf(m, p.scaled(v)); });
    p.max = row_reduce<Max>(part, m, scratch);
    float z = 0.f;
    row_loop(part, [&](int, float v) { z += expf(p.scaled(v) - p.max); });
    p.log_z = logf(row_reduce<Sum>(part, z, scratch));

    float threshold = 0.f;
    const int k = top_k[row];
    if (k > 0 && k < vocab) threshold = __uint_as_float(radix_select(TopKWeights{p}, part, k, 0.f, radix));
    if (top_p[row] < 1.f)  // the mass that reaches top_p of the top-k survivors' (pick_digit's fraction)
        threshold = fmaxf(threshold,
                          __uint_as_float(radix_select(TopPWeights{p, threshold}, part, 0, top_p[row], radix)));
    if (min_p[row] > 0.f) threshold = fmaxf(threshold, min_p[row] * expf(-p.log_z));

    const uint32_t key = noise_keys[row];
    float best = -INFINITY;
    int best_i = 0x7fffffff;
    row_loop(part, [&](int i, float v) {
        if (p(v) >= threshold) argmax_merge(best, best_i, p.scaled(v) + gumbel(key, i), i);
    });
    best_i = row_argmax(part, best, best_i, scratch);
    if (threadIdx.x == 0 && part.rank == 0) out[row] = best_i;
}

// Launch: grid (S), block NTHREADS: a block a row.
#if KEEPS(sample)
extern "C" __global__ void __launch_bounds__(NTHREADS)
    sample(int* __restrict__ out, const float* __restrict__ logits, int vocab, const float* __restrict__ temperature,
           const float* __restrict__ top_p, const int* __restrict__ top_k, const float* __restrict__ min_p,
           const uint32_t* __restrict__ noise_keys) {
    sample_row<1>(out, logits, vocab, temperature, top_p, top_k, min_p, noise_keys);
}
#endif

// Launch: grid (S * ROW_SPLIT), block NTHREADS: a cluster of ROW_SPLIT blocks a row.
#if KEEPS(sample_split)
extern "C" __global__ void __cluster_dims__(ROW_SPLIT, 1, 1) __launch_bounds__(NTHREADS)
    sample_split(int* __restrict__ out, const float* __restrict__ logits, int vocab,
                 const float* __restrict__ temperature, const float* __restrict__ top_p, const int* __restrict__ top_k,
                 const float* __restrict__ min_p, const uint32_t* __restrict__ noise_keys) {
    sample_row<ROW_SPLIT>(out, logits, vocab, temperature, top_p, top_k, min_p, noise_keys);
}
#endif

// float -> uint32 with the same order (negatives flipped below the positives).
__device__ __forceinline__ uint32_t ordered_key(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct LogitKeys {  // count the tokens, keyed by logit
    __device__ uint32_t key(int, float v) const { return ordered_key(v); }
    __device__ uint32_t weight(int, float) const { return 1; }
};

struct TiedIds {  // count the tokens whose logit's key is `kth`, keyed so that smaller ids come first
    uint32_t kth;
    __device__ uint32_t key(int i, float) const { return ~(uint32_t)i; }
    __device__ uint32_t weight(int, float v) const { return ordered_key(v) == kth ? 1 : 0; }
};

// The top-k candidates a block found in its part: ids above the k-th largest key (fewer than k in the whole row),
// and up to k ids at it.
struct TopCandidates {
    int above[MAX_TOP_LOGPROBS], ties[MAX_TOP_LOGPROBS], num_above, num_ties;
};

// Thread 0 of the row's first block: the row's k ids, from every block's candidates in rank order (those above the
// k-th key, then ties until k), sorted by descending logit, then ascending id.
template <int SPLIT>
__device__ void top_ids_of(const RowPart<SPLIT>& part, TopCandidates& c, int k, int* ids) {
    int n = 0;
    for (int r = 0; r < SPLIT; ++r) {
        const TopCandidates& other = *part.at(&c, r);
        for (int j = 0; j < other.num_above; ++j) ids[n++] = other.above[j];
    }
    for (int r = 0; r < SPLIT && n < k; ++r) {
        const TopCandidates& other = *part.at(&c, r);
        for (int j = 0; j < min(other.num_ties, k) && n < k; ++j) ids[n++] = other.ties[j];
    }
    const float* x = part.x;
    for (int a = 1; a < k; ++a) {  // insertion sort
        const int id = ids[a];
        int b = a - 1;
        while (b >= 0 && (x[ids[b]] < x[id] || (x[ids[b]] == x[id] && ids[b] > id))) {
            ids[b + 1] = ids[b];
            --b;
        }
        ids[b + 1] = id;
    }
}

// Log-softmax of the raw logits: token_lp[row] = logprob of token_ids[row]; top_ids / top_lp [N, k] the k most
// likely tokens, by descending logit, then ascending id; of the tokens tied at the k-th largest logit, those of the
// smallest ids (sampler.top_logprob_ids). k <= MAX_TOP_LOGPROBS. Row rows[b] (rows null: row b) is the b-th row's
// (block's, or cluster's), so that a step computes the rows that ask for logprobs alone; the others' outputs are left
// as they were. The k-th largest logit comes from the radix select, with the counts above and at it; where more
// tokens tie at it than the k needs, a second select over the tied ones finds the largest id to take. The (fewer
// than k) larger ones and the ties taken are gathered in shared memory and sorted by one thread (top_ids_of).
template <int SPLIT>
__device__ void logprobs_row(float* token_lp, int* top_ids, float* top_lp, const float* logits, const int* token_ids,
                             const int* rows, int vocab, int k) {
    pdl_begin();
    __shared__ RowScratch scratch;
    __shared__ RadixScratch radix;
    __shared__ TopCandidates candidates;
    __shared__ int ids[MAX_TOP_LOGPROBS];
    const int row = rows != nullptr ? rows[blockIdx.x / SPLIT] : blockIdx.x / SPLIT;
    const RowPart<SPLIT> part(logits + (int64_t)row * vocab, vocab);
    const bool first = threadIdx.x == 0 && part.rank == 0;
    float m = -INFINITY;
    row_loop(part, [&](int, float v) { m = fmaxf(m, v); });
    m = row_reduce<Max>(part, m, scratch);
    float z = 0.f;
    row_loop(part, [&](int, float v) { z += expf(v - m); });
    const float log_z = logf(row_reduce<Sum>(part, z, scratch));
    if (first) token_lp[row] = (part.x[token_ids[row]] - m) - log_z;
    if (k == 0) return;

    if (threadIdx.x == 0) candidates.num_above = candidates.num_ties = 0;
    const uint32_t kth = radix_select(LogitKeys{}, part, k, 0.f, radix);  // (its barriers order the line above)
    const uint32_t above = radix.result[1], tied = radix.result[3];      // (the next select's barriers: read first)
    const uint32_t last_id = above + tied > (uint32_t)k ? ~radix_select(TiedIds{kth}, part, k - above, 0.f, radix)
                                                        : 0xffffffffu;
    row_loop(part, [&](int i, float v) {
        const uint32_t key = ordered_key(v);
        if (key > kth) {
            candidates.above[atomicAdd(&candidates.num_above, 1)] = i;  // fewer than k by the choice of kth
        } else if (key == kth && (uint32_t)i <= last_id) {  // k - above ties in all
            const int slot = atomicAdd(&candidates.num_ties, 1);
            if (slot < k) candidates.ties[slot] = i;
        }
    });
    if constexpr (SPLIT > 1) part.sync();  // every block's candidates are in
    else __syncthreads();
    if (first) {
        top_ids_of(part, candidates, k, ids);
        for (int j = 0; j < k; ++j) {
            top_ids[(int64_t)row * k + j] = ids[j];
            top_lp[(int64_t)row * k + j] = (part.x[ids[j]] - m) - log_z;
        }
    }
    part.sync();  // the first block has read the others' candidates before they exit
}

// Launch: grid (R), block NTHREADS: a block a row.
#if KEEPS(logprobs)
extern "C" __global__ void __launch_bounds__(NTHREADS)
    logprobs(float* __restrict__ token_lp, int* __restrict__ top_ids, float* __restrict__ top_lp,
             const float* __restrict__ logits, const int* __restrict__ token_ids, const int* __restrict__ rows,
             int vocab, int k) {
    logprobs_row<1>(token_lp, top_ids, top_lp, logits, token_ids, rows, vocab, k);
}
#endif

// Launch: grid (R * ROW_SPLIT), block NTHREADS: a cluster of ROW_SPLIT blocks a row.
#if KEEPS(logprobs_split)
extern "C" __global__ void __cluster_dims__(ROW_SPLIT, 1, 1) __launch_bounds__(NTHREADS)
    logprobs_split(float* __restrict__ token_lp, int* __restrict__ top_ids, float* __restrict__ top_lp,
                   const float* __restrict__ logits, const int* __restrict__ token_ids, const int* __restrict__ rows,
                   int vocab, int k) {
    logprobs_row<ROW_SPLIT>(token_lp, top_ids, top_lp, logits, token_ids, rows, vocab, k);
}
#endif
