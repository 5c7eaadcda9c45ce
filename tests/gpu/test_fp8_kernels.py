"""The FP8 W8A8 kernels (cuda/fp8.cu) and Linear's e4m3 path against their numpy twins (model/fp8.py quantize_rows,
backends/host_weight.py's fp8 product) on fresh random inputs; outputs start poisoned (NaN, 0x7F codes), so that
unwritten elements show. Lines starting with REPORT carry measured errors (pytest -s).

Quantization is bit-exact (both multiply by the IEEE float32 inverse of amax / 448 and round to nearest even, in
quantize_fp8, quantize_fp8_values and rms_norm alike); the products of e4m3 values are exact in float32 on both sides, so
a product differs from its twin only by its summation order (and cuBLASLt's FP8 tensor-core accumulation).
"""

import numpy as np
import pytest

from test_kernels import ATTN_SHAPES, Gpu, bf16_round, cache_setup
from test_kv_fp8_cuda import random_codes
from tinyvllm.backends.cuda.ops import GEMV_MAX_ROWS as MAX_ROWS
from tinyvllm.backends.cuda.ops import QuantizedOutput
from tinyvllm.backends.cuda.tensors import BF16, E4M3, F16, F32, DeviceTensor
from tinyvllm.backends.host_weight import HostWeight
from tinyvllm.backends.host_weight import linear as host_linear
from tinyvllm.backends.numpy_backend import interleave_gate_up, silu_and_mul
from tinyvllm.model.dtypes import bf16_to_f32, e4m3_to_f32, f32_to_bf16
from tinyvllm.model.fp8 import Fp8Rows, e4m3_codes, e4m3_scale, quantize_activations, quantize_rows

pytestmark = pytest.mark.gpu

WORKSPACE_BYTES = 32 << 20
MAX_T, MAX_K, MAX_N = 320, 14336, 28672  # the scratch buffers: up to Llama-3.1-8B's widths
MODES = [(False, False), (True, False), (True, True)]  # (out_fp32, accumulate): QKV / gate_up; O and down's +=


