// Token embedding gather.  Twin: numpy_backend.NumpyBackend.forward, `x = self.embed[batch.token_ids]`.
#include "common.cuh"

// out[t, :] = float(table[ids[t], :]): the bf16 embedding row widened into the float32 residual stream.
// Launch: grid (T), block 256; each thread moves 8 elements (one 16-byte load) per step. hidden % 8 == 0.
extern "C" __global__ void embedding(float* __restrict__ out, const bf16* __restrict__ table,
                                     const int* __restrict__ ids, int hidden) {
    const bf16* row = table + (int64_t)ids[blockIdx.x] * hidden;
    float* o = out + (int64_t)blockIdx.x * hidden;
    for (int i = threadIdx.x * 8; i < hidden; i += blockDim.x * 8) {
        float v[8];
        load8(row + i, v);
        *reinterpret_cast<float4*>(o + i) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(o + i + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
}
