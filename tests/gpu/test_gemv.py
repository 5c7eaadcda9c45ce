"""Linear.gemm (cuda/gemv.cu for m <= GEMV_MAX_ROWS, cuBLAS above) against numpy, on fresh random inputs; and
Linear.gate_up_swiglu (gemv_swiglu, or cuBLAS and silu_and_mul) against the product then numpy's silu_and_mul.

As in test_kernels.py, inputs are bf16 values and the float32 numpy reference computes on those same values, so
the error is the GEMM's alone: ||out - ref|| / ||ref|| within bf16 output rounding, below 1e-2. Outputs start as
NaN so that unwritten elements show; accumulating outputs start as random values of the product's size, so that a
wrong or missing product shows too.
"""

import numpy as np
import pytest

from tinyvllm.backends.cuda.ops import GEMV_MAX_ROWS as MAX_ROWS
from tinyvllm.backends.cuda.tensors import BF16, F32, DeviceTensor
from tinyvllm.backends.numpy_backend import interleave_gate_up, silu_and_mul
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16

pytestmark = pytest.mark.gpu

WORKSPACE_BYTES = 32 << 20
MODES = [(False, False), (True, False), (True, True), (False, True)]  # (out_fp32, accumulate)
# n = 1, odd n with a partial last tile and tiles past n; k < 256 (one warp per tile), k with a tail past the last
# full iteration at each split (2, 8, and 8 over 2 and 3 iterations: the pipelined form).
ODD_SHAPES = [(1, 8), (37, 520), (1000, 2056), (77, 4104), (130, 64)]
# Llama-3.2-1B, each with the output the model uses: QKV and gate_up bf16; O and down float32 += (the residual)
LLAMA_1B = [(3072, 2048, False, False), (2048, 2048, True, True), (16384, 2048, False, False),
            (2048, 8192, True, True)]
LM_HEAD = (128256, 2048)


def rel_err(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def random_bf16(rng, shape):
    """(bf16 bit patterns, their float32 values): normal values truncated to bf16 (fast for the LM head)."""
    bits = (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, bf16_to_f32(bits)


class CountingBlas:
    """Cublas, counting its calls: shows which path Linear took."""

    def __init__(self, blas):
        self.blas = blas
        self.calls = 0

    def gemm(self, *args, **kwargs):
        self.calls += 1
        self.blas.gemm(*args, **kwargs)


class RecordingKernels(dict):
    """The kernels by name, recording the names launched: shows which path Linear took."""

    def __init__(self, kernels):
        super().__init__(kernels)
        self.launched = []

    def __getitem__(self, name):
        self.launched.append(name)
        return super().__getitem__(name)


@pytest.fixture(scope="module")
def linear(cuda, device, kernels):
    from tinyvllm.backends.cuda.cublas import Cublas
    from tinyvllm.backends.cuda.linear import Linear
    from tinyvllm.backends.cuda.ops import Ops

    stream = cuda.Stream()
    workspace = cuda.mem_alloc(WORKSPACE_BYTES)
    blas = Cublas(stream.handle, int(workspace), WORKSPACE_BYTES)
    # every m <= MAX_ROWS through the kernel, whatever the weights' size (the default sends big ones to cuBLAS)
    ops = Ops(RecordingKernels(kernels), stream, device.num_sms)
    yield Linear(CountingBlas(blas), ops, max_gemv_weights=1 << 62)
    blas.close()
    workspace.free()


@pytest.fixture(scope="module")
def weights(cuda):
    """(n, k) -> (device bf16 weights, their float32 values), made once per module."""
    made = {}

    def get(n, k):
        if (n, k) not in made:
            bits, values = random_bf16(np.random.default_rng(n * 7919 + k), (n, k))
            made[n, k] = (cuda.to_device(bits), values)
        return made[n, k]

    return get


def check(cuda, linear, weights, m, n, k, out_fp32, accumulate):
    w_dev, w = weights(n, k)
    rng = np.random.default_rng(1000 * m + n + k)
    x_bits, x = random_bf16(rng, (m, k))
    ref = x @ w.T
    if accumulate:  # old values the product's size (rms), exact in bf16 too
        old = bf16_to_f32(f32_to_bf16(rng.standard_normal((m, n), dtype=np.float32) * np.sqrt(np.mean(ref ** 2))))
        start = old if out_fp32 else f32_to_bf16(old)
        ref = ref + old
    else:
        start = np.full((m, n), np.nan, np.float32) if out_fp32 else np.full((m, n), 0x7FC0, np.uint16)
    out, x_dev = cuda.to_device(start), cuda.to_device(x_bits)
    calls, launches = linear.blas.calls, len(linear.ops.kernels.launched)
    linear.gemm(DeviceTensor(int(out), F32 if out_fp32 else BF16, (m, n)), DeviceTensor(int(x_dev), BF16, (m, k)),
                DeviceTensor(int(w_dev), BF16, (n, k)), m, accumulate=accumulate)
    linear.ops.stream.synchronize()
    assert linear.blas.calls - calls == (m > MAX_ROWS)  # the GEMV kernel for m <= MAX_ROWS, cuBLAS above
    result = np.empty_like(start)
    cuda.memcpy_dtoh(result, out)
    assert rel_err(result if out_fp32 else bf16_to_f32(result), ref) < 1e-2
    return linear.ops.kernels.launched[launches:]


@pytest.mark.parametrize("out_fp32,accumulate", MODES)
@pytest.mark.parametrize("n,k", ODD_SHAPES)
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 2))  # one past the kernel's rows: cuBLAS
def test_gemm_odd_shapes(cuda, linear, weights, m, n, k, out_fp32, accumulate):
    check(cuda, linear, weights, m, n, k, out_fp32, accumulate)


