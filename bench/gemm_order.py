"""Which order of additions gives cuBLASLt's bits (docs/PERFORMANCE.md, "Batch-invariant mode").

For each (n, k): x [512, k] and w [n, k] random bf16. Reference kernels below compute out = x . w^T with mma.sync
m16n8k16 in a chosen order; every split-free cuBLASLt algorithm the heuristics offer at several row counts computes
the same, into float32. Printed: per algorithm (its tile and stages ids), whether its rows equal each reference
bit for bit. Run on the GPU: python3 bench/gemm_order.py
"""

from __future__ import annotations

import ctypes

import numpy as np

SOURCE = r"""
#include <cuda_bf16.h>
#include <stdint.h>
__device__ __forceinline__ void mma(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pair(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }
// One warp a 16x8 tile. w_as_a: A = 16 rows of w, B = 8 rows of x; else A = 16 rows of x, B = 8 rows of w.
// order 0: one accumulator over k in natural order; 1: two accumulators alternating k16 steps, summed at the end;
// 2: k in 4 parts, each from zero, summed in order.
extern "C" __global__ void chain(float* out, const __nv_bfloat16* x, const __nv_bfloat16* w, int m, int n, int k,
                                 int w_as_a, int order) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int rows_a = w_as_a ? n : m, rows_b = w_as_a ? m : n;
    const int tiles_a = rows_a / 16;
    const int ta = tile % tiles_a, tb = tile / tiles_a;
    if (tb * 8 >= rows_b) return;
    const __nv_bfloat16* A = w_as_a ? w : x;
    const __nv_bfloat16* B = w_as_a ? x : w;
    const __nv_bfloat16* a_lo = A + (int64_t)(ta * 16 + g) * k;
    const __nv_bfloat16* a_hi = A + (int64_t)(ta * 16 + g + 8) * k;
    const __nv_bfloat16* b = B + (int64_t)(tb * 8 + g) * k;
    float c[3][4] = {};
    const int steps = k / 16, part = steps / 4;
    for (int s = 0; s < steps; ++s) {
        const int k0 = s * 16 + 2 * t;
        float* acc = order == 1 ? c[s & 1] : c[0];
        mma(acc, pair(a_lo + k0), pair(a_hi + k0), pair(a_lo + k0 + 8), pair(a_hi + k0 + 8), pair(b + k0),
            pair(b + k0 + 8));
        if (order == 2 && (s + 1) % part == 0) {
            for (int j = 0; j < 4; ++j) { c[2][j] += c[0][j]; c[0][j] = 0.f; }
        }
    }
    float r[4];
    for (int j = 0; j < 4; ++j) r[j] = order == 1 ? c[0][j] + c[1][j] : order == 2 ? c[2][j] : c[0][j];
    // c: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1) of the A-rows x B-rows tile
    for (int j = 0; j < 4; ++j) {
        const int ra = ta * 16 + g + 8 * (j >> 1), rb = tb * 8 + 2 * t + (j & 1);
        const int row = w_as_a ? rb : ra, col = w_as_a ? ra : rb;  // out [m, n]
        if (row < m && col < n) out[(int64_t)row * n + col] = r[j];
    }
}
"""

SHAPES = [(2048, 2048), (3072, 2048), (16384, 2048), (2048, 8192), (960, 576)]
ROWS = [512, 256, 64, 16, 8, 1]
CANDIDATES = 16


def main() -> None:
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    from tinyvllm.backends.cuda import cublas
    from tinyvllm.backends.cuda.device import Device
    from tinyvllm.model.dtypes import f32_to_bf16

    device = Device(0)
    kernel = SourceModule(SOURCE, no_extern_c=True, arch="sm_90").get_function("chain")
    stream = device.stream()
    workspace = cuda.mem_alloc(32 << 20)
    blas = cublas.Cublas(stream.handle, int(workspace), 32 << 20, invariant=True)
    rng = np.random.default_rng(0)
    rows = max(ROWS)
    for n, k in SHAPES:
        x_bits = f32_to_bf16(rng.standard_normal((rows, k), dtype=np.float32))
        w_bits = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32) * 0.05)
        x, w = cuda.to_device(x_bits), cuda.to_device(w_bits)
        out = cuda.mem_alloc(rows * n * 4)

        def reference(w_as_a: int, order: int) -> np.ndarray:
            tiles = (n // 16) * (rows // 8) if w_as_a else (rows // 16) * (n // 8)
            kernel(out, x, w, np.int32(rows), np.int32(n), np.int32(k), np.int32(w_as_a), np.int32(order),
                   block=(128, 1, 1), grid=(-(-tiles // 4), 1))
            cuda.Context.synchronize()
            return cuda.from_device(out, (rows, n), np.float32).view(np.uint32).copy()

        refs = {f"w-as-A order{o}": reference(1, o) for o in (0, 1, 2)}
        refs["x-as-A order0"] = reference(0, 0)
        names = list(refs)

        def equal(got: np.ndarray, name: str) -> bool:
            r = min(len(got), len(refs[name]))
            return np.array_equal(got[:r], refs[name][:r])

        print(f"n={n} k={k}: references equal to w-as-A order0: "
              + ", ".join(f"{name} {equal(refs[names[0]], name)}" for name in names[1:]))
        for m in ROWS:
            algos = blas._heuristics(m, n, k, cublas.BF16_GEMM_F32_OUT, CANDIDATES)
            a, b, c = blas._layouts_for(m, n, k, cublas.BF16_GEMM_F32_OUT)
            verdicts = []
            for i, algo in enumerate(algos):
                pinned = cublas.pinned_split_free(algo)
                cuda.memset_d32(out, 0x7FC00000, rows * n)
                status = blas._matmul(pinned, int(out), int(x), int(w), a, b, c, False)
                stream.synchronize()
                if status != 0:
                    verdicts.append(f"{i}:refused")
                    continue
                got = cuda.from_device(out, (rows, n), np.float32).view(np.uint32)[:m]
                same = [name for name in names if equal(got, name)]
                ids = algo_ids(cublas, algo)
                verdicts.append(f"{i}:{ids}:{'+'.join(same) or 'none'}")
            print(f"  m={m}: " + "  ".join(verdicts))
        for buf in (x, w, out):
            buf.free()


def algo_ids(cublas, algo) -> str:
    """An algorithm's id, tile and stages (cuBLASLt's ALGO_CONFIG 0, 1, 4: ID, TILE_ID, STAGES_ID)."""
    values = []
    for attribute in (0, 1, 4):
        value, written = ctypes.c_uint32(), ctypes.c_size_t()
        cublas._lib().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value),
                                                           ctypes.sizeof(value), ctypes.byref(written))
        values.append(value.value)
    return "/".join(map(str, values))


if __name__ == "__main__":
    main()
