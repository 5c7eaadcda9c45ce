// Rotary position embedding, rotate-half layout.  Twin: numpy_backend.apply_rope.
#include "common.cuh"

// In place on the q and k heads at the front of each fused qkv row: for head h and j < D/2,
//   (x[j], x[j + D/2]) <- (x[j] cos - x[j + D/2] sin, x[j + D/2] cos + x[j] sin),  angle = pos * inv_freq[j].
// cos_sin [max_positions, D/2] is computed once on the host in float64 from rope_inv_freq, so Llama 3's frequency
// scaling costs nothing here and long positions keep their precision.
// Launch: grid (T), block 128; threads stride over the (head, j) pairs of the row: consecutive threads touch
// consecutive j, so loads coalesce.
extern "C" __global__ void rope(bf16* __restrict__ qkv, const int* __restrict__ positions,
                                const float2* __restrict__ cos_sin, int num_rotated_heads, int head_dim,
                                int row_stride) {
    pdl_begin();
    const int half = head_dim / 2;
    const float2* cs = cos_sin + (int64_t)positions[blockIdx.x] * half;
    bf16* row = qkv + (int64_t)blockIdx.x * row_stride;
    for (int i = threadIdx.x; i < num_rotated_heads * half; i += blockDim.x) {
        const int j = i % half;
        bf16* x = row + (i / half) * head_dim;
        const float x1 = __bfloat162float(x[j]), x2 = __bfloat162float(x[j + half]);
        const float2 c = cs[j];
        x[j] = __float2bfloat16(x1 * c.x - x2 * c.y);
        x[j + half] = __float2bfloat16(x2 * c.x + x1 * c.y);
    }
}
