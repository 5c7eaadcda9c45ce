"""The attention kernels at head_dim 96 (Phi-3.5-mini) and 256 (Gemma 2 and 3) against paged_attention, on fresh
random inputs: an fp8 KV cache, sliding windows and soft-capped logits, in decode (split contexts, tiles cut across
cache blocks) and prefill (prompts after a cached prefix, i.e. chunked prefill). The bf16 cases of every head dim are
tests/gpu/test_kernels.py's (its ATTN_SHAPES); these reuse its checks."""

import pytest

from test_kernels import check_attention_decode, check_attention_prefill
from test_kv_fp8_cuda import fp8_cache_setup

pytestmark = pytest.mark.gpu

# ATTN_SHAPES of the new head dims: both decode tiles (groups <= 8: 8 rows, 16: 16 rows) of each
SHAPES = ["d96-gqa1", "d96-gqa16", "d256-gqa4", "d256-gqa2", "d256-gqa16"]
# (window, softcap): Phi-3.5's and Gemma 2's sliding windows (shortened to cut the test contexts), Gemma 2's cap
LAYERS = [(0, 50.0), (100, 0.0), (37, 50.0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_seqs,splits,block_size", [(1, 13, 16), (257, 1, 16), (257, 3, 16), (257, 1, 5),
                                                         (1, 1, 32)])
def test_attention_decode_fp8(cuda, ops, shape, num_seqs, splits, block_size):
    check_attention_decode(cuda, ops, shape, num_seqs, splits, block_size, fp8_cache_setup)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", ["mixed", "many"])
def test_attention_prefill_fp8(cuda, ops, shape, case):
    check_attention_prefill(cuda, ops, shape, case, fp8_cache_setup)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window,softcap", LAYERS)
@pytest.mark.parametrize("num_seqs,splits,block_size", [(1, 13, 16), (1, 32, 5), (257, 1, 16), (257, 3, 32)])
def test_attention_decode_window_softcap(cuda, ops, shape, window, softcap, num_seqs, splits, block_size):
    """A window cuts the parts of a context by its keys (from its first tile), so a 4999-key context in 13 or 32
    parts has only a few keys in each."""
    check_attention_decode(cuda, ops, shape, num_seqs, splits, block_size, window=window, softcap=softcap)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window,softcap", LAYERS)
@pytest.mark.parametrize("case", ["mixed", "many"])
def test_attention_prefill_window_softcap(cuda, ops, shape, window, softcap, case):
    """"mixed" holds prompts after a cached prefix of 16-203 keys: windows of 37 and 100 keys start past a tile."""
    check_attention_prefill(cuda, ops, shape, case, window=window, softcap=softcap)


@pytest.mark.parametrize("shape", ["d96-gqa1", "d256-gqa4"])
@pytest.mark.parametrize("window,softcap", LAYERS)
def test_fp8_cache_with_window_softcap(cuda, ops, shape, window, softcap):
    check_attention_decode(cuda, ops, shape, 1, 13, 16, fp8_cache_setup, window=window, softcap=softcap)
    check_attention_prefill(cuda, ops, shape, "mixed", fp8_cache_setup, window=window, softcap=softcap)
