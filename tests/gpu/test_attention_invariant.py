"""The batch-invariant forms of attention_decode and attention_prefill (EngineConfig.batch_invariant) on fresh random
inputs: each against its numpy twin (paged_attention), and decode bit for bit against prefill, which gives the same
query the same bits as the last row of a prefill chunk, decoded in one part or in parts of whole chunks (merged by
attention_combine_inv): the property the engine's batch-invariant mode stands on (a token's attention output is the
same whether it was decoded in any batch, prefilled, or recomputed after preemption). Every head dim and tile shape,
bf16 and fp8 caches, sliding windows and soft-capped logits, cache blocks of 5, 16 and 32 keys, contexts of one
chunk, of many, and of more chunks than the parts have slots (those run in one part)."""

import math

import numpy as np
import pytest
from test_kernels import ATTN_SHAPES, Gpu, bf16_caches, bf16_round, check_attention_decode, check_attention_prefill
from test_kv_fp8_cuda import fp8_cache_setup

from tinyvllm.backends.cuda.ops import INVARIANT_CHUNK, INVARIANT_PARTS, prefill_tiles

pytestmark = pytest.mark.gpu

CACHES = {"bf16": bf16_caches, "fp8": fp8_cache_setup}
# (window, softcap): none, a window that starts mid-tile, Gemma 2's cap with a window of 100
LAYERS = [(0, 0.0), (37, 0.0), (100, 50.0)]


@pytest.mark.parametrize("shape", list(ATTN_SHAPES))
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("num_seqs,splits,max_context", [(1, 1, 0), (1, 32, 0), (257, 1, 200), (257, 8, 200),
                                                           (9, 32, 3000)])
def test_invariant_decode_against_its_twin(cuda, ops, shape, cache, num_seqs, splits, max_context):
    """One context of 4999 keys (more chunks than slots: one part), 257 short ones, 9 of up to 3000 keys in parts."""
    check_attention_decode(cuda, ops, shape, num_seqs, splits, caches=CACHES[cache], invariant=True,
                           max_context=max_context or 200)


@pytest.mark.parametrize("shape", list(ATTN_SHAPES))
@pytest.mark.parametrize("cache", list(CACHES))
def test_invariant_prefill_against_its_twin(cuda, ops, shape, cache):
    check_attention_prefill(cuda, ops, shape, "mixed", CACHES[cache], invariant=True)


def check_decode_bits_are_prefills(cuda, ops, shape, cache, window, softcap, block_size):
    """Contexts of 1, 63-65, 128, 129, 1000, a whole slot count's chunks and one chunk more, and 33 random ones; each
    query decoded in one batch, in one part and in 8 and 32 parts, and the same query as the last row of a prefill
    chunk of 1-69 rows ending at the context's end: bitwise equal outputs."""
    head_dim, heads, kv_heads = ATTN_SHAPES[shape]
    gpu, rng = Gpu(cuda), np.random.default_rng(head_dim * 1000 + heads + window + block_size)
    longest = INVARIANT_CHUNK * INVARIANT_PARTS
    context_lens = np.concatenate([[1, 63, 64, 65, 128, 129, 1000, longest, longest + 1],
                                   rng.integers(1, 300, 33)]).astype(np.int32)
    num_seqs = len(context_lens)
    k, v, tables, kv_scales = CACHES[cache](rng, context_lens, kv_heads, head_dim, block_size)
    k_dev, v_dev = (gpu.put(c) if c.dtype == np.uint8 else gpu.bf16(c) for c in (k, v))
    scales = None if kv_scales is None else tuple(gpu.put(s) for s in kv_scales)
    width, scale = (heads + 2 * kv_heads) * head_dim, 1 / math.sqrt(head_dim)
    q_lens = np.minimum(context_lens, rng.integers(1, 70, num_seqs)).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens, last = int(qsl[-1]), qsl[1:] - 1
    qkv = bf16_round(rng.standard_normal((tokens, width), dtype=np.float32))
    tile_seq, tile_row0 = prefill_tiles(q_lens * (heads // kv_heads))
    prefilled = gpu.poisoned((tokens, heads * head_dim), np.uint16)
    ops.attention_prefill(prefilled, gpu.bf16(qkv), k_dev, v_dev, gpu.put(tables), tables.shape[1], gpu.put(qsl),
                          gpu.put(context_lens), gpu.put(tile_seq.astype(np.int32)),
                          gpu.put(tile_row0.astype(np.int32)), len(tile_seq), scale, heads, kv_heads, head_dim,
                          block_size, width, scales, window, softcap, invariant=True)
    want = gpu.get(prefilled, (tokens, heads * head_dim), np.uint16)[last]
    assert (want != 0x7FC0).all()  # every row written
    rows = num_seqs * heads * INVARIANT_PARTS
    q, tables_dev, lens = gpu.bf16(qkv[last]), gpu.put(tables), gpu.put(context_lens)
    for splits in (1, 8, 32):
        partial_o, partial_ml = gpu.poisoned((rows, head_dim), np.float32), gpu.poisoned((rows, 2), np.float32)
        decoded = gpu.poisoned((num_seqs, heads * head_dim), np.uint16)
        ops.attention_decode(decoded, partial_o, partial_ml, q, k_dev, v_dev, tables_dev,
                             gpu.put(np.array([tables.shape[1]], np.int32)), lens, num_seqs, scale, heads, kv_heads,
                             head_dim, block_size, width, splits, scales, window, softcap, invariant=True)
        got = gpu.get(decoded, (num_seqs, heads * head_dim), np.uint16)
        differ = np.flatnonzero((got != want).any(axis=1))
        assert differ.size == 0, f"{splits} parts: contexts {context_lens[differ][:8]} differ"


@pytest.mark.parametrize("shape", list(ATTN_SHAPES))
@pytest.mark.parametrize("cache", list(CACHES))
def test_invariant_decode_bits_are_prefills(cuda, ops, shape, cache):
    check_decode_bits_are_prefills(cuda, ops, shape, cache, 0, 0.0, 16)


@pytest.mark.parametrize("shape", ["d64-gqa8", "d128-gqa4", "d96-gqa16", "d256-gqa2"])
@pytest.mark.parametrize("window,softcap", LAYERS[1:])
@pytest.mark.parametrize("block_size", [5, 16, 32])
def test_invariant_decode_bits_with_window_softcap(cuda, ops, shape, window, softcap, block_size):
    check_decode_bits_are_prefills(cuda, ops, shape, "bf16", window, softcap, block_size)
    check_decode_bits_are_prefills(cuda, ops, shape, "fp8", window, softcap, block_size)
