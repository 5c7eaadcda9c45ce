"""Each CUDA kernel against its numpy twin, on fresh random inputs with NaN-poisoned outputs.

Inputs are rounded to bf16 first and the numpy reference computes on those same values in float32, so the errors
measure the kernels alone: ||out - ref|| / ||ref|| within bf16 output rounding (~4e-3), below 1e-2.
"""

import math

import numpy as np
import pytest

from tinyvllm.backends import sampler
from tinyvllm.backends.base import Batch, SamplingBatch
from tinyvllm.backends.cuda.ops import INVARIANT_PARTS, QkNorm, prefill_tiles
from tinyvllm.backends.cuda.tensors import BF16, F32
from tinyvllm.backends.cuda.tensors import DeviceTensor as T
from tinyvllm.backends.numpy_backend import (AttentionSpec, apply_rope, interleave_gate_up, paged_attention, qk_norm,
                                             rms_norm, silu_and_mul)
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16
from tinyvllm.model.rope import rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.gpu

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
BF16_TOL = 1e-2


def rel_err(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def bf16_round(x):
    return bf16_to_f32(f32_to_bf16(x))


class Gpu:
    """Allocations and transfers for one test; outputs start as NaN so that unwritten elements show."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.keep = []

    def put(self, array) -> int:
        allocation = self.cuda.to_device(np.ascontiguousarray(array))
        self.keep.append(allocation)
        return int(allocation)

    def bf16(self, x) -> int:
        return self.put(f32_to_bf16(x))

    def poisoned(self, shape, dtype) -> int:
        fill = {np.float32: np.float32(np.nan), np.uint16: np.uint16(0x7FC0), np.int32: np.int32(-7)}[dtype]
        return self.put(np.full(shape, fill, dtype))

    def get(self, ptr, shape, dtype):
        out = np.empty(shape, dtype)
        self.cuda.Context.synchronize()
        self.cuda.memcpy_dtoh(out, ptr)
        return out

    def get_bf16(self, ptr, shape):
        return bf16_to_f32(self.get(ptr, shape, np.uint16))


@pytest.mark.parametrize("tokens", [1, 257])
def test_embedding(cuda, ops, tokens):
    gpu, rng = Gpu(cuda), np.random.default_rng(tokens)
    table = bf16_round(rng.standard_normal((1000, 576), dtype=np.float32))
    ids = rng.integers(0, 1000, tokens).astype(np.int32)
    out = gpu.poisoned((tokens, 576), np.float32)
    ops.embedding(out, gpu.bf16(table), gpu.put(ids), tokens, 576)
    np.testing.assert_array_equal(gpu.get(out, (tokens, 576), np.float32), table[ids])


@pytest.mark.parametrize("tokens", [1, 300])
def test_resolve_tokens(cuda, ops, tokens):
    """Placeholders take the previous step's sampled ids, as Backend.submit's numpy twin does; the rest stay."""
    gpu, rng = Gpu(cuda), np.random.default_rng(tokens)
    sampled = rng.integers(0, 50_000, 64).astype(np.int32)
    ids = rng.integers(0, 50_000, tokens).astype(np.int32)
    src = np.where(rng.random(tokens) < 0.5, rng.integers(0, 64, tokens), -1).astype(np.int32)
    want = ids.copy()
    want[src >= 0] = sampled[src[src >= 0]]
    ids_dev = gpu.put(ids)
    ops.resolve_tokens(ids_dev, gpu.put(src), gpu.put(sampled), tokens)
    np.testing.assert_array_equal(gpu.get(ids_dev, tokens, np.int32), want)


@pytest.mark.parametrize("quantized", ["values", "codes"])
@pytest.mark.parametrize("tokens,hidden,gather", [(1, 576, False), (257, 2048, False), (33, 576, True),
                                                  (3, 12296, False), (2, 16384, True)])
def test_rms_norm(cuda, ops, tokens, hidden, gather, quantized):
    gpu, rng = Gpu(cuda), np.random.default_rng(hidden + tokens)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32) * 3
    w = bf16_round(1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32))
    rows = rng.permutation(tokens)[: max(1, tokens // 2)].astype(np.int32) if gather else np.arange(tokens)
    out = gpu.poisoned((len(rows), hidden), np.uint16)
    q, scales = quantized_buffers(gpu, quantized, (len(rows), hidden))
    ops.rms_norm(out, gpu.put(x), gpu.bf16(w), gpu.put(rows) if gather else 0, len(rows), hidden, 1e-5,
                 scales=scales, **{quantized: q})
    got = gpu.get_bf16(out, (len(rows), hidden))
    assert rel_err(got, rms_norm(x[rows], w, 1e-5)) < BF16_TOL
    check_quantized_rows(gpu, q, scales, got, quantized)


def quantized_buffers(gpu, quantized: str, shape):
    """Poisoned buffers for a kernel's quantized rows: f16 code values ("values", the FP8 GEMV's x) or e4m3 codes
    ("codes", 0x7F: NaN, the FP8 GEMM's input), and their scales."""
    rows = gpu.poisoned(shape, np.uint16) if quantized == "values" else gpu.put(np.full(shape, 0x7F, np.uint8))
    return rows, gpu.poisoned(shape[:1], np.float32)


def check_quantized_rows(gpu, q, scales, rows, quantized="values"):
    """The FP8 input a kernel writes beside (or instead of) its bf16 rows: quantize_rows of those rows, bit for bit
    (scales, and the codes: as f16 values for "values", as e4m3 for "codes")."""
    from tinyvllm.model.dtypes import e4m3_to_f32
    from tinyvllm.model.fp8 import quantize_rows

    want = quantize_rows(rows)
    np.testing.assert_array_equal(gpu.get(scales, (len(rows),), np.float32), want.scale)
    if quantized == "values":
        np.testing.assert_array_equal(gpu.get(q, rows.shape, np.float16), e4m3_to_f32(want.codes).astype(np.float16))
    else:
        np.testing.assert_array_equal(gpu.get(q, rows.shape, np.uint8), want.codes)


@pytest.mark.parametrize("tokens,inter", [(1, 1536), (257, 8192), (3, 520)])
def test_silu_and_mul(cuda, ops, tokens, inter):
    gpu, rng = Gpu(cuda), np.random.default_rng(inter)
    gate_up = bf16_round(rng.standard_normal((tokens, 2 * inter), dtype=np.float32) * 2)
    out = gpu.poisoned((tokens, inter), np.uint16)
    ops.silu_and_mul(out, gpu.bf16(interleave_gate_up(gate_up)), tokens, inter)  # the order cuBLAS writes
    assert rel_err(gpu.get_bf16(out, (tokens, inter)), silu_and_mul(gate_up)) < BF16_TOL


@pytest.mark.parametrize("activation", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (300, 8192), (9, 14336), (3, 520)])
def test_gated_e4m3_is_the_activation_quantized(cuda, ops, tokens, inter, activation):
    """The activation written as the FP8 down GEMM's input: bit for bit quantize_rows of the bf16 kernel's output
    (which itself is checked against numpy above), rows of very different magnitudes, one all zero."""
    gpu, rng = Gpu(cuda), np.random.default_rng(inter + tokens)
    gate_up = rng.standard_normal((tokens, 2 * inter), dtype=np.float32) * 2
    gate_up *= np.exp2(rng.uniform(-8, 2, (tokens, 1))).astype(np.float32)
    if tokens > 1:
        gate_up[1] = 0
    packed = gpu.bf16(bf16_round(interleave_gate_up(gate_up)))
    out = gpu.poisoned((tokens, inter), np.uint16)
    getattr(ops, activation)(out, packed, tokens, inter)
    codes, scales = quantized_buffers(gpu, "codes", (tokens, inter))
    ops.gated_e4m3(activation, codes, scales, packed, tokens, inter)
    check_quantized_rows(gpu, codes, scales, gpu.get_bf16(out, (tokens, inter)), "codes")


