"""batch_invariant=True on the cuda backend: a probe request's tokens and logprobs (prompt logprobs too) are bitwise
the same alone, in a batch, mixed with 40 others under chunked prefill, under preemption, with prefix-cache hits and
misses, and with n > 1; greedy and seeded; with a sliding window and an fp8 KV cache. Underneath: a split-free
cuBLASLt GEMM gives a row the same bits whatever the row count, bf16 and e4m3, and gemv_chain gives rows at m <= 8
cuBLAS's bits (the layouts of tests/test_batch_invariant.py, which runs the same on the numpy backend; the attention
kernels: tests/gpu/test_attention_invariant.py)."""

import numpy as np
import pytest
from test_batch_invariant import differing, layouts, long_layouts

from tinyvllm.backends.cuda import cublas
from tinyvllm.backends.cuda.tensors import BF16, E4M3, F32, DeviceTensor
from tinyvllm.model.dtypes import f32_to_bf16
from helpers import tiny_model

pytestmark = pytest.mark.gpu

WORKSPACE_BYTES = 32 << 20
ENGINE = {"backend": "cuda", "max_model_len": 512}
# (n, k): Llama-3.2-1B's QKV, O, gate/up and down, the 135M's gate/up, and an odd tile count
SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (3072, 576), (1000, 4096)]
ROW_COUNTS = [1, 2, 3, 7, 8, 9, 16, 17, 64, 100, 255, 512]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small model the cuda kernels run (head_dim 64), stored bf16: its decode products run as gemv_chain or on
    cuBLAS, whichever was timed the faster at start-up, shape by shape."""
    return tiny_model(tmp_path_factory.mktemp("invariant"), dtype="bfloat16", hidden_size=256,
                      intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=3, vocab_size=4096)


@pytest.fixture(scope="module")
def window_model_dir(tmp_path_factory):
    """The same with Mistral's sliding window of 24 keys: most probes' contexts cross it."""
    return tiny_model(tmp_path_factory.mktemp("invariant_window"), dtype="bfloat16", hidden_size=256,
                      intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=3, architecture="MistralForCausalLM", sliding_window=24)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_probes_bitwise_equal_in_every_layout(cuda, model_dir, seeded):
    assert differing(layouts(model_dir, seeded, invariant=True, **ENGINE)) == []


def test_a_long_context_bitwise_equal_in_every_layout(cuda, model_dir):
    """Its context crosses the invariant attention's 64-key chunks: folded in one part, in parts and by prefill
    steps that start mid-chunk, the same bits."""
    assert differing(long_layouts(model_dir, invariant=True, **ENGINE)) == []


def test_the_chain_gemv_serves_the_shapes_it_was_timed_faster_on(cuda, model_dir):
    """The shapes whose chain gives cuBLAS's bits were timed in batch-1 decode steps (the wide ones do give them, on
    an H100 and an H200), and the chain serves exactly those where a step was the faster with it."""
    from tinyvllm import LLM

    llm = LLM(str(model_dir), batch_invariant=True, max_num_seqs=8, **ENGINE)
    try:
        forward = llm.backend.forward
        timings = forward.chain_timings
        shapes = {(512, 256), (256, 256), (3072, 256), (256, 1536), (4096, 256)}  # QKV, O, gate/up, down, LM head
        assert {(3072, 256), (4096, 256)} <= set(timings) <= shapes, timings
        assert all(ms > 0 for medians in timings.values() for ms in medians.values())
        assert "gemv_chain choice" in llm.backend.startup_times
        best = {shape: min(medians, key=lambda form: (medians[form], form != "cuBLAS"))
                for shape, medians in timings.items()}
        assert forward.linear.chain_shapes == {shape for shape, form in best.items() if form != "cuBLAS"}
        assert forward.linear.chain8_shapes == {shape for shape, form in best.items() if form == "chain8"}
        assert {shape for shape, medians in timings.items() if "chain8" in medians} == forward.chain8_candidates
        assert forward.chain8_candidates == {(512, 256), (256, 256), (256, 1536), (4096, 256)}  # QKV, O, down, LM head
    finally:
        llm.close()


def test_probes_with_n_2_bitwise_equal(cuda, model_dir):
    assert differing(layouts(model_dir, seeded=True, invariant=True, n=2, **ENGINE)) == []


def test_sliding_window_and_fp8_kv_cache_bitwise_equal(cuda, window_model_dir):
    assert differing(layouts(window_model_dir, seeded=False, invariant=True, **ENGINE)) == []
    assert differing(layouts(window_model_dir, seeded=True, invariant=True, kv_cache_dtype="fp8", **ENGINE)) == []


def test_without_it_some_layout_differs(cuda, model_dir):
    """What the setting is for, and that the layouts can tell: off, the GEMV, cuBLAS's per-size algorithms and the
    decode kernel's split contexts change some probe's logprobs."""
    assert differing(layouts(model_dir, seeded=False, invariant=False, **ENGINE)) != []


@pytest.fixture(scope="module")
def invariant_blas(cuda):
    """A batch-invariant handle (split-free algorithms)."""
    stream = cuda.Stream()
    workspace = cuda.mem_alloc(WORKSPACE_BYTES)
    blas = cublas.Cublas(stream.handle, int(workspace), WORKSPACE_BYTES, invariant=True)
    yield blas, stream
    blas.close()
    workspace.free()


def gemm_rows(cuda, blas, stream, x_bits: np.ndarray, w_ptr: int, n: int, k: int, dtype: str) -> dict[int, np.ndarray]:
    """out[:m] for each m of ROW_COUNTS (float32 outputs), from the same first rows of x."""
    rows = x_bits.shape[0]
    x = cuda.to_device(x_bits)
    out = cuda.mem_alloc(rows * n * 4)
    results = {}
    for m in ROW_COUNTS:
        cuda.memset_d32(out, 0x7FC00000, rows * n)  # NaN: an unwritten row shows
        blas.gemm(DeviceTensor(int(out), F32, (rows, n)), DeviceTensor(int(x), dtype, (rows, k)),
                  DeviceTensor(w_ptr, dtype, (n, k)), m)
        stream.synchronize()
        results[m] = cuda.from_device(out, (rows, n), np.float32)[:m]
    out.free()
    x.free()
    return results


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [BF16, E4M3])
def test_invariant_gemm_rows_do_not_depend_on_the_row_count(cuda, invariant_blas, n, k, dtype):
    """Row i of x . w^T has the same bits at every row count, for a fresh random x and w; and it is the product."""
    blas, stream = invariant_blas
    rng = np.random.default_rng(n + k)
    rows = max(ROW_COUNTS)
    if dtype == BF16:
        x_bits, w_bits = (f32_to_bf16(rng.standard_normal(shape, dtype=np.float32)) for shape in ((rows, k), (n, k)))
    else:  # e4m3 codes of values in [-2, 2): any byte but the NaNs and the large exponents
        x_bits, w_bits = (rng.integers(0, 0x40, shape, dtype=np.uint8) | rng.integers(0, 2, shape, np.uint8) << 7
                          for shape in ((rows, k), (n, k)))
    w = cuda.to_device(w_bits)
    results = gemm_rows(cuda, blas, stream, x_bits, int(w), n, k, dtype)
    w.free()
    types = cublas.gemm_types(DeviceTensor(0, F32, (rows, n)), DeviceTensor(0, dtype, (rows, k)),
                              DeviceTensor(0, dtype, (n, k)))
    assert cublas.split_count(blas.algorithm(rows, n, k, types)) == 1
    full = results[rows]
    assert np.isfinite(full).all()
    for m, got in results.items():
        assert np.array_equal(got.view(np.uint32), full[:m].view(np.uint32)), f"rows 0..{m - 1} differ at m = {m}"
    if dtype == BF16:
        from tinyvllm.model.dtypes import bf16_to_f32

        ref = bf16_to_f32(x_bits[:8]) @ bf16_to_f32(w_bits).T
        assert np.linalg.norm(full[:8] - ref) / np.linalg.norm(ref) < 1e-5


# (n, k) of the chain GEMV's check: the layer shapes above and the LM heads of Llama-3.2-1B and SmolLM2-135M
CHAIN_SHAPES = SHAPES + [(128256, 2048), (49152, 576)]
CHAIN_ROWS = [1, 2, 3, 7, 8]


@pytest.fixture(scope="module")
def invariant_linear(device, invariant_blas):
    """Linear(invariant=True) on the invariant handle's stream: gemv_chain up to 8 rows, cuBLAS beyond."""
    from tinyvllm.backends.cuda.linear import Linear

    blas, stream = invariant_blas
    return Linear(blas, device.ops(stream), invariant=True), stream