@pytest.mark.parametrize("n,k,out_fp32,accumulate", LLAMA_1B)
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 2))
def test_gemm_llama_1b(cuda, linear, weights, m, n, k, out_fp32, accumulate):
    launched = check(cuda, linear, weights, m, n, k, out_fp32, accumulate)
    if m <= MAX_ROWS:  # down's k = 8192 is 4 iterations of a warp: the pipelined form; 2048, the plain one
        assert launched == ["gemv_" + ("f32" if out_fp32 else "bf16") + "_pipelined" * (k == 8192)]


@pytest.mark.parametrize("m", [1, MAX_ROWS])
def test_gemm_lm_head(cuda, linear, weights, m):
    check(cuda, linear, weights, m, *LM_HEAD, out_fp32=True, accumulate=False)


def test_default_routing(linear):
    """The backend's Linear sends a 1B model's layer weights at small m to the kernel, the rest to cuBLAS."""
    from tinyvllm.backends.cuda.linear import Linear

    default = Linear(linear.blas, linear.ops)
    assert default.uses_gemv(1, 3072, 2048) and default.uses_gemv(MAX_ROWS, 2048, 2048)
    assert default.uses_gemv(1, 16384, 2048) and default.uses_gemv(1, 2048, 8192)  # gate_up, down
    assert not default.uses_gemv(MAX_ROWS + 1, 2048, 2048) and not default.uses_gemv(1, 2 * 14336, 4096)  # 8B MLP
    assert not default.uses_gemv(1, *LM_HEAD) and not default.uses_gemv(1, 2048, 2044)


# (n, k): Llama-3.2-1B's gate/up (2 x 8192 units); odd k; tiles past the last; 3 iterations (pipelined)
SWIGLU_SHAPES = [(16384, 2048), (48, 520), (1040, 2056), (64, 4104)]


@pytest.mark.parametrize("n,k", SWIGLU_SHAPES)
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 2))
def test_gate_up_swiglu(cuda, linear, weights, m, n, k):
    """The GEMV's SwiGLU epilogue (m <= 8), and cuBLAS then silu_and_mul above, on weights whose rows are
    interleaved as the backend packs them."""
    _, w = weights(n, k)  # rows: the gate, then the up projection
    rng = np.random.default_rng(7000 * m + n + k)
    x_bits, x = random_bf16(rng, (m, k))
    with np.errstate(over="ignore"):  # exp(-gate) of a very negative gate: inf, and SiLU 0 as it should be
        ref = silu_and_mul(bf16_to_f32(f32_to_bf16(x @ w.T)))  # gate_up is bf16 before SwiGLU on both paths
    x_dev, out = cuda.to_device(x_bits), cuda.to_device(np.full((m, n // 2), 0x7FC0, np.uint16))
    w_dev = cuda.to_device(f32_to_bf16(interleave_gate_up(w.T).T))  # rows: 8 gate, the same units' 8 up, ...
    gate_up = cuda.mem_alloc(m * n * 2)
    linear.ops.kernels.launched.clear()
    linear.gate_up_swiglu(DeviceTensor(int(out), BF16, (m, n // 2)), DeviceTensor(int(x_dev), BF16, (m, k)),
                          DeviceTensor(int(w_dev), BF16, (n, k)), m, DeviceTensor(int(gate_up), BF16, (m, n)))
    linear.ops.stream.synchronize()
    launched = linear.ops.kernels.launched
    swiglu_gemv = [name for name in launched if name.startswith("gemv_swiglu_bf16")]
    assert len(swiglu_gemv) == (m <= MAX_ROWS) and ("silu_and_mul" in launched) == (m > MAX_ROWS)
    result = np.empty((m, n // 2), np.uint16)
    cuda.memcpy_dtoh(result, out)
    assert rel_err(bf16_to_f32(result), ref) < 1e-2