# (tokens, head_dim, heads, kv_heads); 96: Phi-3.5-mini's heads, 256: Gemma-3-1B's
ROPE_CACHE_SHAPES = [(1, 64, 32, 8), (257, 128, 8, 2), (40, 64, 9, 3), (33, 96, 32, 32), (65, 256, 4, 1)]


def rope_and_cache_inputs(rng, tokens, head_dim, heads, kv_heads, scale=None):
    """qkv rows (bf16 values, times `scale` where given), positions, rope's cos/sin table and cache slots (every
    fifth negative: a padded row)."""
    width = (heads + 2 * kv_heads) * head_dim
    qkv = rng.standard_normal((tokens, width), dtype=np.float32)
    qkv = bf16_round(qkv if scale is None else qkv * scale)
    positions = rng.integers(0, 20000, tokens).astype(np.int32)
    cos, sin = rope_cos_sin(np.arange(20000), rope_inv_freq(head_dim, 500000.0, LLAMA3_SCALING))
    slots = rng.permutation(1000)[:tokens].astype(np.int32)
    slots[::5] = -1
    return qkv, positions, np.stack([cos, sin], -1), slots


def check_rotated(got, qkv, positions, cos_sin, heads, kv_heads, head_dim):
    """got (the kernel's qkv rows): q and k heads rotated as apply_rope does, V heads untouched."""
    tokens, qk = len(qkv), (heads + kv_heads) * head_dim
    c, s = cos_sin[positions, :, 0], cos_sin[positions, :, 1]
    ref = apply_rope(qkv[:, :qk].reshape(tokens, heads + kv_heads, head_dim), c, s).reshape(tokens, qk)
    assert rel_err(got[:, :qk], ref) < BF16_TOL
    np.testing.assert_array_equal(got[:, qk:], qkv[:, qk:])


