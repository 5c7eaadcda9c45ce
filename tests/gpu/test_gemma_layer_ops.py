"""The layer kernels Gemma 2 and 3 add to Llama's, against their numpy twins on fresh random inputs with NaN-poisoned
outputs (test_kernels.py's pattern): (1 + weight) RMSNorm (rms_norm and qk_norm with offset 1, the gain added in
float32, never rounded to bf16), the sandwich norms' residual add (rms_norm_residual), scaled embeddings, GeGLU
(gelu_tanh_and_mul after cuBLAS, gemv_geglu_bf16 as the gate/up GEMV's epilogue) and the final-logit soft cap."""

import numpy as np
import pytest

from tinyvllm.backends.cuda.ops import GEMV_MAX_ROWS as MAX_ROWS
from tinyvllm.backends.cuda.tensors import BF16, DeviceTensor
from tinyvllm.backends.numpy_backend import (add_rms_norm, gelu_tanh_and_mul, interleave_gate_up, qk_norm, rms_norm,
                                             soft_cap)
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16

from test_gemv import linear, random_bf16, weights  # noqa: F401  (the Linear and weight fixtures)
from test_kernels import BF16_TOL, Gpu, bf16_round, check_quantized_rows, quantized_buffers, rel_err

pytestmark = pytest.mark.gpu

EPS = 1e-6  # Gemma's rms_norm_eps
# hidden sizes: tiny, Gemma-3-1B, Gemma-2-2B, Phi-3.5-mini, the most one block holds
HIDDEN = [64, 1152, 2304, 3072, 16384]


def gemma_gain(rng, n):
    """A Gemma gain w (the norm multiplies by 1 + w): bf16 values whose 1 + w is not a bf16 value."""
    return bf16_round(rng.uniform(-0.5, 0.5, n).astype(np.float32))


def check_offset_in_float32(got, x_normed, w):
    """got (bf16 outputs of x_normed * (1 + w)) is nearer the float32 1 + w than a 1 + w rounded to bf16."""
    exact = rel_err(got, x_normed * (np.float32(1) + w))
    rounded = rel_err(got, x_normed * bf16_round(np.float32(1) + w))
    assert exact < BF16_TOL and exact < rounded, (exact, rounded)


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_with_offset(cuda, ops, tokens, hidden):
    gpu, rng = Gpu(cuda), np.random.default_rng(hidden + tokens)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32) * rng.uniform(0.1, 30, (tokens, 1)).astype(np.float32)
    w = gemma_gain(rng, hidden)
    out = gpu.poisoned((tokens, hidden), np.uint16)
    ops.rms_norm(out, gpu.put(x), gpu.bf16(w), 0, tokens, hidden, EPS, 1.0)
    got = gpu.get_bf16(out, (tokens, hidden))
    assert rel_err(got, rms_norm(x, w + np.float32(1), EPS)) < BF16_TOL
    check_offset_in_float32(got, rms_norm(x, np.float32(1), EPS), w)


@pytest.mark.parametrize("with_out,quantized", [(True, "values"), (True, "codes"), (False, "values")])
@pytest.mark.parametrize("tokens", [1, 130])
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_residual(cuda, ops, tokens, hidden, with_out, quantized):
    """x += rms_norm(part) * (1 + part_w) in float32, then (with an output) out = rms_norm(x) * (1 + w) in bf16:
    numpy's add_rms_norm then rms_norm."""
    gpu, rng = Gpu(cuda), np.random.default_rng(7 * hidden + tokens + with_out)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32) * 5
    part = rng.standard_normal((tokens, hidden), dtype=np.float32) * rng.uniform(0.01, 100, (tokens, 1)).astype(
        np.float32)
    part_w, w = gemma_gain(rng, hidden), gemma_gain(rng, hidden)
    x_dev = gpu.put(x)
    out = gpu.poisoned((tokens, hidden), np.uint16) if with_out else 0
    q, scales = quantized_buffers(gpu, quantized, (tokens, hidden))
    ops.rms_norm_residual(out, x_dev, gpu.put(part), gpu.bf16(part_w), gpu.bf16(w) if with_out else 0, tokens,
                          hidden, EPS, 1.0, scales=scales if with_out else 0, **{quantized: q if with_out else 0})
    want_x = add_rms_norm(x, part, part_w + np.float32(1), EPS)
    got_x = gpu.get(x_dev, (tokens, hidden), np.float32)
    assert rel_err(got_x, want_x) < 1e-5  # float32 throughout
    if with_out:
        got = gpu.get_bf16(out, (tokens, hidden))
        assert rel_err(got, rms_norm(want_x, w + np.float32(1), EPS)) < BF16_TOL
        check_offset_in_float32(got, rms_norm(want_x, np.float32(1), EPS), w)
        check_quantized_rows(gpu, q, scales, got, quantized)


