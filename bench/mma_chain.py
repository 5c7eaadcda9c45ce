"""The pace of one chain of dependent mma.sync m16n8k16 (bf16 in, float32 accumulator): the floor of gemv_chain
(cuda/gemv_chain.cu), whose every output adds k / 16 such mmas one after another (the batch-invariant order).

    python bench/mma_chain.py [--steps 4096]

Prints clock cycles per mma of a chain held in registers (1, 2 or 4 independent chains in a warp, 1-8 warps a
block, a block on every SM), then of a chain whose A fragments come by ldmatrix from shared memory and whose B
fragments come from global memory (L1-resident) each step, loaded 0, 1 or 3 steps before their mma: what feeding
the chain costs. Cycles are the SM clock's (clock64), the median over the warps.
"""

from __future__ import annotations

import argparse

import numpy as np
import pycuda.autoinit  # noqa: F401
import pycuda.driver as cuda
from pycuda.compiler import SourceModule

SOURCE = r"""
#include <cstdint>
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ void report(float* out, long long* cycles, float sum, long long t) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;  // keeps the chain
    if (threadIdx.x % 32 == 0) cycles[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = t;
}
// CHAINS independent chains, operands in registers
template <int CHAINS>
__device__ void registers(float* out, long long* cycles, int steps) {
    const uint32_t a[4] = {0x3f803f80u + threadIdx.x, 0x3f803f81u, 0x3f803f82u, 0x3f803f83u};
    float c[CHAINS][4] = {};
    const long long t0 = clock64();
    for (int i = 0; i < steps; i += 16)
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int q = 0; q < CHAINS; ++q) mma(c[q], a, 0x3c003c00u ^ j, 0x3c003c00u + q);
    const long long t1 = clock64();
    float sum = 0.f;
    for (int q = 0; q < CHAINS; ++q) sum += c[q][0] + c[q][1] + c[q][2] + c[q][3];
    report(out, cycles, sum, t1 - t0);
}
// one chain fed each step: A by ldmatrix from a 16 x 256 tile in shared memory, B from x, AHEAD steps early
template <int AHEAD>
__device__ void fed(float* out, long long* cycles, int steps, const uint32_t* x) {
    __shared__ __align__(16) uint16_t tile[16 * 264];
    for (int i = threadIdx.x; i < 16 * 264; i += blockDim.x) tile[i] = 0x3f80 + (i & 7);
    __syncthreads();
    const int lane = threadIdx.x % 32;
    const uint16_t* base = tile + (lane % 16) * 264 + (lane / 16) * 8;
    uint32_t a[AHEAD + 1][4], b[AHEAD + 1][2];
    auto load = [&](int j, uint32_t (&af)[4], uint32_t (&bf)[2]) {
        const unsigned at = (unsigned)__cvta_generic_to_shared(base + 16 * (j % 16));
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(af[0]), "=r"(af[1]), "=r"(af[2]), "=r"(af[3]) : "r"(at));
        bf[0] = x[(j * 8 + lane) % 1024];
        bf[1] = x[(j * 8 + lane + 4) % 1024];
    };
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) load(u, a[u], b[u]);
    float c[4] = {};
    const long long t0 = clock64();
    for (int i = 0; i < steps; i += AHEAD + 1)
#pragma unroll
        for (int u = 0; u <= AHEAD; ++u) {
            load(i + u + AHEAD, a[(u + AHEAD) % (AHEAD + 1)], b[(u + AHEAD) % (AHEAD + 1)]);
            mma(c, a[u], b[u][0], b[u][1]);
        }
    const long long t1 = clock64();
    report(out, cycles, c[0] + c[1] + c[2] + c[3], t1 - t0);
}
extern "C" __global__ void registers1(float* o, long long* c, int s, const uint32_t*) { registers<1>(o, c, s); }
extern "C" __global__ void registers2(float* o, long long* c, int s, const uint32_t*) { registers<2>(o, c, s); }
extern "C" __global__ void registers4(float* o, long long* c, int s, const uint32_t*) { registers<4>(o, c, s); }
extern "C" __global__ void fed0(float* o, long long* c, int s, const uint32_t* x) { fed<0>(o, c, s, x); }
extern "C" __global__ void fed1(float* o, long long* c, int s, const uint32_t* x) { fed<1>(o, c, s, x); }
extern "C" __global__ void fed3(float* o, long long* c, int s, const uint32_t* x) { fed<3>(o, c, s, x); }
"""


def cycles_per_step(kernel, steps: int, warps: int, blocks: int, x) -> float:
    """Median over the warps of clock cycles per mma of one chain, after two warm-up launches."""
    out = cuda.mem_alloc(4 * 32 * warps * blocks)
    cycles = np.zeros(warps * blocks, np.int64)
    cycles_dev = cuda.mem_alloc(cycles.nbytes)
    for _ in range(3):
        kernel(out, cycles_dev, np.int32(steps), x, block=(32 * warps, 1, 1), grid=(blocks, 1))
    cuda.Context.synchronize()
    cuda.memcpy_dtoh(cycles, cycles_dev)
    return float(np.median(cycles)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4096, help="mmas per chain (a multiple of 16)")
    args = parser.parse_args()
    device = cuda.Context.get_device()
    blocks = device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
    print(f"{device.name()}: {blocks} SMs, clock {device.get_attribute(cuda.device_attribute.CLOCK_RATE) / 1e6} GHz")
    module = SourceModule(SOURCE, options=["-O3"], no_extern_c=True)
    x = cuda.mem_alloc(4096)
    cuda.memset_d32(x, 0x3C003C00, 1024)
    for chains in (1, 2, 4):
        kernel = module.get_function(f"registers{chains}")
        paces = [cycles_per_step(kernel, args.steps, warps, blocks, x) for warps in (1, 2, 4, 8)]
        print(f"{chains} chain(s) a warp in registers, 1/2/4/8 warps a block: "
              + " / ".join(f"{p:.1f}" for p in paces) + " cycles a step")
    for ahead in (0, 1, 3):
        kernel = module.get_function(f"fed{ahead}")
        paces = [cycles_per_step(kernel, args.steps, warps, blocks, x) for warps in (1, 4)]
        print(f"1 chain fed by ldmatrix + global loads {ahead} step(s) ahead, 1/4 warps a block: "
              + " / ".join(f"{p:.1f}" for p in paces) + " cycles a step")


if __name__ == "__main__":
    main()
