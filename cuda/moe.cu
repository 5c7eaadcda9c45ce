// The fused mixture-of-experts MLP of one layer, step by step as backends/moe.py's twin does it.
// Twin: backends/moe.py (route, group_by_expert, fused_moe).
//
// 1. moe_topk_softmax: a token's router logits (float32, cuBLAS's) -> softmax -> its top_k experts and weights
//    (renormalized over the chosen ones where asked), ties broken as torch.topk on the CPU breaks them
//    (backends/topk.py: the k + 1 largest are placed by a thread per expert counting those before it; a row with a
//    tie among them replays libstdc++'s selection on one thread).
// 2. moe_align: the T * top_k assignments (a = token * top_k + slot) grouped by expert, stably (token order within an
//    expert), each expert's run padded to a whole tile of block_m rows with the sentinel num_assignments: vLLM's
//    moe_align_block_size (sorted_token_ids, expert_ids per tile, num_tokens_post_padded). A block per expert; each
//    counts every expert (shared-memory histogram), so that the run offsets need no second kernel.
// 3. The expert products over those tiles, a tile's rows all of one expert, so each expert's weights are read once
//    per tile: for a few tokens (decode) GEMV-style kernels whose tile is 8 assignments (the n = 8 side of
//    mma.m16n8k16, the weights its 16-row A side, as gemv.cu), for more a grouped GEMM over tiles of 32 or 64 rows
//    (ops.moe_block_m: 32 while an expert averages at most 16 assignments), its k-steps pipelined through cp.async.
//    The gate/up product ends in SiLU(gate) * up (gate and up rounded to bf16 first, as the dense path's are),
//    written bf16 per padded row; the down product writes each assignment's row times its routing weight (float32).
// 4. moe_sum: each token's top_k rows summed in slot order, added into the residual stream.
//
// Every grid is sized for the most tiles a batch of its size can have (ops.py), and tiles past
// num_tokens_post_padded return at once: no count reaches the host, so a decode step is capturable in a graph.
// Weights: experts_gate_up [E, 2 * inter, hidden] (each expert's gate rows, then its up rows), experts_down
// [E, hidden, inter], row-major bf16; or e4m3 codes with a scale per expert and row (W8A8, quantization="fp8": the
// moe_gemv_fp8_* and moe_gemm_fp8_* kernels, their A rows the f16 values of e4m3 codes with a scale per row).
//
// Compiled with -DMOE_MAX_EXPERTS, -DMOE_TOPK_THREADS, -DMOE_ALIGN_THREADS, -DMOE_GEMV_WARPS, -DMOE_GEMV_UNROLL,
// -DMOE_GEMM_BLOCK_K, -DMOE_GEMM_STAGES and -DMOE_GEMM_WARPS_<m> from backends/cuda/ops.py, which launches the
// kernels.
#include <type_traits>

#include "common.cuh"
#include "gemv_tile.cuh"

// ---- 1. routing ----------------------------------------------------------------------------------------------

// A router probability and its expert: libstdc++'s selection runs on these, ordered by value, largest first.
struct Pick {
    float v;
    int i;
};

__device__ __forceinline__ bool goes_before(const Pick& x, const Pick& y) { return x.v > y.v; }

__device__ __forceinline__ void swap_picks(Pick* q, int a, int b) {
    const Pick t = q[a];
    q[a] = q[b];
    q[b] = t;
}

