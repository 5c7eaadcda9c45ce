// The MLP's gated activations, SwiGLU and GeGLU, and the final-logit soft cap.  Twins: numpy_backend.silu_and_mul,
// gelu_tanh_and_mul (on gate_up with its columns de-interleaved), soft_cap.
#include "common.cuh"

// out[t, i] = act(g) * u, where gate_up's columns are interleaved in groups of 8 as the gate/up weight's rows are
// (backends/cuda/forward.py): unit i's gate at column 16 * (i / 8) + i % 8, its up 8 columns further. (gemv.cu
// computes the same in its epilogue at batch <= 8; this serves the cuBLAS path.)
// Launch: grid (T, ceil(I / 2048)), block 256; 8 units (two 16-byte loads) per thread. I % 8 == 0.
template <class Act>
__device__ void gated(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    pdl_begin();
    const int i = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (i >= inter) return;
    const bf16* group = gate_up + (int64_t)blockIdx.x * 2 * inter + 2 * i;
    float g[8], u[8];
    load8(group, g);
    load8(group + 8, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = Act::apply(g[j], u[j]);
    store8(out + (int64_t)blockIdx.x * inter + i, g);
}

extern "C" __global__ void silu_and_mul(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    gated<Silu>(out, gate_up, inter);
}

extern "C" __global__ void gelu_tanh_and_mul(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int inter) {
    gated<GeluTanh>(out, gate_up, inter);
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
