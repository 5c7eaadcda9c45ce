// The bf16 GEMVs for decode (m <= 8): gemv_kernel.cuh's template with bf16 weights, each kernel in two forms (plain
// and `_pipelined`, see there). backends/cuda/ops.py picks the form and `split` and launches them.
#include "gemv_kernel.cuh"

// Each kernel in two forms: plain, 2 blocks per SM (128 registers), and `_pipelined`, one block per SM (see the top).
#define GEMV_BF16(SUFFIX, PIPELINED, MIN_BLOCKS)                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                       \
    gemv_bf16##SUFFIX(bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int split, int accumulate) {    \
        gemv<bf16, Ungated, PIPELINED, bf16, bf16>(out, x, w, nullptr, nullptr, m, n, k, split, accumulate);                       \
    }
#define GEMV_F32(SUFFIX, PIPELINED, MIN_BLOCKS)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                       \
    gemv_f32##SUFFIX(float* out, const bf16* x, const bf16* w, int m, int n, int k, int split, int accumulate) {    \
        gemv<float, Ungated, PIPELINED, bf16, bf16>(out, x, w, nullptr, nullptr, m, n, k, split, accumulate);                      \
    }
// out [m, n / 2] = Act(x . w^T) (SwiGLU: swiglu, GeGLU: geglu), w the gate/up projection with its rows interleaved in
// groups of 8 (8 gate rows, then the same units' 8 up rows; backends/cuda/forward.py packs it so)
#define GEMV_GATED(NAME, ACT, SUFFIX, PIPELINED, MIN_BLOCKS)                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS)                                       \
    gemv_##NAME##_bf16##SUFFIX(bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int split) {           \
        gemv<bf16, ACT, PIPELINED, bf16, bf16>(out, x, w, nullptr, nullptr, m, n, k, split, 0);                                    \
    }
#if KEEPS(gemv_bf16)
GEMV_BF16(, false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_f32)
GEMV_F32(, false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_swiglu_bf16)
GEMV_GATED(swiglu, Silu, , false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_geglu_bf16)
GEMV_GATED(geglu, GeluTanh, , false, GEMV_MIN_BLOCKS)
#endif
#if KEEPS(gemv_bf16_pipelined)
GEMV_BF16(_pipelined, true, 1)
#endif
#if KEEPS(gemv_f32_pipelined)
GEMV_F32(_pipelined, true, 1)
#endif
#if KEEPS(gemv_swiglu_bf16_pipelined)
GEMV_GATED(swiglu, Silu, _pipelined, true, 1)
#endif
#if KEEPS(gemv_geglu_bf16_pipelined)
GEMV_GATED(geglu, GeluTanh, _pipelined, true, 1)
#endif