@pytest.mark.parametrize("tokens,head_dim,heads,kv_heads", ROPE_CACHE_SHAPES)
def test_rope_and_cache(cuda, ops, tokens, head_dim, heads, kv_heads):
    gpu, rng = Gpu(cuda), np.random.default_rng(tokens + head_dim)
    qkv, positions, cos_sin, slots = rope_and_cache_inputs(rng, tokens, head_dim, heads, kv_heads)
    num_slots, q_width, kv_width = 1000, heads * head_dim, kv_heads * head_dim
    k_cache, v_cache = gpu.poisoned((num_slots, kv_width), np.uint16), gpu.poisoned((num_slots, kv_width), np.uint16)
    buf = gpu.bf16(qkv)
    ops.rope_and_cache(buf, k_cache, v_cache, gpu.put(positions), gpu.put(slots), gpu.put(cos_sin), tokens, heads,
                       kv_heads, head_dim, qkv.shape[1])
    got = gpu.get_bf16(buf, qkv.shape)
    check_rotated(got, qkv, positions, cos_sin, heads, kv_heads, head_dim)
    k, v = gpu.get_bf16(k_cache, (num_slots, kv_width)), gpu.get_bf16(v_cache, (num_slots, kv_width))
    real = slots >= 0
    np.testing.assert_array_equal(k[slots[real]], got[real, q_width: q_width + kv_width])  # the rotated keys
    np.testing.assert_array_equal(v[slots[real]], qkv[real, q_width + kv_width:])
    untouched = np.setdiff1d(np.arange(num_slots), slots[real])
    assert np.isnan(k[untouched]).all() and np.isnan(v[untouched]).all()



@pytest.mark.parametrize("tokens,head_dim,heads,kv_heads,offset", [(1, 128, 32, 4, 0.0), (257, 64, 8, 2, 0.0),
                                                                   (65, 256, 4, 1, 1.0), (3, 128, 9, 3, 0.0)])
def test_rope_and_cache_with_qk_norm(cuda, ops, tokens, head_dim, heads, kv_heads, offset):
    """The per-head q/k norms fused into rope_and_cache (Qwen3's heads of 128, Gemma 3's of 256 with its gain
    offset 1): each q and k head normalized (qk_norm's twin, rounded to bf16 as the qk_norm kernel rounds it),
    then rotated; the cache gets the normalized, rotated keys and the untouched values."""
    gpu, rng = Gpu(cuda), np.random.default_rng(tokens + head_dim + heads)
    qkv, positions, cos_sin, slots = rope_and_cache_inputs(rng, tokens, head_dim, heads, kv_heads,
                                                           scale=rng.uniform(0.1, 10, (tokens, 1)))
    q_w, k_w = (bf16_round(0.3 * rng.standard_normal(head_dim, dtype=np.float32) + (1 - offset)) for _ in range(2))
    num_slots, q_width, kv_width = 1000, heads * head_dim, kv_heads * head_dim
    k_cache, v_cache = gpu.poisoned((num_slots, kv_width), np.uint16), gpu.poisoned((num_slots, kv_width), np.uint16)
    buf = gpu.bf16(qkv)
    norm = QkNorm(gpu.bf16(q_w), gpu.bf16(k_w), 1e-6, offset)
    ops.rope_and_cache(buf, k_cache, v_cache, gpu.put(positions), gpu.put(slots), gpu.put(cos_sin), tokens, heads,
                       kv_heads, head_dim, qkv.shape[1], qk_norm=norm)
    got = gpu.get_bf16(buf, qkv.shape)
    q, k = qk_norm(qkv[:, :q_width].reshape(tokens, heads, head_dim),
                   qkv[:, q_width:q_width + kv_width].reshape(tokens, kv_heads, head_dim), q_w + offset, k_w + offset,
                   1e-6)
    normed = np.concatenate([bf16_round(q).reshape(tokens, -1), bf16_round(k).reshape(tokens, -1),
                             qkv[:, q_width + kv_width:]], axis=1)
    check_rotated(got, normed, positions, cos_sin, heads, kv_heads, head_dim)
    k_got, v_got = gpu.get_bf16(k_cache, (num_slots, kv_width)), gpu.get_bf16(v_cache, (num_slots, kv_width))
    real = slots >= 0
    np.testing.assert_array_equal(k_got[slots[real]], got[real, q_width: q_width + kv_width])
    np.testing.assert_array_equal(v_got[slots[real]], qkv[real, q_width + kv_width:])


def cache_setup(rng, context_lens, kv_heads, head_dim, block_size):
    """Random bf16 K/V caches and shuffled block tables covering each context (plus unused padding columns)."""
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = rng.permutation(num_blocks)
    width = max(blocks_per_seq) + 2
    tables = np.zeros((len(context_lens), width), np.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used: used + n]
        used += n
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k = bf16_round(rng.standard_normal(shape, dtype=np.float32))
    v = bf16_round(rng.standard_normal(shape, dtype=np.float32))
    return k, v, tables


# (head_dim, heads, kv_heads); d96: Phi-3.5-mini's heads, d256: Gemma-3-1B's (gqa4) and Gemma-2-2B's (gqa2)
ATTN_SHAPES = {"d64-gqa1": (64, 8, 8), "d128-gqa4": (128, 32, 8), "d64-gqa8": (64, 16, 2),
               "d64-gqa3": (64, 9, 3), "d128-gqa16": (128, 32, 2), "d64-gqa32": (64, 32, 1),
               "d96-gqa1": (96, 32, 32), "d96-gqa16": (96, 32, 2), "d256-gqa4": (256, 4, 1),
               "d256-gqa2": (256, 8, 4), "d256-gqa16": (256, 16, 1)}


def bf16_caches(rng, context_lens, kv_heads, head_dim, block_size):
    return *cache_setup(rng, context_lens, kv_heads, head_dim, block_size), None


def attention_spec(scale, window, softcap):
    """paged_attention's spec of a layer with this window and soft cap (0: none), as the kernels take them."""
    return AttentionSpec(scale, window or None, softcap or None)


