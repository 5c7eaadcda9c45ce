// Logits processors (vLLM's allowed_token_ids, logit_bias, bad_words, min_tokens and penalties), the token-count
// table the penalties read, and KV block copies for forked sequences (n > 1).
// Twins: sampler.apply_logits_processing, sampler.TokenCounts (init_slots, count), NumpyBackend.execute's copies.
//
// The token counts live here, on the device, so that the token the step in flight samples is counted by the GPU
// itself (count_tokens runs right after sample, in stream order) and the host never waits for it.
#include "common.cuh"

// Binary search of token in sorted ids[0, n).
__device__ __forceinline__ bool contains(const int* ids, int n, int token) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (ids[mid] < token) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && ids[lo] == token;
}

// Row i of logits [S, vocab], in place: 1. keep only allowed_ids[allowed_ptr[i]:allowed_ptr[i+1]] (an empty range
// keeps all); 2. for entries j in bias_ptr[i]:bias_ptr[i+1] of bias (int triples: token id, float bits of the bias,
// condition), add the bias to the token where the condition is -1 or the row's last input token: last_tokens[i],
// or sampled[last_src[i]] where last_src[i] >= 0 (a token the previous step sampled, not known to the host);
// 3. with penalty_slots[i] >= 0, from that slot's output counts c and prompt mask: x -= frequency * c + presence *
// (c > 0), then where c > 0 or in the prompt, x /= repetition if x > 0 else x *= repetition.
// Launch: grid (S), block 256. A row with nothing to do returns at once (rows of padding included).
extern "C" __global__ void apply_logits_processors(
    float* __restrict__ logits, int vocab, const int* __restrict__ last_tokens, const int* __restrict__ last_src,
    const int* __restrict__ sampled, const int* __restrict__ penalty_slots, const float* __restrict__ presence,
    const float* __restrict__ frequency, const float* __restrict__ repetition, const int* __restrict__ counts,
    const uint8_t* __restrict__ prompt_mask, const int* __restrict__ allowed_ptr, const int* __restrict__ allowed_ids,
    const int* __restrict__ bias_ptr, const int* __restrict__ bias) {
    pdl_begin();
    const int row = blockIdx.x;
    const int a0 = allowed_ptr[row], a1 = allowed_ptr[row + 1], b0 = bias_ptr[row], b1 = bias_ptr[row + 1];
    const int slot = penalty_slots[row];
    if (a0 == a1 && b0 == b1 && slot < 0) return;
    float* x = logits + (int64_t)row * vocab;
    if (a1 > a0)
        for (int t = threadIdx.x; t < vocab; t += blockDim.x)
            if (!contains(allowed_ids + a0, a1 - a0, t)) x[t] = -INFINITY;
    __syncthreads();
    const int last = last_src[row] >= 0 ? sampled[last_src[row]] : last_tokens[row];
    for (int j = b0 + threadIdx.x; j < b1; j += blockDim.x) {
        const int cond = bias[3 * j + 2];
        if (cond < 0 || cond == last) atomicAdd(&x[bias[3 * j]], __int_as_float(bias[3 * j + 1]));  // ids may repeat
    }
    __syncthreads();
    if (slot < 0) return;
    const int* c = counts + (int64_t)slot * vocab;
    const uint8_t* in_prompt = prompt_mask + (int64_t)slot * vocab;
    const float pres = presence[row], freq = frequency[row], rep = repetition[row];
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
        const float n = (float)c[t];
        float v = x[t] - (freq * n + pres * (n > 0.f ? 1.f : 0.f));
        if (n > 0.f || in_prompt[t]) v = v > 0.f ? v / rep : v * rep;
        x[t] = v;
    }
}

// counts[count_slots[i], sampled[i]] += 1 for rows with count_slots[i] >= 0.
// Launch: grid (ceil(S / 256)), block 256.
extern "C" __global__ void count_tokens(int* __restrict__ counts, int vocab, const int* __restrict__ sampled,
                                        const int* __restrict__ count_slots, int n) {
    pdl_begin();
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < n && count_slots[row] >= 0) atomicAdd(&counts[(int64_t)count_slots[row] * vocab + sampled[row]], 1);
}

// Zero the counts and prompt mask of slots[0, num_slots). Launch: grid (num_slots, ceil(vocab / 1024)), block 1024.
extern "C" __global__ void clear_token_slots(int* __restrict__ counts, uint8_t* __restrict__ prompt_mask, int vocab,
                                             const int* __restrict__ slots) {
    pdl_begin();
    const int t = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= vocab) return;
    const int64_t at = (int64_t)slots[blockIdx.x] * vocab + t;
    counts[at] = 0;
    prompt_mask[at] = 0;
}

// Token i of a just-cleared slot: token_slots[i] = slot adds tokens[i] to that slot's output counts; -1 - slot sets
// it in that slot's prompt mask. Launch: grid (ceil(n / 256)), block 256, after clear_token_slots.
extern "C" __global__ void fill_token_slots(int* __restrict__ counts, uint8_t* __restrict__ prompt_mask, int vocab,
                                            const int* __restrict__ tokens, const int* __restrict__ token_slots,
                                            int n) {
    pdl_begin();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int slot = token_slots[i];
    if (slot < 0) prompt_mask[(int64_t)(-1 - slot) * vocab + tokens[i]] = 1;
    else atomicAdd(&counts[(int64_t)slot * vocab + tokens[i]], 1);
}

// Copy KV block pairs[p] = (source, destination) in each cache caches[c] (K and V of every layer), blocks of
// block_elems bf16. Launch: grid (P, number of caches), block 256; block_elems % 8 == 0.
extern "C" __global__ void copy_blocks(bf16* const* __restrict__ caches, const int* __restrict__ pairs, int block_elems) {
    pdl_begin();
    bf16* cache = caches[blockIdx.y];
    const uint4* src = reinterpret_cast<const uint4*>(cache + (int64_t)pairs[2 * blockIdx.x] * block_elems);
    uint4* dst = reinterpret_cast<uint4*>(cache + (int64_t)pairs[2 * blockIdx.x + 1] * block_elems);
    for (int i = threadIdx.x; i < block_elems / 8; i += blockDim.x) dst[i] = src[i];
}

// Structured outputs: row i of logits [S, vocab] keeps only the tokens that bitmask row bitmask_rows[i] allows (bit
// t % 32 of word t / 32 of bitmask [C, words]); rows with bitmask_rows[i] < 0 are left alone.
// Twin: sampler.apply_token_bitmask. Launch: grid (S), block 256.
extern "C" __global__ void apply_token_bitmask(float* __restrict__ logits, int vocab, const int* __restrict__ bitmask,
                                               int words, const int* __restrict__ bitmask_rows) {
    pdl_begin();
    const int m = bitmask_rows[blockIdx.x];
    if (m < 0) return;
    float* x = logits + (int64_t)blockIdx.x * vocab;
    const int* bits = bitmask + (int64_t)m * words;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x)
        if (!((bits[t >> 5] >> (t & 31)) & 1)) x[t] = -INFINITY;
}