@pytest.mark.parametrize("tokens,heads,kv_heads", [(1, 4, 1), (45, 8, 4)])  # Gemma-3-1B's, Gemma-2-2B's heads
def test_qk_norm_with_offset(cuda, ops, tokens, heads, kv_heads):
    """Gemma 3's q/k norms at head_dim 256: each head times (1 + its gain); V untouched."""
    head_dim = 256
    gpu, rng = Gpu(cuda), np.random.default_rng(tokens + heads)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = bf16_round(rng.standard_normal((tokens, width), dtype=np.float32) * rng.uniform(0.1, 10, (tokens, 1)))
    q_w, k_w = gemma_gain(rng, head_dim), gemma_gain(rng, head_dim)
    buf = gpu.bf16(qkv)
    ops.qk_norm(buf, gpu.bf16(q_w), gpu.bf16(k_w), tokens, heads, kv_heads, head_dim, width, EPS, 1.0)
    got = gpu.get_bf16(buf, (tokens, width))
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    one = np.float32(1)
    q, k = qk_norm(qkv[:, :q_end].reshape(tokens, heads, head_dim),
                   qkv[:, q_end:k_end].reshape(tokens, kv_heads, head_dim), q_w + one, k_w + one, EPS)
    assert rel_err(got[:, :q_end], q.reshape(tokens, -1)) < BF16_TOL
    assert rel_err(got[:, q_end:k_end], k.reshape(tokens, -1)) < BF16_TOL
    np.testing.assert_array_equal(got[:, k_end:], qkv[:, k_end:])


@pytest.mark.parametrize("hidden", [1152, 2304])
def test_embedding_scaled(cuda, ops, hidden):
    """Each row times Gemma's normalizer sqrt(hidden) as bf16 (34.0 for 1152, 48.0 for 2304), exactly."""
    gpu, rng = Gpu(cuda), np.random.default_rng(hidden)
    table = bf16_round(rng.standard_normal((500, hidden), dtype=np.float32))
    ids = rng.integers(0, 500, 33).astype(np.int32)
    scale = float(bf16_round(np.array([np.sqrt(hidden)], np.float32))[0])
    assert scale == {1152: 34.0, 2304: 48.0}[hidden]
    out = gpu.poisoned((33, hidden), np.float32)
    ops.embedding(out, gpu.bf16(table), gpu.put(ids), 33, hidden, scale)
    np.testing.assert_array_equal(gpu.get(out, (33, hidden), np.float32), table[ids] * np.float32(scale))


@pytest.mark.parametrize("tokens,inter", [(1, 6912), (257, 9216), (3, 520)])
def test_gelu_tanh_and_mul(cuda, ops, tokens, inter):
    gpu, rng = Gpu(cuda), np.random.default_rng(inter + tokens)
    gate_up = bf16_round(rng.standard_normal((tokens, 2 * inter), dtype=np.float32) * 3)
    out = gpu.poisoned((tokens, inter), np.uint16)
    ops.gelu_tanh_and_mul(out, gpu.bf16(interleave_gate_up(gate_up)), tokens, inter)  # the order cuBLAS writes
    assert rel_err(gpu.get_bf16(out, (tokens, inter)), gelu_tanh_and_mul(gate_up)) < BF16_TOL


@pytest.mark.parametrize("rows,vocab", [(1, 256000), (5, 1000), (64, 262144)])
def test_soft_cap(cuda, ops, rows, vocab):
    """Gemma 2's final-logit soft cap, 30 * tanh(logits / 30), in place; logits well past the cap included."""
    gpu, rng = Gpu(cuda), np.random.default_rng(rows + vocab)
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 40
    buf = gpu.put(logits)
    ops.soft_cap(buf, rows, vocab, 30.0)
    got = gpu.get(buf, (rows, vocab), np.float32)
    np.testing.assert_allclose(got, soft_cap(logits, 30.0), rtol=1e-5, atol=1e-5)
    assert np.abs(got).max() <= 30.0


# (n, k): Gemma-3-1B's gate/up (2 x 6912 units), Gemma-2-2B's (2 x 9216); odd k; 3 iterations (pipelined)
GEGLU_SHAPES = [(13824, 1152), (18432, 2304), (48, 520), (64, 4104)]


@pytest.mark.parametrize("n,k", GEGLU_SHAPES)
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 2))
def test_gate_up_geglu(cuda, linear, weights, m, n, k):  # noqa: F811  (pytest's fixtures)
    """The GEMV's GeGLU epilogue (m <= 8), and cuBLAS then gelu_tanh_and_mul above, on interleaved weights."""
    _, w = weights(n, k)  # rows: the gate, then the up projection
    rng = np.random.default_rng(9000 * m + n + k)
    x_bits, x = random_bf16(rng, (m, k))
    ref = gelu_tanh_and_mul(bf16_to_f32(f32_to_bf16(x @ w.T)))  # gate_up is bf16 before GeGLU on both paths
    x_dev, out = cuda.to_device(x_bits), cuda.to_device(np.full((m, n // 2), 0x7FC0, np.uint16))
    w_dev = cuda.to_device(f32_to_bf16(interleave_gate_up(w.T).T))  # rows: 8 gate, the same units' 8 up, ...
    gate_up = cuda.mem_alloc(m * n * 2)
    linear.ops.kernels.launched.clear()
    linear.gate_up_swiglu(DeviceTensor(int(out), BF16, (m, n // 2)), DeviceTensor(int(x_dev), BF16, (m, k)),
                          DeviceTensor(int(w_dev), BF16, (n, k)), m, DeviceTensor(int(gate_up), BF16, (m, n)),
                          activation="gelu_pytorch_tanh")
    linear.ops.stream.synchronize()
    launched = linear.ops.kernels.launched
    geglu_gemv = [name for name in launched if name.startswith("gemv_geglu_bf16")]
    assert len(geglu_gemv) == (m <= MAX_ROWS) and ("gelu_tanh_and_mul" in launched) == (m > MAX_ROWS)
    assert not any(name.startswith("gemv_swiglu") or name == "silu_and_mul" for name in launched)
    result = np.empty((m, n // 2), np.uint16)
    cuda.memcpy_dtoh(result, out)
    assert rel_err(bf16_to_f32(result), ref) < 1e-2