def check_attention_decode(cuda, ops, shape, num_seqs, splits, block_size=16, caches=bf16_caches, max_context=200,
                           window=0, softcap=0.0, invariant=False):
    """attention_decode (with attention_combine when splits > 1) against paged_attention on random caches made by
    `caches` (k, v, tables, kv_scales: bf16 values and None, or fp8 codes and their scales): one context of 4999
    keys, or num_seqs of 1 to max_context - 1; window and softcap: the layer's (0: none); invariant: its
    batch-invariant form (with splits > 1: parts of whole chunks, INVARIANT_PARTS slots a (sequence, head))."""
    head_dim, heads, kv_heads = ATTN_SHAPES[shape]
    gpu, rng = Gpu(cuda), np.random.default_rng(num_seqs * 100 + splits + block_size)
    context_lens = (np.array([4999]) if num_seqs == 1 else rng.integers(1, max_context, num_seqs)).astype(np.int32)
    k, v, tables, kv_scales = caches(rng, context_lens, kv_heads, head_dim, block_size)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = bf16_round(rng.standard_normal((num_seqs, width), dtype=np.float32))
    scale = 1 / math.sqrt(head_dim)
    out = gpu.poisoned((num_seqs, heads * head_dim), np.uint16)
    slots = INVARIANT_PARTS if invariant and splits > 1 else splits
    partial_o = gpu.poisoned((num_seqs * heads * slots, head_dim), np.float32)
    partial_ml = gpu.poisoned((num_seqs * heads * slots, 2), np.float32)
    k_dev, v_dev = (gpu.put(c) if c.dtype == np.uint8 else gpu.bf16(c) for c in (k, v))
    ops.attention_decode(out, partial_o, partial_ml, gpu.bf16(qkv), k_dev, v_dev, gpu.put(tables),
                         gpu.put(np.array([tables.shape[1]], np.int32)), gpu.put(context_lens), num_seqs, scale, heads,
                         kv_heads, head_dim, block_size, width, splits,
                         None if kv_scales is None else tuple(gpu.put(s) for s in kv_scales), window, softcap,
                         invariant)
    got = gpu.get_bf16(out, (num_seqs, heads * head_dim))
    batch = Batch(1, np.zeros(num_seqs, np.int32), context_lens - 1, np.zeros(num_seqs, np.int32),
                  np.arange(num_seqs + 1, dtype=np.int32), context_lens, tables, None)
    q = qkv[:, : heads * head_dim].reshape(num_seqs, heads, head_dim)
    ref = paged_attention(q, k, v, batch, block_size, attention_spec(scale, window, softcap), kv_scales)
    ref = ref.reshape(num_seqs, -1)
    assert rel_err(got, ref) < BF16_TOL


@pytest.mark.parametrize("shape", list(ATTN_SHAPES))
@pytest.mark.parametrize("num_seqs,splits", [(1, 1), (1, 13), (257, 1), (257, 3), (1, 32), (257, 8)])
def test_attention_decode(cuda, ops, shape, num_seqs, splits):
    check_attention_decode(cuda, ops, shape, num_seqs, splits)


@pytest.mark.parametrize("shape", ["d64-gqa1", "d128-gqa16", "d96-gqa1", "d256-gqa4"])
@pytest.mark.parametrize("block_size", [5, 32])  # tiles of 16 keys across blocks, and two tiles per block
@pytest.mark.parametrize("num_seqs,splits", [(1, 13), (257, 1), (1, 1)])
def test_attention_decode_block_sizes(cuda, ops, shape, block_size, num_seqs, splits):
    check_attention_decode(cuda, ops, shape, num_seqs, splits, block_size)


@pytest.mark.parametrize("shape", ["d64-gqa1", "d128-gqa4", "d64-gqa32", "d96-gqa16", "d256-gqa2"])
def test_attention_decode_parts_of_short_contexts(cuda, ops, shape):
    """Contexts of 1-999 keys with up to 32 parts: each cut into parts of at least DECODE_MIN_SPLIT_TILES whole tiles
    (the last one ending short), those of 16 * DECODE_MIN_SPLIT_TILES keys or fewer in one part, written without
    attention_combine."""
    check_attention_decode(cuda, ops, shape, 9, 32, max_context=1000)