@pytest.mark.parametrize("n,k", CHAIN_SHAPES)
@pytest.mark.parametrize("form", ["f32", "f32 += ", "bf16", "swiglu"])
def test_chain_gemv_rows_are_cublas_rows(cuda, invariant_linear, n, k, form):
    """gemv_chain at m <= 8 rows gives each row the bits the pinned cuBLAS algorithm gives it in a product of 256
    rows (fresh random x, w and residual): bf16 or float32 out, added into a float32 residual, or SwiGLU'd (cuBLAS's
    bf16 gate/up product, then silu_and_mul); and it is the product (numpy, float64)."""
    linear, stream = invariant_linear
    if form == "swiglu" and (n > 20000 or n % 16):
        pytest.skip("a gated form needs whole 16-row groups of gate and up rows, and an LM head has none")
    rng = np.random.default_rng(n * 7 + k)
    rows, out_dtype = 256, BF16 if form in ("bf16", "swiglu") else F32
    x_bits, w_bits = (f32_to_bf16(rng.standard_normal(shape, dtype=np.float32)) for shape in ((rows, k), (n, k)))
    width = n // 2 if form == "swiglu" else n
    start = rng.standard_normal((rows, width), dtype=np.float32)
    start = f32_to_bf16(start) if out_dtype == BF16 else start
    x, w = cuda.to_device(x_bits), cuda.to_device(w_bits)
    x_t, w_t = DeviceTensor(int(x), BF16, (rows, k)), DeviceTensor(int(w), BF16, (n, k))
    gate_up = cuda.mem_alloc(rows * n * 2)

    def product(m: int) -> np.ndarray:
        out = cuda.to_device(start)
        out_t = DeviceTensor(int(out), out_dtype, (rows, width))
        if form == "swiglu":
            linear.gate_up_swiglu(out_t, x_t, w_t, m, DeviceTensor(int(gate_up), BF16, (rows, n)))
        else:
            linear.gemm(out_t, x_t, w_t, m, accumulate=form == "f32 += ")
        stream.synchronize()
        got = cuda.from_device(out, (rows, width), start.dtype)[:m]
        out.free()
        return got.view(np.uint32 if start.dtype == np.float32 else np.uint16)

    whole = product(rows)
    for m in CHAIN_ROWS:
        assert linear.uses_chain_gemv(m, n, k)
        assert np.array_equal(product(m), whole[:m]), f"rows 0..{m - 1} differ at m = {m}"
    for allocation in (x, w, gate_up):
        allocation.free()
    if form != "swiglu":
        from tinyvllm.model.dtypes import bf16_to_f32

        got = whole[:8].view(np.float32) if out_dtype == F32 else bf16_to_f32(whole[:8])
        ref = bf16_to_f32(x_bits[:8]).astype(np.float64) @ bf16_to_f32(w_bits).T.astype(np.float64)
        if form == "f32 += ":
            ref += start[:8]
        assert np.abs(got - ref).max() < 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("n,k", CHAIN_SHAPES)