// std::__adjust_heap (backends/topk.py _Selection.adjust_heap, line for line).
__device__ void adjust_heap(Pick* q, int first, int hole, int length, Pick value) {
    const int top = hole;
    int child = hole;
    while (child < (length - 1) / 2) {
        child = 2 * (child + 1);
        if (goes_before(q[first + child], q[first + child - 1])) child -= 1;
        q[first + hole] = q[first + child];
        hole = child;
    }
    if (length % 2 == 0 && child == (length - 2) / 2) {
        child = 2 * (child + 1);
        q[first + hole] = q[first + child - 1];
        hole = child - 1;
    }
    int parent = (hole - 1) / 2;
    while (hole > top && goes_before(q[first + parent], value)) {
        q[first + hole] = q[first + parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    q[first + hole] = value;
}

__device__ void pop_heap(Pick* q, int first, int last, int result) {
    const Pick value = q[result];
    q[result] = q[first];
    adjust_heap(q, first, 0, last - first, value);
}

__device__ void heap_select(Pick* q, int first, int middle, int last) {
    const int length = middle - first;
    if (length >= 2)
        for (int parent = (length - 2) / 2; parent >= 0; --parent) adjust_heap(q, first, parent, length, q[first + parent]);
    for (int i = middle; i < last; ++i)
        if (goes_before(q[i], q[first])) pop_heap(q, first, middle, i);
}

__device__ void sort_heap(Pick* q, int first, int last) {
    while (last - first > 1) {
        --last;
        pop_heap(q, first, last, last);
    }
}

__device__ void median_to_first(Pick* q, int result, int a, int b, int c) {
    int median;
    if (goes_before(q[a], q[b]))
        median = goes_before(q[b], q[c]) ? b : goes_before(q[a], q[c]) ? c : a;
    else
        median = goes_before(q[a], q[c]) ? a : goes_before(q[b], q[c]) ? c : b;
    swap_picks(q, result, median);
}

__device__ int partition_pivot(Pick* q, int first, int last) {
    median_to_first(q, first, first + 1, first + (last - first) / 2, last - 1);
    int lo = first + 1, hi = last;
    while (true) {
        while (goes_before(q[lo], q[first])) ++lo;
        --hi;
        while (goes_before(q[first], q[hi])) --hi;
        if (!(lo < hi)) return lo;
        swap_picks(q, lo, hi);
        ++lo;
    }
}

__device__ void linear_insert(Pick* q, int last) {
    const Pick value = q[last];
    while (goes_before(value, q[last - 1])) {
        q[last] = q[last - 1];
        --last;
    }
    q[last] = value;
}

__device__ void insertion_sort(Pick* q, int first, int last) {
    for (int i = first + 1; i < last; ++i) {
        if (goes_before(q[i], q[first])) {
            const Pick value = q[i];
            for (int j = i; j > first; --j) q[j] = q[j - 1];
            q[first] = value;
        } else {
            linear_insert(q, i);
        }
    }
}

__device__ void introselect(Pick* q, int first, int nth, int last, int depth) {
    while (last - first > 3) {
        if (depth == 0) {
            heap_select(q, first, nth + 1, last);
            swap_picks(q, first, nth);
            return;
        }
        --depth;
        const int cut = partition_pivot(q, first, last);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    insertion_sort(q, first, last);
}

__device__ __forceinline__ int floor_log2(int n) { return 31 - __clz(n); }

#define SORT_THRESHOLD 16  // std::sort insertion-sorts ranges up to this length (topk.py's THRESHOLD)

// std::__introsort_loop without recursion: the right part of each cut is sorted on, its left part waits on a stack
// (the parts are disjoint, so the order they are sorted in does not change the result). A part waiting has a larger
// depth budget than every part pushed after it, so the stack holds at most depth + 1 of them.
__device__ void introsort(Pick* q, int first, int last, int depth) {
    int stack[3 * 40];
    int top = 0;
    while (true) {
        while (last - first > SORT_THRESHOLD) {
            if (depth == 0) {
                heap_select(q, first, last, last);
                sort_heap(q, first, last);
                break;
            }
            --depth;
            const int cut = partition_pivot(q, first, last);
            stack[top++] = first;
            stack[top++] = cut;
            stack[top++] = depth;
            first = cut;
        }
        if (top == 0) return;
        depth = stack[--top];
        last = stack[--top];
        first = stack[--top];
    }
}

__device__ void sort_picks(Pick* q, int first, int last) {
    if (last - first <= 1) return;
    introsort(q, first, last, 2 * floor_log2(last - first));
    if (last - first > SORT_THRESHOLD) {
        insertion_sort(q, first, first + SORT_THRESHOLD);
        for (int i = first + SORT_THRESHOLD; i < last; ++i) linear_insert(q, i);
    } else {
        insertion_sort(q, first, last);
    }
}

// torch.topk's choice on the CPU among n picks in index order: q[0..k) on return (topk.py _Selection.topk).
__device__ void libstdcxx_topk(Pick* q, int n, int k) {
    if (k * 64 <= n) {
        heap_select(q, 0, k, n);
        sort_heap(q, 0, k);
    } else {
        introselect(q, 0, k - 1, n, 2 * floor_log2(n));
        sort_picks(q, 0, k - 1);
    }
}

// How many of probs[0 .. n) go before expert e (higher, or equal with a lower index), or some count >= picks once it
// is plain that e is not among the first picks: float4 broadcasts from shared memory, 32 experts between checks, so
// that the loads of a stretch are independent (a check per expert made each load wait for the one before).
__device__ __forceinline__ int place_of(const float* probs, int e, int n, int picks) {
    const float v = probs[e];
    int place = 0, f = 0;
    for (; f + 32 <= n && place < picks; f += 32) {
#pragma unroll
        for (int i = 0; i < 32; i += 4) {
            const float4 p = *reinterpret_cast<const float4*>(probs + f + i);
            place += (p.x > v || (p.x == v && f + i < e)) + (p.y > v || (p.y == v && f + i + 1 < e)) +
                     (p.z > v || (p.z == v && f + i + 2 < e)) + (p.w > v || (p.w == v && f + i + 3 < e));
        }
    }
    for (; f < n; ++f) place += probs[f] > v || (probs[f] == v && f < e);
    return place;
}

// topk_weights, topk_ids [T, top_k]: each token's experts, highest probability first, and their weights.
// A block of MOE_TOPK_THREADS per token, a thread per expert (more where num_experts is larger); logits
// [T, num_experts] float32, num_experts <= MOE_MAX_EXPERTS. An expert's place is how many go before it (a higher
// probability, or an equal one and a lower index: a stable sort's order, descending), counted by its thread over all
// of them at once; one more place than k is kept, so that a tie at the k-th place shows.
extern "C" __global__ void __launch_bounds__(MOE_TOPK_THREADS) moe_topk_softmax(float* topk_weights, int* topk_ids,
                                                                                const float* logits, int num_experts,
                                                                                int top_k, int renormalize) {
    pdl_begin();
    __shared__ __align__(16) float probs[MOE_MAX_EXPERTS];
    __shared__ Pick q[MOE_MAX_EXPERTS];
    __shared__ int chosen[MOE_MAX_EXPERTS];
    __shared__ float scratch[32];
    __shared__ int tie;
    const int tid = threadIdx.x;
    const float* row = logits + (int64_t)blockIdx.x * num_experts;
    float row_max = -INFINITY;
    for (int e = tid; e < num_experts; e += blockDim.x) {
        probs[e] = row[e];
        row_max = fmaxf(row_max, probs[e]);
    }
    row_max = block_reduce<Max>(row_max, scratch);
    float sum = 0.f;
    for (int e = tid; e < num_experts; e += blockDim.x) {
        probs[e] = expf(probs[e] - row_max);
        sum += probs[e];
    }
    sum = block_reduce<Sum>(sum, scratch);
    for (int e = tid; e < num_experts; e += blockDim.x) probs[e] /= sum;
    if (tid == 0) tie = 0;
    __syncthreads();
    const int picks = min(top_k + 1, num_experts);
    for (int e = tid; e < num_experts; e += blockDim.x) {
        const int place = place_of(probs, e, num_experts, picks);
        if (place < picks) chosen[place] = e;
    }
    __syncthreads();
    for (int j = tid + 1; j < picks; j += blockDim.x)
        if (probs[chosen[j]] == probs[chosen[j - 1]]) tie = 1;
    __syncthreads();
    if (tie && tid == 0) {  // torch.topk's order, by libstdc++'s algorithms
        for (int e = 0; e < num_experts; ++e) q[e] = Pick{probs[e], e};
        libstdcxx_topk(q, num_experts, top_k);
        for (int j = 0; j < top_k; ++j) chosen[j] = q[j].i;
    }
    __syncthreads();
    float total = 0.f;
    for (int j = 0; j < top_k && renormalize; ++j) total += probs[chosen[j]];
    for (int j = tid; j < top_k; j += blockDim.x) {
        topk_ids[(int64_t)blockIdx.x * top_k + j] = chosen[j];
        topk_weights[(int64_t)blockIdx.x * top_k + j] = renormalize ? probs[chosen[j]] / total : probs[chosen[j]];
    }
}

// ---- 2. grouping ----------------------------------------------------------------------------------------------

// Block e writes expert e's run: sorted_ids[start .. start + padded) its assignments in order, then the sentinel
// num_assignments; expert_ids[start / block_m ..] = e for its tiles; block 0 writes num_post_padded (the padded
// total). topk_ids [num_assignments] flat; grid (num_experts), block MOE_ALIGN_THREADS (whole warps).
extern "C" __global__ void __launch_bounds__(MOE_ALIGN_THREADS) moe_align(int* sorted_ids, int* expert_ids,
                                                                          int* num_post_padded, const int* topk_ids,
                                                                          int num_assignments, int num_experts,
                                                                          int block_m) {
    pdl_begin();
    __shared__ int counts[MOE_MAX_EXPERTS];
    __shared__ float scratch[32];
    __shared__ int warp_counts[MOE_ALIGN_THREADS / 32];
    const int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int i = tid; i < num_experts; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    for (int i = tid; i < num_assignments; i += blockDim.x) atomicAdd(&counts[topk_ids[i]], 1);
    __syncthreads();
    float before = 0.f, total = 0.f;  // padded rows of the experts before e, and of all (exact: < 2^24)
    for (int i = tid; i < num_experts; i += blockDim.x) {
        const int padded = (counts[i] + block_m - 1) / block_m * block_m;
        total += padded;
        if (i < e) before += padded;
    }
    const int start = (int)block_reduce<Sum>(before, scratch);
    const int all = (int)block_reduce<Sum>(total, scratch);
    if (e == 0 && tid == 0) *num_post_padded = all;
    const int count = counts[e], padded = (count + block_m - 1) / block_m * block_m;
    for (int j = tid; j < padded / block_m; j += blockDim.x) expert_ids[start / block_m + j] = e;
    for (int j = count + tid; j < padded; j += blockDim.x) sorted_ids[start + j] = num_assignments;
    if (count == 0) return;
    int placed = 0;  // e's assignments among those scanned so far
    for (int base = 0; base < num_assignments; base += blockDim.x) {
        const int a = base + tid;
        const bool mine = a < num_assignments && topk_ids[a] == e;
        const unsigned ballot = __ballot_sync(0xffffffffu, mine);
        __syncthreads();  // the previous round has read warp_counts
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int offset = placed;
        for (int w = 0; w < warp; ++w) offset += warp_counts[w];
        if (mine) sorted_ids[start + offset + __popc(ballot & ((1u << lane) - 1))] = a;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) placed += warp_counts[w];
    }
}

// ---- 3. the expert products -----------------------------------------------------------------------------------

// SiLU(gate) * up, each rounded to bf16 first (gemv.cu's swiglu).
__device__ __forceinline__ float moe_swiglu(float gate, float up) {
    gate = __bfloat162float(__float2bfloat16(gate));
    up = __bfloat162float(__float2bfloat16(up));
    return gate / (1.f + expf(-gate)) * up;
}

// The GEMV path, for a tile of 8 assignments of one expert (moe_align with block_m 8): each 16-row weight tile times
// the tile's 8 A rows (the mma's 8 columns), as gemv.cu's gemv: `split` warps share a weight tile, each taking a part
// of k (gemv_tile.cuh's iterations), their partial tiles summed through shared memory in warp order; a block holds
// MOE_GEMV_WARPS / split weight tiles. Enough 16-byte loads are in flight only so: a decode step's 8 experts at
// Qwen3-30B-A3B's widths are 96 gate/up and 128 down weight tiles each, too few for a warp apiece to keep HBM busy.
// GATE_UP: a weight tile is 8 units' gate rows (the A operand's rows g) and the same units' up rows (rows g + 8), so
// that a lane's sums pair gate and up; A rows are x rows of the assignments' tokens (zeros for a padding row);
// act [p, inter] bf16 = SwiGLU of each unit, for every padded row p (a padding row's is 0).
// Else (down): a weight tile is 16 output columns' rows; A rows are act rows; out [a, hidden] float32 =
// topk_weights[a] * the product, for the tile's real assignments a.
// FP8 (W8A8, moe_gemv_fp8_*): w holds e4m3 codes with w_scale one per expert and row ([E, rows of an expert]), the
// A rows the f16 values of e4m3 codes (quantize_fp8_values) with a_scale one per row: per token (x, gate/up) or per
// padded row (act, down); the sums (gemv_tile.cuh multiply_e4m3) are scaled by both before SwiGLU or the routing
// weight, as gemv_fp8's are.
// Grid (max tiles, ceil(weight tiles / (MOE_GEMV_WARPS / split))), block MOE_GEMV_WARPS * 32; split in {1, 2, 4, 8}
// divides MOE_GEMV_WARPS.
template <bool GATE_UP, bool FP8>
__device__ void moe_gemv(bf16* act, float* out, const void* a_rows, const void* w, const float* w_scale,
                         const float* a_scale, const int* sorted_ids, const int* expert_ids,
                         const int* num_post_padded, const float* topk_weights, int top_k, int num_assignments,
                         int hidden, int inter, int split) {
    pdl_begin();  // the indices (moe_align) and A rows come from the kernels before
    using W = std::conditional_t<FP8, e4m3, bf16>;
    using X = std::conditional_t<FP8, __half, bf16>;
    __shared__ __align__(16) float partial[MOE_GEMV_WARPS][128];  // each warp's c fragment, 4 floats per lane
    const int tile = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    if (tile * 8 >= *num_post_padded) return;
    const int tiles = MOE_GEMV_WARPS / split, tile0 = blockIdx.y * tiles;  // this block's weight tiles
    const int k = GATE_UP ? hidden : inter, rows = GATE_UP ? inter : hidden;  // rows: units or output columns
    const int r0 = (tile0 + warp / split) * (GATE_UP ? 8 : 16);  // the warp's first unit or output column
    const int chunks = r0 < rows ? k / (16 / (int)sizeof(W)) : 0;  // a weight tile wholly past the rows loads nothing
    const int expert = expert_ids[tile], expert_rows = GATE_UP ? 2 * inter : hidden;
    const W* w_e = static_cast<const W*>(w) + (int64_t)expert * expert_rows * k;
    const W* w_lo = w_e + (int64_t)min(r0 + g, rows - 1) * k;
    const W* w_hi = GATE_UP ? w_lo + (int64_t)inter * k : w_e + (int64_t)min(r0 + g + 8, rows - 1) * k;
    const int a = sorted_ids[tile * 8 + g];  // column g's assignment (num_assignments: a padding row)
    const bool x_ok = !GATE_UP || a < num_assignments;
    const X* x_row = static_cast<const X*>(a_rows) +
                     (GATE_UP ? (int64_t)(x_ok ? a / top_k : 0) * hidden : (int64_t)(tile * 8 + g) * inter);
    float c[2][4] = {};
    uint4 lo[MOE_GEMV_UNROLL], hi[MOE_GEMV_UNROLL];
    for (int base = (warp % split) * MOE_GEMV_UNROLL * 4; base < chunks; base += split * MOE_GEMV_UNROLL * 4) {
        load_rows<MOE_GEMV_UNROLL>(lo, hi, w_lo, w_hi, base, t, chunks);
        if constexpr (FP8) multiply_e4m3<MOE_GEMV_UNROLL>(c, lo, hi, x_row, base, t, chunks);
        else multiply<MOE_GEMV_UNROLL>(c, lo, hi, x_row, x_ok, base, t, chunks);
    }
    *reinterpret_cast<float4*>(&partial[warp][lane * 4]) =
        make_float4(c[0][0] + c[1][0], c[0][1] + c[1][1], c[0][2] + c[1][2], c[0][3] + c[1][3]);
    __syncthreads();
    const float* ws = FP8 ? w_scale + (int64_t)expert * expert_rows : nullptr;  // this expert's row scales
    // Element f = 4 * lane + j of a weight tile's fragment, summed over its split warps: row g + 8 * (j / 2),
    // column 2t + j % 2 (the mma's c layout); gate/up: j = 0, 1 a unit's gate, j + 2 its up.
    for (int i = threadIdx.x; i < tiles * (GATE_UP ? 64 : 128); i += blockDim.x) {
        const int wt = GATE_UP ? i >> 6 : i >> 7, f = GATE_UP ? (i & 63) * 2 - (i & 1) : i & 127;
        const int l = f >> 2, j = f & 3, col = (l & 3) * 2 + (j & 1), asg = sorted_ids[tile * 8 + col];
        float sum = 0.f, up = 0.f;
        for (int s = 0; s < split; ++s) {
            sum += partial[wt * split + s][f];
            if (GATE_UP) up += partial[wt * split + s][f + 2];
        }
        if (GATE_UP) {
            const int unit = (tile0 + wt) * 8 + (l >> 2);
            if (unit >= inter) continue;
            if constexpr (FP8) {  // a padding row's x is another token's: its scale 0 makes its act 0
                const float xs = asg < num_assignments ? a_scale[asg / top_k] : 0.f;
                sum *= xs * ws[unit];
                up *= xs * ws[inter + unit];
            }
            act[(int64_t)(tile * 8 + col) * inter + unit] = __float2bfloat16(moe_swiglu(sum, up));
        } else {
            const int row = (tile0 + wt) * 16 + (l >> 2) + (j >> 1) * 8;
            if (row >= hidden || asg >= num_assignments) continue;
            if constexpr (FP8) sum *= a_scale[tile * 8 + col] * ws[row];
            out[(int64_t)asg * hidden + row] = topk_weights[asg] * sum;
        }
    }
}

// act [tiles * 8, inter]; x [T, hidden] bf16, a = token * top_k + slot; w experts_gate_up.
extern "C" __global__ void __launch_bounds__(MOE_GEMV_WARPS * 32, 2) moe_gemv_gate_up(
    bf16* act, const bf16* x, const bf16* w, const int* sorted_ids, const int* expert_ids, const int* num_post_padded,
    int top_k, int num_assignments, int hidden, int inter, int split) {
    moe_gemv<true, false>(act, nullptr, x, w, nullptr, nullptr, sorted_ids, expert_ids, num_post_padded, nullptr,
                          top_k, num_assignments, hidden, inter, split);
}

// out [num_assignments, hidden] float32; act as moe_gemv_gate_up wrote it; w experts_down.
extern "C" __global__ void __launch_bounds__(MOE_GEMV_WARPS * 32, 2) moe_gemv_down(
    float* out, const bf16* act, const bf16* w, const int* sorted_ids, const int* expert_ids,
    const int* num_post_padded, const float* topk_weights, int num_assignments, int hidden, int inter, int split) {
    moe_gemv<false, false>(nullptr, out, act, w, nullptr, nullptr, sorted_ids, expert_ids, num_post_padded,
                           topk_weights, 1, num_assignments, hidden, inter, split);
}

// The e4m3 forms: x [T, hidden] and act [tiles * 8, inter] as f16 code values with x_scale [T], act_scale [tiles * 8];
// w e4m3 with w_scale [E * rows of an expert].
extern "C" __global__ void __launch_bounds__(MOE_GEMV_WARPS * 32, 2) moe_gemv_fp8_gate_up(
    bf16* act, const __half* x, const e4m3* w, const float* w_scale, const float* x_scale, const int* sorted_ids,
    const int* expert_ids, const int* num_post_padded, int top_k, int num_assignments, int hidden, int inter,
    int split) {
    moe_gemv<true, true>(act, nullptr, x, w, w_scale, x_scale, sorted_ids, expert_ids, num_post_padded, nullptr,
                         top_k, num_assignments, hidden, inter, split);
}

extern "C" __global__ void __launch_bounds__(MOE_GEMV_WARPS * 32, 2) moe_gemv_fp8_down(
    float* out, const __half* act, const e4m3* w, const float* w_scale, const float* act_scale, const int* sorted_ids,
    const int* expert_ids, const int* num_post_padded, const float* topk_weights, int num_assignments, int hidden,
    int inter, int split) {
    moe_gemv<false, true>(nullptr, out, act, w, w_scale, act_scale, sorted_ids, expert_ids, num_post_padded,
                          topk_weights, 1, num_assignments, hidden, inter, split);
}

#define GEMM_BLOCK_N 128  // B rows (output columns) per tile: gate/up 64 units' gate and up rows, down 128 columns
#define GEMM_LD (MOE_GEMM_BLOCK_K + 8)  // shared rows padded so that ldmatrix is conflict-free

// One k-step's A and B tiles in shared memory (a stage of the pipeline); MOE_GEMM_STAGES of them are the kernel's
// dynamic shared memory (ops.moe_gemm_shared_bytes, past the static 48 KB), followed in the FP8 kernels by each
// stage's e4m3 B codes [GEMM_BLOCK_N][MOE_GEMM_BLOCK_K] as they land (widened into b before the step's mmas). The
// FP8 kernels' a and b hold f16 values (e4m3 values, exact in f16) in the same 16-bit rows.
template <int BM>
struct GemmStage {
    bf16 a[BM * GEMM_LD];
    bf16 b[GEMM_BLOCK_N * GEMM_LD];
};
constexpr int GEMM_CODES_BYTES = GEMM_BLOCK_N * MOE_GEMM_BLOCK_K;  // a stage's e4m3 B codes (FP8)

// The weight row behind shared B row j of a tile whose first unit (gate/up) or output column (down) is col0: for
// gate/up a column group of WN rows holds WN / 2 units' gate rows, then the same units' up rows, so that a warp's
// accumulators pair a unit's gate and up; rows past the weight repeat its last (their products are never written).
template <bool GATE_UP, int WN>
__device__ __forceinline__ int gemm_weight_row(int j, int col0, int n) {
    if (!GATE_UP) return min(col0 + j, n - 1);
    const int within = j % WN, unit = min(col0 + j / WN * (WN / 2) + within % (WN / 2), n - 1);
    return within < WN / 2 ? unit : n + unit;
}

// Issue the copies of k-step k0 into a stage: A rows rows_s (a_rows' rows of 16-bit values; -1: zeros), B rows the
// expert's weight rows (bf16 into st.b; FP8: e4m3 codes into `codes`); chunks past k are zeros.
template <bool GATE_UP, int BM, int WARPS, int WN, bool FP8>
__device__ __forceinline__ void gemm_load_stage(GemmStage<BM>& st, uint8_t* codes, const int* rows_s,
                                                const bf16* a_rows, const void* w_e, int k0, int col0, int n, int k) {
    constexpr int BK = MOE_GEMM_BLOCK_K, PARTS = BK / 8, B_PARTS = FP8 ? BK / 16 : PARTS;
    for (int c = threadIdx.x; c < BM * PARTS; c += WARPS * 32) {
        const int r = c / PARTS, kc = k0 + c % PARTS * 8, row = rows_s[r];
        const bool ok = row >= 0 && kc < k;
        cp_async16(&st.a[r * GEMM_LD + c % PARTS * 8], ok ? a_rows + (int64_t)row * k + kc : a_rows, ok);
    }
    for (int c = threadIdx.x; c < GEMM_BLOCK_N * B_PARTS; c += WARPS * 32) {
        const int j = c / B_PARTS, part = c % B_PARTS, kc = k0 + part * (FP8 ? 16 : 8);
        const int64_t at = (int64_t)gemm_weight_row<GATE_UP, WN>(j, col0, n) * k + kc;
        if constexpr (FP8) {
            const e4m3* src = static_cast<const e4m3*>(w_e);
            cp_async16(codes + j * BK + part * 16, kc < k ? src + at : src, kc < k);
        } else {
            const bf16* src = static_cast<const bf16*>(w_e);
            cp_async16(&st.b[j * GEMM_LD + part * 8], kc < k ? src + at : src, kc < k);
        }
    }
}

// FP8: a landed stage's B codes -> their f16 values in st.b (8 codes a thread and pass); the caller syncs after.
template <int BM, int WARPS>
__device__ __forceinline__ void gemm_widen_codes(GemmStage<BM>& st, const uint8_t* codes) {
    constexpr int BK = MOE_GEMM_BLOCK_K;
    for (int c = threadIdx.x; c < GEMM_BLOCK_N * BK / 8; c += WARPS * 32) {
        const int j = c / (BK / 8), q = c % (BK / 8);
        *reinterpret_cast<uint4*>(&st.b[j * GEMM_LD + q * 8]) =
            e4m3x8_to_f16x8(*reinterpret_cast<const uint2*>(codes + j * BK + q * 8));
    }
}

// moe_gemm's stores for a warp's 16 rows from padded row p_first and its columns from col_first: c element e of
// n-block nb is row p_first + lane / 4 (+ 8 for e >= 2), column nb * 8 + 2 * (lane % 4) + e % 2; gate/up: n-blocks
// nb < WN / 16 are gate, nb + WN / 16 the same units' up. ws: FP8, the expert's row scales (a_scale the A rows');
// null: bf16.
template <bool GATE_UP, int WN>
__device__ __forceinline__ void gemm_epilogue(bf16* act, float* out, const float (&acc)[WN / 8][4], const float* ws,
                                              const float* a_scale, const int* sorted_ids, const float* topk_weights,
                                              int top_k, int num_assignments, int n, int p_first, int col_first,
                                              int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int p = p_first + lane / 4 + 8 * h, a = sorted_ids[p];
        if (!GATE_UP && a >= num_assignments) continue;
        // FP8: the A row's scale (a padding row of gate/up: 0, so that its act is 0 as bf16's zero row gives)
        const float xs = !ws ? 1.f : !GATE_UP ? a_scale[p] : a < num_assignments ? a_scale[a / top_k] : 0.f;
        const float scale = GATE_UP ? xs : xs * topk_weights[a];
#pragma unroll
        for (int nb = 0; nb < (GATE_UP ? WN / 16 : WN / 8); ++nb) {
            // even; n % 8 == 0, so col + 1 < n where col < n
            const int col = col_first + nb * 8 + 2 * (lane % 4);
            if (col >= n) continue;
            float v0 = acc[nb][2 * h] * scale, v1 = acc[nb][2 * h + 1] * scale;
            if (GATE_UP) {
                float u0 = acc[nb + WN / 16][2 * h] * scale, u1 = acc[nb + WN / 16][2 * h + 1] * scale;
                if (ws) v0 *= ws[col], v1 *= ws[col + 1], u0 *= ws[n + col], u1 *= ws[n + col + 1];
                *reinterpret_cast<__nv_bfloat162*>(act + (int64_t)p * n + col) =
                    __floats2bfloat162_rn(moe_swiglu(v0, u0), moe_swiglu(v1, u1));
            } else {
                if (ws) v0 *= ws[col], v1 *= ws[col + 1];
                *reinterpret_cast<float2*>(out + (int64_t)a * n + col) = make_float2(v0, v1);
            }
        }
    }
}

// The grouped GEMM over tiles of BM padded rows of one expert (moe_align with that block_m): A rows (x rows of the
// tile's tokens for gate/up, act rows for down) times B rows (the expert's weight rows), k in steps of
// MOE_GEMM_BLOCK_K through a MOE_GEMM_STAGES-deep cp.async pipeline; warp w multiplies rows 16 (w % (BM / 16)) .. + 15
// by its column group's WN B rows. GATE_UP: act [p, inter] bf16 = SwiGLU of units col0 .. col0 + 63 (k = hidden);
// else out [a, n] float32 = topk_weights[a] * act row p . down rows col0 .. col0 + 127 (k = inter).
// FP8: A rows are f16 code values with a_scale per row (per token for gate/up, per padded row for down), w e4m3
// codes with w_scale per expert and row, widened to f16 in shared memory; the f16 mmas' sums are scaled by both.
// WARPS: BM / 16 row groups of 16 times WARPS / (BM / 16) column groups of WN = 128 / that B rows.
// Grid (max tiles, ceil(units / 64) or ceil(n / 128)), block WARPS * 32.
template <bool GATE_UP, int BM, int WARPS, bool FP8>
__device__ void moe_gemm(bf16* act, float* out, const bf16* a_rows, const void* w, const float* w_scale,
                         const float* a_scale, const int* sorted_ids, const int* expert_ids,
                         const int* num_post_padded, const float* topk_weights, int top_k, int num_assignments, int n,
                         int k) {
    pdl_begin();
    constexpr int BK = MOE_GEMM_BLOCK_K, ROW_GROUPS = BM / 16, WN = GEMM_BLOCK_N / (WARPS / ROW_GROUPS);
    static_assert(WARPS % ROW_GROUPS == 0 && WN % 32 == 0 && BK % 16 == 0,
                  "a warp's 16 rows and WN columns (gate/up: pairs of 8 units), whole k-steps");
    extern __shared__ __align__(16) unsigned char gemm_shared[];
    GemmStage<BM>* stages = reinterpret_cast<GemmStage<BM>*>(gemm_shared);
    uint8_t* codes = gemm_shared + MOE_GEMM_STAGES * sizeof(GemmStage<BM>);  // FP8: stage s's at s * CODES_BYTES
    __shared__ int rows_s[BM];  // the A row of each tile row; -1: zeros (a padding row of gate/up)
    const int tile = blockIdx.x, p0 = tile * BM, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr uint32_t SHARED = MOE_GEMM_STAGES * (sizeof(GemmStage<BM>) + (FP8 ? GEMM_CODES_BYTES : 0));
    if (threadIdx.x == 0 && dynamic_shared_bytes() < SHARED) __trap();
    if (p0 >= *num_post_padded) return;
    const int col0 = blockIdx.y * (GATE_UP ? GEMM_BLOCK_N / 2 : GEMM_BLOCK_N);  // first unit or output column
    const int row0 = warp % ROW_GROUPS * 16, group = warp / ROW_GROUPS;  // the warp's rows and column group
    const int expert = expert_ids[tile], expert_rows = GATE_UP ? 2 * n : n;
    const void* w_e = static_cast<const uint8_t*>(w) + (int64_t)expert * expert_rows * k * (FP8 ? 1 : 2);
    for (int r = threadIdx.x; r < BM; r += blockDim.x) {
        const int a = sorted_ids[p0 + r];
        rows_s[r] = !GATE_UP ? p0 + r : a < num_assignments ? a / top_k : -1;
    }
    __syncthreads();
    const int steps = (k + BK - 1) / BK;
    auto load = [&](int step) {
        const int s = step % MOE_GEMM_STAGES;
        gemm_load_stage<GATE_UP, BM, WARPS, WN, FP8>(stages[s], codes + s * GEMM_CODES_BYTES, rows_s, a_rows, w_e,
                                                     step * BK, col0, n, k);
    };
#pragma unroll
    for (int s = 0; s < MOE_GEMM_STAGES - 1; ++s) {  // the pipeline's first stages; a group per stage, empty or not
        if (s < steps) load(s);
        cp_async_commit();
    }
    float acc[WN / 8][4];
#pragma unroll
    for (int nb = 0; nb < WN / 8; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
    const int mi = lane / 8;
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<MOE_GEMM_STAGES - 2>();  // this step's stage has landed (for this thread's copies) ...
        __syncthreads();  // ... and everyone's; every warp is past the step before, whose stage is refilled next
        const int next = step + MOE_GEMM_STAGES - 1;
        if (next < steps) load(next);
        cp_async_commit();
        GemmStage<BM>& st = stages[step % MOE_GEMM_STAGES];
        if constexpr (FP8) {
            gemm_widen_codes<BM, WARPS>(st, codes + step % MOE_GEMM_STAGES * GEMM_CODES_BYTES);
            __syncthreads();
        }
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            uint32_t af[4];
            ldmatrix_x4(af, &st.a[(row0 + lane % 16) * GEMM_LD + kk * 16 + (lane / 16) * 8]);
#pragma unroll
            for (int nb = 0; nb < WN / 8; nb += 2) {
                uint32_t b[4];
                ldmatrix_x4(b, &st.b[(group * WN + nb * 8 + (mi / 2) * 8 + lane % 8) * GEMM_LD + kk * 16 +
                                     (mi % 2) * 8]);
                if constexpr (FP8) {
                    mma_f16(acc[nb], af, b[0], b[1]);
                    mma_f16(acc[nb + 1], af, b[2], b[3]);
                } else {
                    mma_bf16(acc[nb], af, b[0], b[1]);
                    mma_bf16(acc[nb + 1], af, b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy outlives the block (the last groups are empty)
    gemm_epilogue<GATE_UP, WN>(act, out, acc, FP8 ? w_scale + (int64_t)expert * expert_rows : nullptr, a_scale,
                               sorted_ids, topk_weights, top_k, num_assignments, n, p0 + row0, col0 + group *
                               (GATE_UP ? WN / 2 : WN), lane);
}

// act [max padded rows, inter]; x [T, hidden]; w experts_gate_up. One kernel per tile height (ops.moe_block_m) and
// its warps per block; moe_gemm_fp8_*: x and act f16 code values with their row scales, w e4m3 with w_scale.
#define MOE_GEMM_KERNELS(BM, WARPS)                                                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_gemm_gate_up_##BM(                                    \
        bf16* act, const bf16* x, const bf16* w, const int* sorted_ids, const int* expert_ids,                         \
        const int* num_post_padded, int top_k, int num_assignments, int hidden, int inter) {                           \
        moe_gemm<true, BM, WARPS, false>(act, nullptr, x, w, nullptr, nullptr, sorted_ids, expert_ids,                 \
                                         num_post_padded, nullptr, top_k, num_assignments, inter, hidden);             \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_gemm_down_##BM(                                       \
        float* out, const bf16* act, const bf16* w, const int* sorted_ids, const int* expert_ids,                      \
        const int* num_post_padded, const float* topk_weights, int num_assignments, int hidden, int inter) {           \
        moe_gemm<false, BM, WARPS, false>(nullptr, out, act, w, nullptr, nullptr, sorted_ids, expert_ids,              \
                                          num_post_padded, topk_weights, 1, num_assignments, hidden, inter);           \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_gemm_fp8_gate_up_##BM(                              \
        bf16* act, const __half* x, const e4m3* w, const float* w_scale, const float* x_scale, const int* sorted_ids,  \
        const int* expert_ids, const int* num_post_padded, int top_k, int num_assignments, int hidden, int inter) {    \
        moe_gemm<true, BM, WARPS, true>(act, nullptr, reinterpret_cast<const bf16*>(x), w, w_scale, x_scale,           \
                                        sorted_ids, expert_ids, num_post_padded, nullptr, top_k, num_assignments,      \
                                        inter, hidden);                                                                \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) moe_gemm_fp8_down_##BM(                                 \
        float* out, const __half* act, const e4m3* w, const float* w_scale, const float* act_scale,                    \
        const int* sorted_ids, const int* expert_ids, const int* num_post_padded, const float* topk_weights,           \
        int num_assignments, int hidden, int inter) {                                                                  \
        moe_gemm<false, BM, WARPS, true>(nullptr, out, reinterpret_cast<const bf16*>(act), w, w_scale, act_scale,      \
                                         sorted_ids, expert_ids, num_post_padded, topk_weights, 1, num_assignments,    \
                                         hidden, inter);                                                               \
    }

// out [num_assignments, hidden] float32 (down); act as gate/up wrote it; w experts_down.
MOE_GEMM_KERNELS(32, MOE_GEMM_WARPS_32)
MOE_GEMM_KERNELS(64, MOE_GEMM_WARPS_64)

// ---- 4. the weighted sum --------------------------------------------------------------------------------------

// x [T, hidden] += the sum over slots 0 .. top_k - 1, in order, of rows [T * top_k, hidden] (already weighted).
// Grid (T, ceil(hidden / (4 * blockDim))), 4 columns per thread; hidden % 4 == 0.
extern "C" __global__ void moe_sum(float* x, const float* rows, int top_k, int hidden) {
    pdl_begin();
    const int t = blockIdx.x, i = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
    if (i >= hidden) return;
    const float* r = rows + (int64_t)t * top_k * hidden + i;
    float4 s = *reinterpret_cast<const float4*>(r);
    for (int j = 1; j < top_k; ++j) {
        const float4 v = *reinterpret_cast<const float4*>(r + (int64_t)j * hidden);
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    float4* dst = reinterpret_cast<float4*>(x + (int64_t)t * hidden + i);
    const float4 old = *dst;
    *dst = make_float4(old.x + s.x, old.y + s.y, old.z + s.z, old.w + s.w);
}