def check_attention_prefill(cuda, ops, shape, case, caches=bf16_caches, window=0, softcap=0.0, invariant=False):
    """attention_prefill against paged_attention on random caches made by `caches` (as check_attention_decode's):
    "mixed" sequences, or 257 short ones; window and softcap: the layer's (0: none); invariant: its batch-invariant
    form."""
    head_dim, heads, kv_heads = ATTN_SHAPES[shape]
    gpu, rng = Gpu(cuda), np.random.default_rng(len(case) + head_dim)
    block_size = 16
    if case == "mixed":  # a lone token, a prompt, prompts after a cached prefix, a context ending mid-block
        q_lens, past = np.array([1, 37, 64, 130, 5]), np.array([0, 0, 16, 203, 60])
    else:  # 257 short sequences
        q_lens, past = rng.integers(1, 20, 257), rng.integers(0, 40, 257)
    context_lens = (q_lens + past).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(qsl[-1])
    positions = np.concatenate([np.arange(p, c) for p, c in zip(past, context_lens)]).astype(np.int32)
    k, v, tables, kv_scales = caches(rng, context_lens, kv_heads, head_dim, block_size)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = bf16_round(rng.standard_normal((tokens, width), dtype=np.float32))
    tile_seq, tile_row0 = prefill_tiles(q_lens * (heads // kv_heads))
    scale = 1 / math.sqrt(head_dim)
    out = gpu.poisoned((tokens, heads * head_dim), np.uint16)
    k_dev, v_dev = (gpu.put(c) if c.dtype == np.uint8 else gpu.bf16(c) for c in (k, v))
    ops.attention_prefill(out, gpu.bf16(qkv), k_dev, v_dev, gpu.put(tables), tables.shape[1],
                          gpu.put(qsl), gpu.put(context_lens), gpu.put(tile_seq.astype(np.int32)),
                          gpu.put(tile_row0.astype(np.int32)), len(tile_seq), scale, heads, kv_heads, head_dim,
                          block_size, width, None if kv_scales is None else tuple(gpu.put(s) for s in kv_scales),
                          window, softcap, invariant)
    got = gpu.get_bf16(out, (tokens, heads * head_dim))
    batch = Batch(int(np.diff(qsl).max()), np.zeros(tokens, np.int32), positions, np.zeros(tokens, np.int32), qsl, context_lens, tables,
                  None)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    ref = paged_attention(q, k, v, batch, block_size, attention_spec(scale, window, softcap), kv_scales)
    ref = ref.reshape(tokens, -1)
    assert rel_err(got, ref) < BF16_TOL


@pytest.mark.parametrize("shape", list(ATTN_SHAPES))
@pytest.mark.parametrize("case", ["mixed", "many"])
def test_attention_prefill(cuda, ops, shape, case):
    check_attention_prefill(cuda, ops, shape, case)


@pytest.mark.parametrize("m,n,k,out_fp32,accumulate", [(1, 3072, 2048, False, False), (257, 576, 1536, True, True)])
def test_cublas_gemm(cuda, m, n, k, out_fp32, accumulate):
    from tinyvllm.backends.cuda.cublas import Cublas

    gpu, rng = Gpu(cuda), np.random.default_rng(m)
    x = bf16_round(rng.standard_normal((m, k), dtype=np.float32))
    w = bf16_round(rng.standard_normal((n, k), dtype=np.float32))
    c = rng.standard_normal((m, n), dtype=np.float32)
    out = gpu.put(c) if accumulate else gpu.poisoned((m, n), np.float32 if out_fp32 else np.uint16)
    blas = Cublas(0, gpu.poisoned(1 << 22, np.int32), 1 << 24)
    blas.gemm(T(out, F32 if out_fp32 else BF16, (m, n)), T(gpu.bf16(x), BF16, (m, k)), T(gpu.bf16(w), BF16, (n, k)), m,
              accumulate=accumulate)
    got = gpu.get(out, (m, n), np.float32) if out_fp32 else gpu.get_bf16(out, (m, n))
    ref = x @ w.T + (c if accumulate else 0)
    assert rel_err(got, ref) < (1e-4 if out_fp32 else BF16_TOL)
    blas.close()


def test_cublas_row_counts_of_a_class_share_one_heuristic_query(cuda):
    """Every m of a class runs the algorithm found once for the class (no per-m heuristics), and each result is
    right: m below the class's row count, at it, and the smallest m of the next class."""
    from tinyvllm.backends.cuda.cublas import Cublas, m_class

    assert [m_class(m) for m in (1, 16, 17, 18, 19, 33, 300, 320, 321, 8192, 8193)] == \
        [1, 16, 18, 18, 20, 36, 320, 320, 352, 8192, 9216]
    gpu, rng = Gpu(cuda), np.random.default_rng(7)
    n, k = 384, 256
    w = bf16_round(rng.standard_normal((n, k), dtype=np.float32))
    blas = Cublas(0, gpu.poisoned(1 << 22, np.int32), 1 << 24)
    queries = []
    for m in (290, 300, 320, 321):
        x = bf16_round(rng.standard_normal((m, k), dtype=np.float32))
        out = gpu.poisoned((m, n), np.float32)
        blas.gemm(T(out, F32, (m, n)), T(gpu.bf16(x), BF16, (m, k)), T(gpu.bf16(w), BF16, (n, k)), m)
        assert rel_err(gpu.get(out, (m, n), np.float32), x @ w.T) < 1e-4
        queries.append(blas.heuristic_queries)
    assert queries == [1, 1, 1, 2]  # 289..320 are one class; 321 starts the next
    blas.close()


def test_cublas_falls_back_to_the_row_counts_own_algorithm(cuda):
    """A class's algorithm that cannot run some m (CUBLAS_STATUS_NOT_SUPPORTED) gives way to the heuristics' choice
    for that m, asked for once."""
    from tinyvllm.backends.cuda.cublas import BF16_GEMM_F32_OUT, CUBLAS_STATUS_NOT_SUPPORTED, Cublas

    gpu, rng = Gpu(cuda), np.random.default_rng(8)
    m, n, k = 300, 384, 256
    w = bf16_round(rng.standard_normal((n, k), dtype=np.float32))
    blas = Cublas(0, gpu.poisoned(1 << 22, np.int32), 1 << 24)
    class_algo = blas.algorithm(m, n, k, BF16_GEMM_F32_OUT)
    run = blas._matmul

    def refusing(algo, *args):  # the class's algorithm "cannot" run m
        return CUBLAS_STATUS_NOT_SUPPORTED if algo is class_algo else run(algo, *args)

    blas._matmul = refusing
    for _ in range(2):
        x = bf16_round(rng.standard_normal((m, k), dtype=np.float32))
        out = gpu.poisoned((m, n), np.float32)
        blas.gemm(T(out, F32, (m, n)), T(gpu.bf16(x), BF16, (m, k)), T(gpu.bf16(w), BF16, (n, k)), m)
        assert rel_err(gpu.get(out, (m, n), np.float32), x @ w.T) < 1e-4
    assert blas.heuristic_queries == 2  # the class's, then m's own once
    blas.close()


def test_cublas_tune_keeps_the_fastest_candidate_for_its_row_count(cuda):
    """tune() times each of the heuristics' candidates (every one runs) and keeps the fastest for exactly m rows;
    gemm at m then runs it, and gets the product right; a Cublas given the same algos (another stream's) too."""
    from tinyvllm.backends.cuda.cublas import BF16_GEMM_F32_OUT, TUNE_RUNS, Cublas

    gpu, rng = Gpu(cuda), np.random.default_rng(9)
    m, n, k = 256, 4096, 512
    x = bf16_round(rng.standard_normal((m, k), dtype=np.float32))
    w = bf16_round(rng.standard_normal((n, k), dtype=np.float32))
    x_dev, w_dev = T(gpu.bf16(x), BF16, (m, k)), T(gpu.bf16(w), BF16, (n, k))
    out = T(gpu.poisoned((m, n), np.float32), F32, (m, n))
    blas = Cublas(0, gpu.poisoned(1 << 22, np.int32), 1 << 24, exact_rows=frozenset({m}))
    candidates = blas._heuristics(m, n, k, BF16_GEMM_F32_OUT, 8)
    if len(candidates) < 2:
        pytest.skip("cuBLASLt offers one algorithm for this shape")
    run, ran = blas._matmul, []

    def counting(algo, *args):
        ran.append(bytes(algo))
        return run(algo, *args)

    blas._matmul = counting
    fake = iter([5.0, 1.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0])  # the second candidate "is fastest"
    kept = blas.tune(out, x_dev, w_dev, m, lambda timed_run: (timed_run(), next(fake))[1])
    assert kept == 1 and bytes(blas.algorithm(m, n, k, BF16_GEMM_F32_OUT)) == bytes(candidates[1])
    assert len(ran) == len(candidates) * (1 + TUNE_RUNS)  # each: one untimed, TUNE_RUNS timed
    ran.clear()
    out = T(gpu.poisoned((m, n), np.float32), F32, (m, n))
    blas.gemm(out, x_dev, w_dev, m)
    assert ran == [bytes(candidates[1])] and rel_err(gpu.get(out.ptr, (m, n), np.float32), x @ w.T) < 1e-4
    other = Cublas(0, gpu.poisoned(1 << 22, np.int32), 1 << 24, exact_rows=frozenset({m}), algos=blas.algos)
    assert bytes(other.algorithm(m, n, k, BF16_GEMM_F32_OUT)) == bytes(candidates[1]) and other.heuristic_queries == 0
    other.close()
    blas.close()


def sampling_rows(rng, num_rows, first_mode=0):
    """A mix of every sampling mode, cycling over the rows from first_mode."""
    modes = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=50),
             dict(temperature=1.3, top_p=0.9), dict(temperature=0.8, min_p=0.05),
             dict(temperature=1.0, top_k=200, top_p=0.8, min_p=0.01), dict(temperature=0.5, top_k=1),
             dict(temperature=2.0, top_p=0.3)]
    rows = [modes[(first_mode + i) % len(modes)] for i in range(num_rows)]
    return SamplingBatch(
        temperature=np.array([r["temperature"] for r in rows], np.float32),
        top_p=np.array([r.get("top_p", 1.0) for r in rows], np.float32),
        top_k=np.array([r.get("top_k", 0) for r in rows], np.int32),
        min_p=np.array([r.get("min_p", 0.0) for r in rows], np.float32),
        noise_keys=rng.integers(0, 2**32, num_rows, dtype=np.uint64).astype(np.uint32))


