// Token embedding gather.  Twin: numpy_backend.NumpyBackend.forward, `x = self.embed[batch.token_ids]`.
#include "common.cuh"

// out[t, :] = float(table[ids[t], :]) * scale: the bf16 embedding row widened into the float32 residual stream
// (scale: 1, or Gemma's sqrt(hidden) rounded to bf16 as HF's bf16 model rounds it).
// Launch: grid (T), block 256; each thread moves 8 elements (one 16-byte load) per step. hidden % 8 == 0.
extern "C" __global__ void embedding(float* __restrict__ out, const bf16* __restrict__ table,
                                     const int* __restrict__ ids, int hidden, float scale) {
    pdl_begin();
    const bf16* row = table + (int64_t)ids[blockIdx.x] * hidden;
    float* o = out + (int64_t)blockIdx.x * hidden;
    for (int i = threadIdx.x * 8; i < hidden; i += blockDim.x * 8) {
        float v[8];
        load8(row + i, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] *= scale;
        *reinterpret_cast<float4*>(o + i) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(o + i + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
}

// Tokens that the previous step is still sampling when this one is queued (the engine runs one step ahead):
// ids[t] = sampled[src[t]] where src[t] >= 0, else ids[t] stays. Twin: backends.base.Backend.submit.
// Launch: grid (ceil(n / 256)), block 256; it runs before the embedding, on the same stream as the step that
// wrote `sampled`, so it reads that step's finished output.
extern "C" __global__ void resolve_tokens(int* __restrict__ ids, const int* __restrict__ src,
                                          const int* __restrict__ sampled, int n) {
    pdl_begin();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n && src[t] >= 0) ids[t] = sampled[src[t]];
}
