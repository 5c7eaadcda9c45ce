// The MLP's gated activations, SwiGLU and GeGLU (also quantized to e4m3 for an FP8 down projection), and the
// final-logit soft cap.  Twins: numpy_backend.silu_and_mul, gelu_tanh_and_mul (on gate_up with its columns
// de-interleaved), then model/fp8.py quantize_rows for the _e4m3 forms; soft_cap.
#include "common.cuh"

// out[t, i] = act(g) * u, where gate_up's columns are interleaved in groups of `group` as the gate/up weight's rows
// are (backends/cuda/forward.py): unit i's gate at column 2 * group * (i / group) + i % group, its up `group`
// columns further. group 8: the GEMV's interleave (gemv.cu computes the same in its epilogue at batch <= 8; this
// serves the cuBLAS path); group I: the gate rows, then the up rows (block-scaled FP8 weights, not interleaved).
// Launch: grid (T, ceil(I / 2048)), block 256; 8 units (two 16-byte loads) per thread. I % 8 == 0, group % 8 == 0.
template <class Act>
__device__ void gated(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter, int group) {
    pdl_begin();
    const int i = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (i >= inter) return;
    const bf16* gate = gate_up + (int64_t)blockIdx.x * 2 * inter + 2 * group * (i / group) + i % group;
    float g[8], u[8];
    load8(gate, g);
    load8(gate + group, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = Act::apply(g[j], u[j]);
    store8(out + (int64_t)blockIdx.x * inter + i, g);
}

extern "C" __global__ void silu_and_mul(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter,
                                         int group) {
    gated<Silu>(out, gate_up, inter, group);
}

extern "C" __global__ void gelu_tanh_and_mul(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter,
                                              int group) {
    gated<GeluTanh>(out, gate_up, inter, group);
}

// The 8 units from unit i of a gate_up row (interleaved as gated's), activated and rounded to bf16 as gated stores
// them.
template <class Act>
__device__ __forceinline__ void gated8(const bf16* row, int i, float a[8]) {
    float u[8];
    load8(row + 2 * i, a);
    load8(row + 2 * i + 8, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = __bfloat162float(__float2bfloat16(Act::apply(a[j], u[j])));
}

// gated's row t quantized for the FP8 GEMM that reads it (the down projection beyond 8 rows), instead of stored in
// bf16: scales[t] = fp8_scale(amax) and the e4m3 codes of the bf16 values times 1 / scale, as quantize_fp8 computes
// them from gated's output (fp8.cu). The activation is computed twice, for the amax and for the codes (the row's
// second read comes from L2), not kept: at 8B's 14,336 units a row would be 56 registers a thread.
// Launch: grid (T), block 256 (a row per block, 8 units per thread and pass). I % 8 == 0.
template <class Act>
__device__ void gated_e4m3(e4m3* __restrict__ codes, float* __restrict__ scales, const bf16* gate_up, int inter) {
    pdl_begin();
    __shared__ float scratch[32];
    const bf16* row = gate_up + (int64_t)blockIdx.x * 2 * inter;
    float amax = 0.f;
    for (int i = threadIdx.x * 8; i < inter; i += blockDim.x * 8) {
        float a[8];
        gated8<Act>(row, i, a);
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(a[j]));
    }
    const float scale = fp8_scale(block_reduce<Max>(amax, scratch)), inv = __frcp_rn(scale);
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
    for (int i = threadIdx.x * 8; i < inter; i += blockDim.x * 8) {
        float a[8];
        gated8<Act>(row, i, a);
        *reinterpret_cast<uint2*>(codes + (int64_t)blockIdx.x * inter + i) = f32x8_to_e4m3x8(a, inv);
    }
}

extern "C" __global__ void silu_and_mul_e4m3(e4m3* __restrict__ codes, float* __restrict__ scales,
                                             const bf16* gate_up, int inter) {
    gated_e4m3<Silu>(codes, scales, gate_up, inter);
}

extern "C" __global__ void gelu_tanh_and_mul_e4m3(e4m3* __restrict__ codes, float* __restrict__ scales,
                                                  const bf16* gate_up, int inter) {
    gated_e4m3<GeluTanh>(codes, scales, gate_up, inter);
}

// logits[r, v] = cap * tanh(logits[r, v] / cap), in place (Gemma 2's final_logit_softcapping), on the LM head's
// float32 logits before the logits processors, the sampler and the logprobs read them.
// Launch: grid (R, ceil(vocab / 256)), block 256: one entry per thread.
extern "C" __global__ void soft_cap(float* __restrict__ logits, int vocab, float cap) {
    pdl_begin();
    const int v = blockIdx.y * blockDim.x + threadIdx.x;
    if (v >= vocab) return;
    float* p = logits + (int64_t)blockIdx.x * vocab + v;
    *p = cap * tanhf(*p / cap);
}