# row_split: up to SAMPLING_SPLIT_ROWS rows, each row's sampling split over a cluster of blocks (sample_split)
@pytest.mark.parametrize("num_rows,vocab,row_split", [(1, 128256, False), (64, 128256, True), (257, 49152, True),
                                                      (1, 128256, True), (16, 49152, True)])
def test_sample_matches_numpy_sampler(cuda, ops, num_rows, vocab, row_split):
    gpu, rng = Gpu(cuda), np.random.default_rng(num_rows)
    logits = rng.standard_normal((num_rows, vocab), dtype=np.float32) * 3
    params = sampling_rows(rng, num_rows, first_mode=5 if num_rows == 1 else 0)  # alone: every filter at once
    out = gpu.poisoned(num_rows, np.int32)
    ops.sample(out, gpu.put(logits), num_rows, vocab, gpu.put(params.temperature), gpu.put(params.top_p),
               gpu.put(params.top_k), gpu.put(params.min_p), gpu.put(params.noise_keys), row_split=row_split)
    got = gpu.get(out, num_rows, np.int32)
    ref = sampler.sample(logits, params)
    mismatches = int((got != ref).sum())
    print(f"REPORT sampler rows={num_rows} vocab={vocab}: {num_rows - mismatches}/{num_rows} tokens equal to numpy")
    assert mismatches <= num_rows // 64  # only float ties at a filter boundary may differ


