"""gemv_serial (cuda/gemv_serial.cu) at other geometries than ops.py's: SERIAL_WARPS, SERIAL_K, SERIAL_STAGES.

Each variant is compiled here (pycuda, without programmatic launch), timed at m = 1 on Llama-3.2-1B's shapes with
bench/gemv.py's timer (weights from HBM, host latency hidden), and checked bit for bit against the first variant
(the geometry must not change the chain of additions). Run on the GPU: python3 bench/gemv_serial_tune.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
LATENCY_SOURCE = r"""
#include <cuda_bf16.h>
#include <stdint.h>
// cycles per mma.sync m16n8k16 (bf16, f32 accumulate) in one chain of `iters` dependent mmas, and in CHAINS
// independent chains interleaved
template <int CHAINS>
__device__ void chains(long long* cycles, float* sink, int iters) {
    float c[CHAINS][4] = {};
    const uint32_t a = 0x3C003C00u + threadIdx.x, b = 0x3C003C00u ^ threadIdx.x;
    const long long start = clock64();
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < CHAINS; ++j)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};\n" : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                         : "r"(a), "r"(b), "r"(a), "r"(b), "r"(a), "r"(b));
    }
    const long long end = clock64();
    float total = 0.f;
    for (int j = 0; j < CHAINS; ++j) total += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    sink[threadIdx.x] = total;
    if (threadIdx.x == 0) *cycles = end - start;
}
extern "C" __global__ void one_chain(long long* cycles, float* sink, int iters) { chains<1>(cycles, sink, iters); }
extern "C" __global__ void four_chains(long long* cycles, float* sink, int iters) { chains<4>(cycles, sink, iters); }
"""
VARIANTS = [(1, 256, 6), (1, 256, 2), (4, 128, 4), (8, 64, 6)]


def build(warps: int, k: int, stages: int):
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    defines = {"GEMV_WARPS": 8, "GEMV_UNROLL": 8, "SERIAL_WARPS": warps, "SERIAL_K": k, "SERIAL_STAGES": stages}
    module = SourceModule((CUDA_DIR / "gemv_serial.cu").read_text(), no_extern_c=True, arch="sm_90",
                          include_dirs=[str(CUDA_DIR)],
                          options=["-O3", "-std=c++17", *(f"-D{name}={value}" for name, value in defines.items())])
    function = module.get_function("gemv_serial_f32")
    shared = stages * (warps * 16 + 8) * (k + 8) * 2
    function.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
    return module, function, shared


def latency() -> None:
    """Cycles per dependent mma.sync, one warp alone on the GPU."""
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    module = SourceModule(LATENCY_SOURCE, no_extern_c=True, arch="sm_90")
    cycles, sink = cuda.mem_alloc(8), cuda.mem_alloc(128)
    for name, chains in (("one_chain", 1), ("four_chains", 4)):
        iters = 4096
        module.get_function(name)(cycles, sink, np.int32(iters), block=(32, 1, 1), grid=(1, 1))
        cuda.Context.synchronize()
        spent = cuda.from_device(cycles, (1,), np.int64)[0]
        print(f"mma.sync m16n8k16 bf16: {chains} chain(s) of {iters}: {spent / iters / chains:.1f} cycles per mma "
              f"({spent / iters:.1f} per round)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    import pycuda.driver as cuda

    from gemv import Timer
    from tinyvllm.backends.cuda.device import Device

    device = Device(0)
    stream = device.stream()
    timer = Timer(stream, args.runs)
    rng = np.random.default_rng(0)
    buffers = {}
    for name, (n, k) in SHAPES.items():
        copies = max(1, (256 << 20) // (n * k * 2))
        w = [cuda.to_device((rng.standard_normal((n, k), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))
             for _ in range(1)] + [cuda.mem_alloc(n * k * 2) for _ in range(copies - 1)]
        for c in w[1:]:
            cuda.memcpy_dtod(c, w[0], n * k * 2)
        x = cuda.to_device((rng.standard_normal((8, k), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))
        buffers[name] = (w, x, cuda.mem_alloc(8 * n * 4))
    latency()
    first: dict[str, np.ndarray] = {}
    for warps, k_stage, stages in VARIANTS:
        _, function, shared = build(warps, k_stage, stages)
        line = []
        for name, (n, k) in SHAPES.items():
            w, x, out = buffers[name]
            grid = (-(-n // (16 * warps)), 1)

            def launch(i: int, m: int = 1) -> None:
                function(out, x, w[i % len(w)], np.int32(m), np.int32(n), np.int32(k), np.int32(0),
                         block=(32 * warps, 1, 1), grid=grid, shared=shared, stream=stream)

            us = timer.median_us(launch)
            launch(0, 8)
            stream.synchronize()
            bits = cuda.from_device(out, (8, n), np.float32).view(np.uint32)
            same = np.array_equal(bits, first.setdefault(name, bits))
            line.append(f"{name} {us:6.1f} us {n * k * 2 / us / 1e3:5.0f} GB/s{'' if same else ' BITS DIFFER'}")
        print(f"warps {warps} k {k_stage:3d} stages {stages} ({shared // 1024} KB): " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
