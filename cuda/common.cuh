// Helpers shared by the kernels: 16-byte bf16 vectors, fp8 (e4m3) conversions, the MLP's gated activations and
// warp/block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef uint8_t e4m3;  // an fp8 KV cache entry: its e4m3 code (twin: model/dtypes.py)

// A compile job may build only some kernels of a file (backends/cuda/kernel_cache.py: SPLIT_FILES): it defines
// SELECT_KERNELS and KEEP_<kernel> for each one it builds, and the file builds a kernel `#if KEEPS(kernel)`. Without
// SELECT_KERNELS a file builds all of its kernels.
#ifndef SELECT_KERNELS
#define KEEP_ALL 1
#endif
#define KEEPS(name) (KEEP_ALL || KEEP_##name)

// Programmatic dependent launch (sm_90+; kernels.py launches every kernel with it). A kernel may then start while
// the kernel before it on the stream still runs, so it must wait (grid_dependency_wait) before it touches global
// memory another kernel writes or reads: the wait returns once the previous kernel has finished and its writes are
// visible. It lets the next kernel launch first (allow_dependents_launch): that kernel's blocks are then resident
// and waiting when this one ends, instead of a launch latency at every one of a decode step's ~180 kernel
// boundaries. Blocks of the next kernel launch only after all of this kernel's blocks started, so they never take
// an SM this kernel still needs. gemv lets it launch at its start too, so the next kernel's blocks are resident,
// and their first loads in flight, when the GEMV ends. attention_decode lets it launch only after its loop: its
// next kernel, attention_combine, lets the O GEMV launch at once, whose weight loads would then compete with
// attention's streaming (docs/PERFORMANCE.md, Decisions: "gemv's launch point", "attention_decode's launch
// point"). Both calls are no-ops in a launch without the attribute and before sm_90.
// ptxas treats a non-coherent load (__ldg, or a const __restrict__ pointer) as free to move, above the wait too:
// a kernel reads what the previous kernel wrote with plain loads where ptxas would otherwise hoist them
// (tests/gpu/test_pdl.py reads the machine code of every kernel for that).
__device__ __forceinline__ void allow_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// How every kernel begins, gemv and attention_decode excepted (gemv streams its weights between the two;
// attention_decode lets the next kernel launch only after its loop): the next kernel may launch, and nothing is read
// or written before the previous one is done.
__device__ __forceinline__ void pdl_begin() {
    allow_dependents_launch();
    grid_dependency_wait();
}

// Eight bf16 (16 bytes): the unit of every vectorized global load and store.
__device__ __forceinline__ void load8(const bf16* p, float out[8]) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void store8(bf16* p, const float in[8]) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
}

// Eight e4m3 codes (8 bytes) -> eight bf16, exactly: every e4m3 value (subnormals too) is a half and a bf16.
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(uint2 codes) {
    uint4 out;
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&codes);
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        h[i] = __float22bfloat162_rn(__half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3))));
    return out;
}

// Eight e4m3 codes -> their values as eight f16 (exact): the FP8 GEMV's x (gemv_kernel.cuh), which the kernel
// that writes x stores so.
__device__ __forceinline__ uint4 e4m3x8_to_f16x8(uint2 codes) {
    uint4 out;
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&codes);
    uint32_t* words = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3);
        words[i] = (uint32_t)h.x | ((uint32_t)h.y << 16);
    }
    return out;
}

// The e4m3 scale of a row of W8A8 (fp8.cu) whose largest |value| is amax: amax / 448, or 1 for an all-zero row (so
// that it quantizes to zeros). Twin: model/fp8.py e4m3_scale.
__device__ __forceinline__ float fp8_scale(float amax) { return amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f; }

// Eight floats times `scale` -> eight e4m3 codes, rounded to nearest even and saturated to +-448 (satfinite).
__device__ __forceinline__ uint2 f32x8_to_e4m3x8(const float x[8], float scale) {
    uint2 out;
    __nv_fp8x2_storage_t* pairs = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(x[2 * i] * scale, x[2 * i + 1] * scale), __NV_SATFINITE,
                                            __NV_E4M3);
    return out;
}

// The gate's activation times up, in float32: silu(g) = g / (1 + exp(-g)) (SwiGLU), or HF's gelu_pytorch_tanh,
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (GeGLU, Gemma). Shared by activation.cu and gemv.cu's epilogue.
struct Silu {
    static __device__ __forceinline__ float apply(float g, float u) { return g / (1.f + expf(-g)) * u; }
};

struct GeluTanh {
    static __device__ __forceinline__ float apply(float g, float u) {
        const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        return 0.5f * g * (1.f + tanhf(inner)) * u;
    }
};

// Reductions over a warp or a block, of an operation given as a type: Sum or Max.
struct Sum {
    static __device__ __forceinline__ float identity() { return 0.f; }
    static __device__ __forceinline__ float apply(float a, float b) { return a + b; }
};

struct Max {
    static __device__ __forceinline__ float identity() { return -INFINITY; }
    static __device__ __forceinline__ float apply(float a, float b) { return fmaxf(a, b); }
};

template <class Op>
__device__ __forceinline__ float warp_reduce(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Op over the whole block, returned to every thread. `scratch` holds 32 floats; the leading barrier lets a block
// call this back to back with the same scratch.
template <class Op>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
    v = warp_reduce<Op>(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_reduce<Op>(lane < num_warps ? scratch[lane] : Op::identity());
}