@pytest.mark.parametrize("num_rows,k,row_split", [(1, 0, False), (37, 5, True), (257, 20, False), (1, 20, True),
                                                   (9, 64, True)])
def test_logprobs_match_numpy(cuda, ops, num_rows, k, row_split):
    gpu, rng = Gpu(cuda), np.random.default_rng(k)
    vocab = 128256
    logits = rng.standard_normal((num_rows, vocab), dtype=np.float32) * 4
    tokens = rng.integers(0, vocab, num_rows).astype(np.int32)
    token_lp = gpu.poisoned(num_rows, np.float32)
    top_ids, top_lp = gpu.poisoned((num_rows, max(k, 1)), np.int32), gpu.poisoned((num_rows, max(k, 1)), np.float32)
    ops.logprobs(token_lp, top_ids, top_lp, gpu.put(logits), gpu.put(tokens), num_rows, vocab, k, row_split=row_split)
    ref = sampler.gather_logprobs(logits, tokens, k)
    np.testing.assert_allclose(gpu.get(token_lp, num_rows, np.float32), ref.token_logprobs, atol=1e-4)
    if k:
        np.testing.assert_array_equal(gpu.get(top_ids, (num_rows, k), np.int32), ref.top_ids)
        np.testing.assert_allclose(gpu.get(top_lp, (num_rows, k), np.float32), ref.top_logprobs, atol=1e-4)


@pytest.mark.parametrize("row_split", [False, True])
def test_logprobs_of_listed_rows_leave_the_others(cuda, ops, row_split):
    gpu, rng = Gpu(cuda), np.random.default_rng(11)
    num_rows, vocab, k = 40, 49152, 3
    logits = rng.standard_normal((num_rows, vocab), dtype=np.float32) * 4
    tokens = rng.integers(0, vocab, num_rows).astype(np.int32)
    listed = np.sort(rng.choice(num_rows, 13, replace=False)).astype(np.int32)[::-1].copy()  # any order
    token_lp = gpu.poisoned(num_rows, np.float32)
    top_ids, top_lp = gpu.poisoned((num_rows, k), np.int32), gpu.poisoned((num_rows, k), np.float32)
    before = gpu.get(top_ids, (num_rows, k), np.int32)
    ops.logprobs(token_lp, top_ids, top_lp, gpu.put(logits), gpu.put(tokens), len(listed), vocab, k,
                 gpu.put(listed), row_split=row_split)
    ref = sampler.gather_logprobs(logits[listed], tokens[listed], k)
    ids = gpu.get(top_ids, (num_rows, k), np.int32)
    np.testing.assert_array_equal(ids[listed], ref.top_ids)
    np.testing.assert_allclose(gpu.get(top_lp, (num_rows, k), np.float32)[listed], ref.top_logprobs, atol=1e-4)
    np.testing.assert_allclose(gpu.get(token_lp, num_rows, np.float32)[listed], ref.token_logprobs, atol=1e-4)
    others = np.setdiff1d(np.arange(num_rows), listed)
    np.testing.assert_array_equal(ids[others], before[others])


def tied_logits(rng, num_rows, vocab):
    """Logits of 8 values, 0 to 3.5, with 3 higher ones per row: the radix selects' histograms gather in a few bins
    and a row's k-th largest value is shared by thousands of tokens."""
    logits = rng.integers(0, 8, (num_rows, vocab)).astype(np.float32) * 0.5
    for row in logits:
        row[rng.choice(vocab, 3, replace=False)] = [5.0, 4.5, 4.5]
    return logits


@pytest.mark.parametrize("num_rows,k,row_split", [(1, 20, True), (65, 5, False), (3, 64, True), (4, 2, False)])
def test_logprobs_of_tied_logits_match_numpy(cuda, ops, num_rows, k, row_split):
    gpu, rng = Gpu(cuda), np.random.default_rng(100 + k)
    vocab = 49152
    logits = tied_logits(rng, num_rows, vocab)
    tokens = rng.integers(0, vocab, num_rows).astype(np.int32)
    token_lp = gpu.poisoned(num_rows, np.float32)
    top_ids, top_lp = gpu.poisoned((num_rows, k), np.int32), gpu.poisoned((num_rows, k), np.float32)
    ops.logprobs(token_lp, top_ids, top_lp, gpu.put(logits), gpu.put(tokens), num_rows, vocab, k, row_split=row_split)
    ref = sampler.gather_logprobs(logits, tokens, k)
    # thousands of tokens tie at the k-th value: both take the smallest ids of them (sampler.top_logprob_ids)
    np.testing.assert_array_equal(gpu.get(top_ids, (num_rows, k), np.int32), ref.top_ids)
    np.testing.assert_allclose(gpu.get(top_lp, (num_rows, k), np.float32), ref.top_logprobs, atol=1e-5)
    np.testing.assert_allclose(gpu.get(token_lp, num_rows, np.float32), ref.token_logprobs, atol=1e-5)


