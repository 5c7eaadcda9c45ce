// Random bf16 weights made on the GPU: value i of a tensor is table[bits(i) >> 16], bits(i) =
// lowbias32(lowbias32(i + k1) ^ k2) in uint32 arithmetic, table 2^16 bf16 values (normal samples, scaled).
// Twin: model/dummy.py RandomBf16Weights.stored (RandomRecipe).
#include "common.cuh"

// Chris Wellons' lowbias32 integer hash (dummy.py lowbias32).
__device__ __forceinline__ unsigned int lowbias32(unsigned int x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// out [n] (n < 2^31); k1, k2: the recipe's uint32 keys as int bits. Launch: a grid-stride loop, block 256.
extern "C" __global__ void random_bf16(bf16* __restrict__ out, const bf16* __restrict__ table, int n, int k1,
                                       int k2) {
    pdl_begin();
    const unsigned int stride = gridDim.x * blockDim.x;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < (unsigned int)n; i += stride)
        out[i] = table[lowbias32(lowbias32(i + (unsigned int)k1) ^ (unsigned int)k2) >> 16];
}