def rel_err(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def bf16_rows(rng, shape, octaves=6.0):
    """bf16-exact float32 values whose rows differ in magnitude by up to 2^octaves (so that per-row scales
    matter); row 0 is all zeros where there are several rows (its scale must be 1, its codes 0)."""
    x = rng.standard_normal(shape, dtype=np.float32) * np.exp2(rng.uniform(-octaves, 0, (shape[0], 1)))
    if shape[0] > 1:
        x[0] = 0
    return bf16_to_f32(f32_to_bf16(x.astype(np.float32)))


@pytest.mark.parametrize("rows,cols", [(1, 8), (7, 2048), (33, 14336), (300, 520), (3, 4104)])
def test_quantize_fp8_is_bit_exact(cuda, ops, rows, cols):
    gpu, rng = Gpu(cuda), np.random.default_rng(rows * 100_003 + cols)
    x = bf16_rows(rng, (rows, cols))
    codes, scales = gpu.put(np.full((rows, cols), 0x7F, np.uint8)), gpu.poisoned((rows,), np.float32)
    ops.quantize_fp8(codes, scales, gpu.bf16(x), rows, cols)
    want = quantize_rows(x)
    np.testing.assert_array_equal(gpu.get(scales, (rows,), np.float32), want.scale)
    np.testing.assert_array_equal(gpu.get(codes, (rows, cols), np.uint8), want.codes)


@pytest.mark.parametrize("rows,cols", [(1, 8), (8, 2048), (300, 14336)])
def test_quantize_fp8_values_is_bit_exact(cuda, ops, rows, cols):
    """The FP8 GEMV's x: quantize_rows's codes as f16 values (exact), and its scales."""
    gpu, rng = Gpu(cuda), np.random.default_rng(rows + cols)
    x = bf16_rows(rng, (rows, cols), 12.0)
    values, scales = gpu.poisoned((rows, cols), np.uint16), gpu.poisoned((rows,), np.float32)
    ops.quantize_fp8_values(values, scales, gpu.bf16(x), rows, cols)
    want = quantize_rows(x)
    np.testing.assert_array_equal(gpu.get(scales, (rows,), np.float32), want.scale)
    np.testing.assert_array_equal(gpu.get(values, (rows, cols), np.float16), e4m3_to_f32(want.codes).astype(np.float16))


@pytest.mark.parametrize("values", [True, False])
@pytest.mark.parametrize("shape", ["d64-gqa3", "d128-gqa4", "d256-gqa16", "d128-heads64"])
@pytest.mark.parametrize("num_seqs,splits", [(1, 13), (37, 8)])
def test_attention_combine_quantize_is_the_merge_then_quantize(cuda, ops, shape, num_seqs, splits, values):
    """attention_decode's merge writing O's input quantized gives the bits of attention_combine then
    quantize_fp8(_values), which are quantize_rows of the merged bf16 rows: one context of 3001 keys in up to 13
    parts, or 37 of 1-999 keys (the shortest in one part, written by attention_decode and read by the merge)."""
    head_dim, heads, kv_heads = ATTN_SHAPES.get(shape, (128, 64, 8))  # heads64: rows of 8,192, the most it takes
    gpu, rng = Gpu(cuda), np.random.default_rng(num_seqs + splits + head_dim + heads)
    context_lens = (np.array([3001]) if num_seqs == 1 else rng.integers(1, 1000, num_seqs)).astype(np.int32)
    k, v, tables = cache_setup(rng, context_lens, kv_heads, head_dim, 16)
    width, cols = (heads + 2 * kv_heads) * head_dim, heads * head_dim
    qkv = gpu.bf16(bf16_round(rng.standard_normal((num_seqs, width), dtype=np.float32) * 3))
    args = (qkv, gpu.bf16(k), gpu.bf16(v), gpu.put(tables), gpu.put(np.array([tables.shape[1]], np.int32)),
            gpu.put(context_lens), num_seqs, head_dim ** -0.5, heads, kv_heads, head_dim, 16, width, splits)

    def decode(quantized=None):
        out = gpu.poisoned((num_seqs, cols), np.uint16)
        partial_o = gpu.poisoned((num_seqs * heads * splits, head_dim), np.float32)
        partial_ml = gpu.poisoned((num_seqs * heads * splits, 2), np.float32)
        return out, ops.attention_decode(out, partial_o, partial_ml, *args, quantized=quantized)

    out, merged = decode()
    merged_rows = gpu.get_bf16(out, (num_seqs, cols))
    codes_type = np.uint16 if values else np.uint8

    def poisoned_codes():  # f16 NaN values, or e4m3 NaN codes
        if values:
            return gpu.poisoned((num_seqs, cols), np.uint16)
        return gpu.put(np.full((num_seqs, cols), 0x7F, np.uint8))

    want_codes, want_scales = poisoned_codes(), gpu.poisoned((num_seqs,), np.float32)
    (ops.quantize_fp8_values if values else ops.quantize_fp8)(want_codes, want_scales, out, num_seqs, cols)
    want = quantize_rows(merged_rows)
    np.testing.assert_array_equal(gpu.get(want_scales, (num_seqs,), np.float32), want.scale)
    codes, scales = poisoned_codes(), gpu.poisoned((num_seqs,), np.float32)
    _, merged = decode(QuantizedOutput(codes, scales, values))
    assert merged and not decode()[1]  # quantized where it merged; without a target it writes out
    np.testing.assert_array_equal(gpu.get(scales, (num_seqs,), np.float32), want.scale)
    np.testing.assert_array_equal(gpu.get(codes, (num_seqs, cols), codes_type),
                                  gpu.get(want_codes, (num_seqs, cols), codes_type))


def quantized(gpu, x):
    """x as the FP8 GEMV takes it, from the twin: the f16 values of quantize_rows's codes and their scales (device
    pointers)."""
    xq = quantize_rows(x)
    return gpu.put(e4m3_to_f32(xq.codes).astype(np.float16)), gpu.put(xq.scale)


@pytest.mark.parametrize("out_fp32,accumulate", MODES + [(False, True)])
@pytest.mark.parametrize("m,n", [(1, 8), (9, 3072), (300, 2056)])
def test_scale_rows_cols(cuda, ops, m, n, out_fp32, accumulate):
    gpu, rng = Gpu(cuda), np.random.default_rng(m * 7 + n)
    acc = rng.standard_normal((m, n), dtype=np.float32) * 1000
    rs, cs = (np.exp2(rng.uniform(-12, -4, size)).astype(np.float32) for size in (m, n))
    ref = acc * rs[:, None] * cs[None, :]
    old = bf16_to_f32(f32_to_bf16(rng.standard_normal((m, n), dtype=np.float32) * np.std(ref)))
    if accumulate:
        ref = ref + old
    start = (old if accumulate else np.full((m, n), np.nan, np.float32)) if out_fp32 else (
        f32_to_bf16(old) if accumulate else np.full((m, n), 0x7FC0, np.uint16))
    out = gpu.put(start)
    ops.scale_rows_cols(out, gpu.put(acc), gpu.put(rs), gpu.put(cs), m, n, out_fp32, accumulate)
    atol = 1e-6 * np.abs(ref).max()  # a sum that cancels keeps the error of its terms (a fused multiply-add's)
    if out_fp32:
        np.testing.assert_allclose(gpu.get(out, (m, n), np.float32), ref, rtol=1e-6, atol=atol)
    else:  # one bf16 rounding of the float32 value
        np.testing.assert_allclose(gpu.get_bf16(out, (m, n)), ref, rtol=2 ** -8, atol=atol)


# (n, k): n = 1 and odd n (a warp's second row past n); k of one lane's 16 codes, with a tail past a warp's 512;
# Llama-3.2-1B's QKV, O, gate_up, down; Llama-3.1-8B's down
GEMV_SHAPES = [(1, 16), (37, 528), (1001, 2064), (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
               (4096, 14336)]


@pytest.fixture(scope="module")
def fp8_weights(cuda):
    """(n, k) -> (device e4m3 codes, their float32 values, device scales, the scales), made once per module."""
    made = {}

    def get(n, k):
        if (n, k) not in made:
            rng = np.random.default_rng(n * 7919 + k)
            codes, scales = random_codes(rng, (n, k)), np.exp2(rng.uniform(-10, -4, n)).astype(np.float32)
            made[n, k] = (cuda.to_device(codes), e4m3_to_f32(codes), cuda.to_device(scales), scales)
        return made[n, k]

    return get


@pytest.mark.parametrize("out_fp32,accumulate", MODES)
@pytest.mark.parametrize("n,k", GEMV_SHAPES)
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
def test_gemv_fp8(cuda, ops, fp8_weights, m, n, k, out_fp32, accumulate):
    """out = (e4m3(x) . w codes^T) * x_scale * w_scale (+ out), x quantized per row by quantize_rows (rows differing
    in magnitude, row 0 all zeros) and given as its codes' f16 values, w every e4m3 code but NaN."""
    gpu, rng = Gpu(cuda), np.random.default_rng(1000 * m + n + k)
    w_dev, w, ws_dev, ws = fp8_weights(n, k)
    x = bf16_rows(rng, (m, k))
    xq = quantize_rows(x)
    ref = (e4m3_to_f32(xq.codes) @ w.T) * xq.scale[:, None] * ws[None, :]
    old = bf16_to_f32(f32_to_bf16(rng.standard_normal((m, n), dtype=np.float32) * (np.std(ref) + 1e-30)))
    if accumulate:
        ref = ref + old
    start = (old if accumulate else np.full((m, n), np.nan, np.float32)) if out_fp32 else np.full((m, n), 0x7FC0,
                                                                                                    np.uint16)
    out = gpu.put(start)
    values, scales = quantized(gpu, x)
    ops.gemv_fp8(out, values, int(w_dev), int(ws_dev), scales, m, n, k, out_fp32, accumulate)
    got = gpu.get(out, (m, n), np.float32) if out_fp32 else gpu.get_bf16(out, (m, n))
    if m > 1 and not accumulate:  # x row 0 all zeros: its codes 0 (scale 1), so its outputs exactly 0
        assert np.all(got[0] == 0)
    assert rel_err(got, ref) < (1e-5 if out_fp32 else 1e-2)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("n,k", [(16, 528), (16384, 2048), (28672, 4096), (2048, 8192)])
@pytest.mark.parametrize("m", [1, 3, MAX_ROWS])
def test_gemv_gated_fp8(cuda, ops, fp8_weights, m, n, k, activation):
    """gemv_swiglu_fp8 / gemv_geglu_fp8: the activation of the scaled gate and up sums (each rounded to bf16, as
    the gate/up product is before silu_and_mul), rows interleaved in groups of 8 gate and 8 up."""
    from tinyvllm.backends.numpy_backend import gelu_tanh_and_mul

    gpu, rng = Gpu(cuda), np.random.default_rng(7 * m + n + k)
    w_dev, w, ws_dev, ws = fp8_weights(n, k)  # rows in the kernel's interleaved order
    x = bf16_rows(rng, (m, k))
    xq = quantize_rows(x)
    product = (e4m3_to_f32(xq.codes) @ w.T) * xq.scale[:, None] * ws[None, :]
    tiles = bf16_to_f32(f32_to_bf16(product)).reshape(m, n // 16, 2, 8)  # [m, tile, gate / up, unit]
    gate, up = (tiles[:, :, i].reshape(m, n // 2) for i in (0, 1))
    act = silu_and_mul if activation == "silu" else gelu_tanh_and_mul
    with np.errstate(over="ignore"):
        ref = act(np.concatenate([gate, up], axis=1))
    out = gpu.poisoned((m, n // 2), np.uint16)
    launch = ops.gemv_swiglu_fp8 if activation == "silu" else ops.gemv_geglu_fp8
    values, scales = quantized(gpu, x)
    launch(out, values, int(w_dev), int(ws_dev), scales, m, n, k)
    got = gpu.get_bf16(out, (m, n // 2))
    assert np.all(np.isfinite(got))
    assert rel_err(got[1:] if m > 1 else got, ref[1:] if m > 1 else ref) < 2e-2


@pytest.fixture(scope="module")
def fp8_linear(cuda, device, kernels):
    """Linear with its fp8 scratch buffers and a cuBLASLt handle, on a stream of its own."""
    from tinyvllm.backends.cuda.cublas import Cublas
    from tinyvllm.backends.cuda.linear import Fp8Scratch, Linear
    from tinyvllm.backends.cuda.ops import Ops

    stream = cuda.Stream()
    workspace = cuda.mem_alloc(WORKSPACE_BYTES)
    blas = Cublas(stream.handle, int(workspace), WORKSPACE_BYTES)
    sizes = (MAX_T * MAX_K, 4 * MAX_T, 4 * MAX_T * MAX_N, 2 * MAX_ROWS * MAX_K, 4 * MAX_T * MAX_K // 128)
    memory = [cuda.mem_alloc(size) for size in sizes]
    scratch = Fp8Scratch(DeviceTensor(int(memory[0]), E4M3, (MAX_T, MAX_K)),
                         DeviceTensor(int(memory[1]), F32, (MAX_T,)),
                         DeviceTensor(int(memory[2]), F32, (MAX_T, MAX_N)),
                         DeviceTensor(int(memory[3]), F16, (MAX_ROWS, MAX_K)),
                         DeviceTensor(int(memory[4]), F32, (MAX_T * MAX_K // 128,)))
    yield Linear(blas, Ops(kernels, stream, device.num_sms), fp8=scratch)
    blas.close()
    for allocation in [workspace, *memory]:
        allocation.free()


def upload_fp8_weight(gpu, ops, w):
    """w (bf16-exact [n, k]) as the backend loads it: bf16 on the GPU, quantized there (quantize_fp8)."""
    n, k = w.shape
    codes, scale = gpu.put(np.full((n, k), 0x7F, np.uint8)), gpu.poisoned((n,), np.float32)
    ops.quantize_fp8(codes, scale, gpu.bf16(w), n, k)
    return DeviceTensor(codes, E4M3, (n, k), DeviceTensor(scale, F32, (n,)))


# (n, k, out_fp32, accumulate): Llama-3.2-1B's QKV (bf16) and O (+= the float32 residual); odd sizes
LINEAR_SHAPES = [(3072, 2048, False, False), (2048, 2048, True, True), (1000, 2064, True, False), (48, 528, False,
                                                                                                    False)]


@pytest.mark.parametrize("n,k,out_fp32,accumulate", LINEAR_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, MAX_ROWS, MAX_ROWS + 1, 64, 300])
def test_linear_fp8_matches_the_host_twin(cuda, fp8_linear, m, n, k, out_fp32, accumulate):
    """bf16 x through Linear.gemm with a weight quantized on the GPU (gemv_fp8 for m <= 8, cuBLASLt's FP8 GEMM
    and scale_rows_cols above) against host_weight.linear of quantize_rows(w) (the numpy backend's product)."""
    gpu, rng = Gpu(cuda), np.random.default_rng(31 * m + n + k)
    w, x = bf16_rows(rng, (n, k), 3.0), bf16_rows(rng, (m, k))
    ref = host_linear(x, HostWeight.from_fp8(quantize_rows(w)))
    old = bf16_to_f32(f32_to_bf16(rng.standard_normal((m, n), dtype=np.float32) * (np.std(ref) + 1e-30)))
    if accumulate:
        ref = ref + old
    weight = upload_fp8_weight(gpu, fp8_linear.ops, w)
    start = (old if accumulate else np.full((m, n), np.nan, np.float32)) if out_fp32 else np.full((m, n), 0x7FC0,
                                                                                                    np.uint16)
    out = DeviceTensor(gpu.put(start), F32 if out_fp32 else BF16, (m, n))
    fp8_linear.gemm(out, DeviceTensor(gpu.bf16(x), BF16, (m, k)), weight, m, accumulate=accumulate)
    fp8_linear.ops.stream.synchronize()
    got = gpu.get(out.ptr, (m, n), np.float32) if out_fp32 else gpu.get_bf16(out.ptr, (m, n))
    err = rel_err(got, ref)
    scaled = [algo is not None for key, algo in fp8_linear.blas.algos.items() if key[:2] == (n, k) and
              key[-1] == "channel"]
    path = "gemv_fp8" if m <= MAX_ROWS else "cuBLASLt fp8, " + (
        "outer-vector scales" if any(scaled) else "unit scales + scale_rows_cols")
    print(f"REPORT fp8 linear m={m} n={n} k={k} ({path}, {'f32' if out_fp32 else 'bf16'} out): rel err {err:.2e}")
    assert err < (1e-3 if out_fp32 else 1e-2)


@pytest.mark.parametrize("m", [1, MAX_ROWS, MAX_ROWS + 1, 64])
def test_gate_up_swiglu_fp8(cuda, fp8_linear, m):
    """The gate/up projection with interleaved e4m3 rows, then SwiGLU, against numpy's SwiGLU of the host
    twin's product (rounded to bf16, as gate_up is). Beyond 8 rows the activation comes back quantized, as the down
    GEMM's e4m3 input: against the twin's activation through the same quantizer (quantize_activations)."""
    n, k = 16384, 2048
    gpu, rng = Gpu(cuda), np.random.default_rng(m)
    w, x = bf16_rows(rng, (n, k), 3.0), bf16_rows(rng, (m, k))
    with np.errstate(over="ignore"):
        ref = silu_and_mul(bf16_to_f32(f32_to_bf16(host_linear(x, HostWeight.from_fp8(quantize_rows(w))))))
    weight = upload_fp8_weight(gpu, fp8_linear.ops, interleave_gate_up(w.T).T)  # rows as the backend packs them
    out, gate_up = gpu.poisoned((m, n // 2), np.uint16), gpu.poisoned((m, n), np.uint16)
    codes = fp8_linear.gate_up_swiglu(DeviceTensor(out, BF16, (m, n // 2)), DeviceTensor(gpu.bf16(x), BF16, (m, k)),
                                      weight, m, DeviceTensor(gate_up, BF16, (m, n)), down_e4m3=True)
    fp8_linear.ops.stream.synchronize()
    if m <= MAX_ROWS:
        assert codes is None
        assert rel_err(gpu.get_bf16(out, (m, n // 2)), ref) < 2e-2
        return
    assert codes.dtype == E4M3 and codes.shape == (m, n // 2)
    got = e4m3_to_f32(gpu.get(codes.ptr, codes.shape, np.uint8)) * gpu.get(codes.scale.ptr, (m,), np.float32)[:, None]
    err = rel_err(got, quantize_activations(bf16_to_f32(f32_to_bf16(ref))))
    print(f"REPORT fp8 gate/up m={m}: the activation's e4m3 codes against the twin's, rel err {err:.2e}")
    assert err < 3e-2


@pytest.mark.parametrize("out_fp32,accumulate", MODES)
def test_linear_fp8_fallback_in_pieces(cuda, fp8_linear, monkeypatch, out_fp32, accumulate):
    """Where cuBLASLt has no outer-vector scales (an older cuBLASLt: gemm_scaled says so), the product runs with
    unit scales into the float32 accumulator and scale_rows_cols, in pieces of the rows that accumulator holds
    (here 64 of 300)."""
    from tinyvllm.backends.cuda.linear import Fp8Scratch, Linear

    m, n, k = 300, 2048, 2048
    monkeypatch.setattr(fp8_linear.blas, "gemm_scaled", lambda *args, **kwargs: False)
    s = fp8_linear.fp8
    linear = Linear(fp8_linear.blas, fp8_linear.ops, fp8=Fp8Scratch(s.codes, s.scales,
                                                                    DeviceTensor(s.acc.ptr, F32, (64, MAX_N)),
                                                                    s.values))
    gpu, rng = Gpu(cuda), np.random.default_rng(5 + out_fp32 + 2 * accumulate)
    w, x = bf16_rows(rng, (n, k), 3.0), bf16_rows(rng, (m, k))
    ref = host_linear(x, HostWeight.from_fp8(quantize_rows(w)))
    old = bf16_to_f32(f32_to_bf16(rng.standard_normal((m, n), dtype=np.float32) * np.std(ref)))
    if accumulate:
        ref = ref + old
    start = (old if accumulate else np.full((m, n), np.nan, np.float32)) if out_fp32 else np.full((m, n), 0x7FC0,
                                                                                                    np.uint16)
    out = DeviceTensor(gpu.put(start), F32 if out_fp32 else BF16, (m, n))
    linear.gemm(out, DeviceTensor(gpu.bf16(x), BF16, (m, k)), upload_fp8_weight(gpu, linear.ops, w), m,
                accumulate=accumulate)
    linear.ops.stream.synchronize()
    got = gpu.get(out.ptr, (m, n), np.float32) if out_fp32 else gpu.get_bf16(out.ptr, (m, n))
    assert rel_err(got, ref) < (1e-3 if out_fp32 else 1e-2)


def group_quantized(x):
    """The twin of quantize_fp8_groups: x's codes and scales a row and 128 columns ([ceil(k / 128), rows])."""
    rows, cols = x.shape
    starts = np.arange(0, cols, 128)
    scales = e4m3_scale(np.maximum.reduceat(np.abs(x), starts, axis=1))
    return e4m3_codes(x, np.repeat(scales, 128, axis=1)[:, :cols]), np.ascontiguousarray(scales.T)


@pytest.mark.parametrize("values", [False, True])
@pytest.mark.parametrize("rows,cols", [(1, 8), (3, 200), (12, 2048), (301, 640), (8, 14336)])
def test_quantize_fp8_groups_is_bit_exact(cuda, ops, rows, cols, values):
    """A block-scaled layer's input: codes (or their f16 values) and scales per row and 128 columns (a last group
    of fewer where cols is not a multiple of 128), as quantize_activations's group 128, the scales group by group."""
    gpu, rng = Gpu(cuda), np.random.default_rng(rows * 31 + cols)
    x = bf16_rows(rng, (rows, cols), 8.0)
    x[:, : min(cols, 128)] *= 1e-3  # groups of one row differ in magnitude too
    x = bf16_to_f32(f32_to_bf16(x))
    groups = -(-cols // 128)
    out = gpu.poisoned((rows, cols), np.uint16) if values else gpu.put(np.full((rows, cols), 0x7F, np.uint8))
    scales = gpu.poisoned((groups, rows), np.float32)
    ops.quantize_fp8_groups(out, scales, gpu.bf16(x), rows, cols, values)
    codes, want = group_quantized(x)
    np.testing.assert_array_equal(gpu.get(scales, (groups, rows), np.float32), want)
    if values:
        np.testing.assert_array_equal(gpu.get(out, (rows, cols), np.float16), e4m3_to_f32(codes).astype(np.float16))
    else:
        np.testing.assert_array_equal(gpu.get(out, (rows, cols), np.uint8), codes)
    dequantized = e4m3_to_f32(codes) * np.repeat(want.T, 128, axis=1)[:, :cols]
    np.testing.assert_array_equal(dequantized, quantize_activations(x, group=128))


def block_weight(gpu, rng, n, k):
    """An FP8 checkpoint's block-scaled weight: random e4m3 codes [n, k], scales [ceil(n / 128), ceil(k / 128)]
    2^-10..2^-4 -> (the device tensor, its scales' rows padded as cuBLASLt reads them; the twin's Fp8Rows)."""
    from tinyvllm.backends.cuda.cublas import block_scale_stride

    codes = random_codes(rng, (n, k))
    scales = np.exp2(rng.uniform(-10, -4, (-(-n // 128), -(-k // 128)))).astype(np.float32)
    padded = np.full((len(scales), block_scale_stride(k)), np.nan, np.float32)  # the padding is never read
    padded[:, : scales.shape[1]] = scales
    tensor = DeviceTensor(gpu.put(codes), E4M3, (n, k), DeviceTensor(gpu.put(padded), F32, padded.shape))
    return tensor, Fp8Rows(codes, scales, (128, 128))


# (n, k, out_fp32, accumulate): Llama-3.2-1B's QKV and O shapes; k of 5 blocks (its scales' rows padded to 8) and of
# 2 (padded to 4); n not a whole number of 128-row blocks; Qwen3-8B's down
BLOCK_SHAPES = [(3072, 2048, False, False), (2048, 2048, True, True), (384, 640, True, False), (256, 256, False, True),
                (200, 1024, True, True), (4096, 12288, True, True)]


@pytest.mark.parametrize("n,k,out_fp32,accumulate", BLOCK_SHAPES)
@pytest.mark.parametrize("m", [1, 3, MAX_ROWS, MAX_ROWS + 1, 11, 12, 64, 301])
def test_linear_block_scaled_fp8_matches_the_host_twin(cuda, fp8_linear, m, n, k, out_fp32, accumulate):
    """Block-scaled e4m3 codes through Linear.gemm (gemv_fp8_block up to 8 rows; cuBLASLt's block-scaled GEMM on
    the rows in whole fours and the GEMV on the rest above) against host_weight.linear of the same codes and scales
    (the numpy backend's product: x quantized per 128 columns)."""
    gpu, rng = Gpu(cuda), np.random.default_rng(37 * m + n + k)
    weight, twin = block_weight(gpu, rng, n, k)
    x = bf16_rows(rng, (m, k))
    ref = host_linear(x, HostWeight.from_fp8(twin))
    old = bf16_to_f32(f32_to_bf16(rng.standard_normal((m, n), dtype=np.float32) * (np.std(ref) + 1e-30)))
    if accumulate:
        ref = ref + old
    start = (old if accumulate else np.full((m, n), np.nan, np.float32)) if out_fp32 else (
        f32_to_bf16(old) if accumulate else np.full((m, n), 0x7FC0, np.uint16))
    if accumulate and not out_fp32:
        ref = host_linear(x, HostWeight.from_fp8(twin)) + bf16_to_f32(f32_to_bf16(old))
    out = DeviceTensor(gpu.put(start), F32 if out_fp32 else BF16, (m, n))
    fp8_linear.gemm(out, DeviceTensor(gpu.bf16(x), BF16, (m, k)), weight, m, accumulate=accumulate)
    fp8_linear.ops.stream.synchronize()
    got = gpu.get(out.ptr, (m, n), np.float32) if out_fp32 else gpu.get_bf16(out.ptr, (m, n))
    err = rel_err(got, ref)
    path = "gemv_fp8_block" if m <= MAX_ROWS else f"cuBLASLt block scales x {m - m % 4}" + (
        f" + gemv_fp8_block x {m % 4}" if m % 4 else "")
    print(f"REPORT fp8 block linear m={m} n={n} k={k} ({path}, {'f32' if out_fp32 else 'bf16'} out): rel err {err:.2e}")
    assert np.all(np.isfinite(got)) and err < (1e-3 if out_fp32 else 1e-2)


@pytest.mark.parametrize("m", [1, 5, 12, 13])
def test_gate_up_swiglu_block_scaled_fp8(cuda, fp8_linear, m):
    """A block-scaled gate/up projection (its rows not interleaved: gate's, then up's): the product, rounded to
    bf16, then silu_and_mul on gate columns before up columns."""
    gpu, rng = Gpu(cuda), np.random.default_rng(m)
    n, k = 2 * 1536, 1024
    weight, twin = block_weight(gpu, rng, n, k)
    x = bf16_rows(rng, (m, k))
    ref = silu_and_mul(bf16_to_f32(f32_to_bf16(host_linear(x, HostWeight.from_fp8(twin)))))
    out, gate_up = gpu.poisoned((m, n // 2), np.uint16), gpu.poisoned((m, n), np.uint16)
    codes = fp8_linear.gate_up_swiglu(DeviceTensor(out, BF16, (m, n // 2)), DeviceTensor(gpu.bf16(x), BF16, (m, k)),
                                      weight, m, DeviceTensor(gate_up, BF16, (m, n)), down_e4m3=True)
    fp8_linear.ops.stream.synchronize()
    got = gpu.get_bf16(out, (m, n // 2))
    assert codes is None and np.all(np.isfinite(got))
    assert rel_err(got[1:] if m > 1 else got, ref[1:] if m > 1 else ref) < 2e-2