@pytest.mark.parametrize("num_rows,row_split", [(128, False), (16, True)])
def test_sample_of_tied_logits_matches_numpy_sampler(cuda, ops, num_rows, row_split):
    gpu, rng = Gpu(cuda), np.random.default_rng(7)
    vocab = 49152
    logits = tied_logits(rng, num_rows, vocab)
    params = sampling_rows(rng, num_rows)
    out = gpu.poisoned(num_rows, np.int32)
    ops.sample(out, gpu.put(logits), num_rows, vocab, gpu.put(params.temperature), gpu.put(params.top_p),
               gpu.put(params.top_k), gpu.put(params.min_p), gpu.put(params.noise_keys), row_split=row_split)
    got, ref = gpu.get(out, num_rows, np.int32), sampler.sample(logits, params)
    assert int((got != ref).sum()) <= max(1, num_rows // 64)  # only float ties at a filter boundary may differ


@pytest.mark.parametrize("tied", [False, True])
def test_sample_of_a_row_is_the_same_in_any_batch(cuda, ops, tied):
    """Top-k and top-p histograms add integer weights, so a row's token is the same alone, anywhere in a batch and
    run after run (one block a row, the batch-invariant mode's form), and equal to the numpy sampler's."""
    gpu, rng = Gpu(cuda), np.random.default_rng(21 + tied)
    num_rows, vocab = 96, 49152
    logits = tied_logits(rng, num_rows, vocab) if tied else rng.standard_normal((num_rows, vocab), np.float32) * 3
    params = SamplingBatch(
        temperature=rng.uniform(0.5, 1.5, num_rows).astype(np.float32),
        top_p=rng.uniform(0.3, 0.99, num_rows).astype(np.float32),
        top_k=np.where(np.arange(num_rows) % 3 == 0, 500, 0).astype(np.int32),
        min_p=np.zeros(num_rows, np.float32), noise_keys=rng.integers(0, 2**32, num_rows, np.uint64).astype(np.uint32))

    def run(rows):
        rows = np.asarray(rows)
        out = gpu.poisoned(len(rows), np.int32)
        ops.sample(out, gpu.put(logits[rows]), len(rows), vocab, gpu.put(params.temperature[rows]),
                   gpu.put(params.top_p[rows]), gpu.put(params.top_k[rows]), gpu.put(params.min_p[rows]),
                   gpu.put(params.noise_keys[rows]), row_split=False)
        return gpu.get(out, len(rows), np.int32)

    first = run(np.arange(num_rows))
    for _ in range(3):
        np.testing.assert_array_equal(run(np.arange(num_rows)), first)
    order = rng.permutation(num_rows)
    np.testing.assert_array_equal(run(order), first[order])
    for row in (0, 37, 95):
        np.testing.assert_array_equal(run([row]), first[row:row + 1])
    assert int((first != sampler.sample(logits, params)).sum()) <= 1  # probabilities' last bits may differ


@pytest.mark.parametrize("tokens,head_dim,heads,kv_heads", [(1, 64, 14, 2), (257, 128, 16, 8)])
def test_add_qkv_bias(cuda, ops, tokens, head_dim, heads, kv_heads):
    gpu, rng = Gpu(cuda), np.random.default_rng(tokens + heads)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = bf16_round(rng.standard_normal((tokens, width), dtype=np.float32))
    bias = bf16_round(rng.standard_normal(width, dtype=np.float32))
    buf = gpu.bf16(qkv)
    ops.add_qkv_bias(buf, gpu.bf16(bias), tokens, width)
    assert rel_err(gpu.get_bf16(buf, (tokens, width)), qkv + bias) < BF16_TOL


@pytest.mark.parametrize("tokens,head_dim,heads,kv_heads", [(1, 128, 16, 8), (257, 64, 8, 2), (33, 128, 32, 4)])
def test_qk_norm(cuda, ops, tokens, head_dim, heads, kv_heads):
    """Q and K heads normalized on their own with their gains; V comes back untouched."""
    gpu, rng = Gpu(cuda), np.random.default_rng(tokens + head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = bf16_round(rng.standard_normal((tokens, width), dtype=np.float32) * rng.uniform(0.1, 10, (tokens, 1)))
    q_w, k_w = (bf16_round(1 + 0.3 * rng.standard_normal(head_dim, dtype=np.float32)) for _ in range(2))
    buf = gpu.bf16(qkv)
    ops.qk_norm(buf, gpu.bf16(q_w), gpu.bf16(k_w), tokens, heads, kv_heads, head_dim, width, 1e-6)
    got = gpu.get_bf16(buf, (tokens, width))
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    q, k = qk_norm(qkv[:, :q_end].reshape(tokens, heads, head_dim),
                   qkv[:, q_end:k_end].reshape(tokens, kv_heads, head_dim), q_w, k_w, 1e-6)
    assert rel_err(got[:, :q_end], q.reshape(tokens, -1)) < BF16_TOL
    assert rel_err(got[:, q_end:k_end], k.reshape(tokens, -1)) < BF16_TOL
    np.testing.assert_array_equal(got[:, k_end:], qkv[:, k_end:])