@pytest.mark.parametrize("out_fp32,accumulate", [(True, False), (True, True), (False, False)])
def test_chain_gemv_in_8_row_tiles_gives_cublas_rows(cuda, invariant_linear, n, k, out_fp32, accumulate):
    """gemv_chain in tiles of 8 weight rows (x the mma's A operand, its rows 8..15 zeros) gives each row at m <= 8
    the bits the pinned cuBLAS algorithm gives it in a product of 256 rows (fresh random x, w and output)."""
    linear, stream = invariant_linear
    rng = np.random.default_rng(n * 11 + k)
    rows, out_dtype = 256, F32 if out_fp32 else BF16
    x_bits, w_bits = (f32_to_bf16(rng.standard_normal(shape, dtype=np.float32)) for shape in ((rows, k), (n, k)))
    start = rng.standard_normal((rows, n), dtype=np.float32)
    start = start if out_fp32 else f32_to_bf16(start)
    x, w = cuda.to_device(x_bits), cuda.to_device(w_bits)

    def product(m: int, chain8: bool) -> np.ndarray:
        out = cuda.to_device(start)
        if chain8:
            linear.ops.gemv_chain(int(out), int(x), int(w), m, n, k, out_fp32, accumulate, tile_rows=8)
        else:
            linear.blas.gemm(DeviceTensor(int(out), out_dtype, (rows, n)), DeviceTensor(int(x), BF16, (rows, k)),
                             DeviceTensor(int(w), BF16, (n, k)), m, accumulate=accumulate)
        stream.synchronize()
        got = cuda.from_device(out, (rows, n), start.dtype)
        out.free()
        return got.view(np.uint32 if out_fp32 else np.uint16)

    whole = product(rows, chain8=False)
    for m in CHAIN_ROWS:
        got = product(m, chain8=True)
        assert np.array_equal(got[:m], whole[:m]), f"rows 0..{m - 1} differ at m = {m}"
        assert np.array_equal(got[m:], start.view(got.dtype)[m:]), "a row past m was written"
    for allocation in (x, w):
        allocation.free()
