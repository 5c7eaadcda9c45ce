"""A model whose every layer slides: the KV blocks behind every future query's window are freed, so a sequence's
memory follows its window. Outputs (greedy tokens and logprobs) equal those of the same engine with every block
kept, through chunked prefill, preemption, prefix caching and n > 1; a model with a global layer frees nothing."""

import numpy as np
import pytest
from helpers import llm_for, tiny_model

from tinyvllm import SamplingParams
from tinyvllm.engine import llm_engine
from tinyvllm.engine.block_manager import FREED_BLOCK

WINDOW, BLOCK = 32, 16
MISTRAL = dict(architecture="MistralForCausalLM", sliding_window=WINDOW, max_position_embeddings=1024)
ENGINE = dict(block_size=BLOCK, max_num_batched_tokens=64, enable_chunked_prefill=True)
BIG_CACHE = 256  # blocks: 4096 tokens, nothing ever waits for a block


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("mistral"), **MISTRAL)


def prompts(lengths, seed=0, prefix=()):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": list(prefix) + rng.integers(3, 512, n).tolist()} for n in lengths]


def results(outputs):
    return [[(tuple(c.token_ids), [sorted(d.items()) for d in c.logprobs]) for c in o.outputs] for o in outputs]


def assert_close(outputs, expected):
    """Equal tokens, logprobs within float32 rounding: a recomputed or prefix-cached sequence is computed in other
    chunks and batches than its reference, so its sums round differently (as with any model)."""
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in expected]
    for o, e in zip(outputs, expected):
        for c, d in zip(o.outputs, e.outputs):
            assert [sorted(x) for x in c.logprobs] == [sorted(y) for y in d.logprobs]
            got = [v.logprob for x in c.logprobs for _, v in sorted(x.items())]
            want = [v.logprob for y in d.logprobs for _, v in sorted(y.items())]
            np.testing.assert_allclose(got, want, atol=1e-5)


def kept_blocks(monkeypatch, model_dir, batch, params, **engine):
    """The outputs of the same engine with freeing switched off, on a cache where nothing waits."""
    with monkeypatch.context() as m:
        m.setattr(llm_engine, "FREE_OUTSIDE_WINDOW", False)
        llm = llm_for(model_dir, **{**ENGINE, **engine, "num_kv_blocks": BIG_CACHE})
        assert llm.llm_engine.block_manager.window is None
        return llm.generate(batch, params)


def assert_no_leaks(llm):
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)


def test_blocks_freed_as_the_window_moves(mistral_dir):
    """One 240-token prompt and 40 decodes: the blocks it holds stay within its window plus its chunk, and the free
    count comes back up as the window moves on."""
    llm = llm_for(mistral_dir, **ENGINE, num_kv_blocks=64, enable_prefix_caching=False)
    engine = llm.llm_engine
    bm = engine.block_manager
    assert bm.window == WINDOW
    engine.add_request("r", prompts([240])[0]["prompt_token_ids"], GREEDY)
    used, freed = [], []
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            assert seq.block_table[:seq.num_freed_blocks] == [FREED_BLOCK] * seq.num_freed_blocks
            freed.append(seq.num_freed_blocks)
        used.append(bm.num_blocks - bm.num_free_blocks)
    prefill_bound = bm.max_blocks_per_sequence(ENGINE["max_num_batched_tokens"])
    assert max(used) <= prefill_bound == (WINDOW + 64 - 2) // BLOCK + 2
    assert max(used[-30:]) <= bm.max_blocks_per_sequence(1) == WINDOW // BLOCK + 1  # decoding: the window's
    assert max(freed) >= (240 + 30 - WINDOW) // BLOCK  # freed all along the sequence
    assert freed == sorted(freed)
    assert_no_leaks(llm)


def test_outputs_equal_with_every_block_kept(mistral_dir, monkeypatch):
    batch = prompts([200, 233, 257, 31])
    llm = llm_for(mistral_dir, **ENGINE, num_kv_blocks=64, enable_prefix_caching=False)
    assert results(llm.generate(batch, GREEDY)) == results(kept_blocks(monkeypatch, mistral_dir, batch, GREEDY))
    assert_no_leaks(llm)


def test_long_prompt_on_a_cache_smaller_than_it(mistral_dir, monkeypatch):
    """A 900-token prompt on a cache of 128 tokens: chunked prefill frees as it goes; the model's limit is
    max_model_len, not the cache."""
    batch = prompts([900], seed=3)
    llm = llm_for(mistral_dir, **ENGINE, num_kv_blocks=8)
    assert llm.llm_engine.max_seq_len == 1024 > 8 * BLOCK
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=1)
    assert results(llm.generate(batch, params)) == results(kept_blocks(monkeypatch, mistral_dir, batch, params))
    assert_no_leaks(llm)


def test_preemption_under_a_tiny_cache(mistral_dir, monkeypatch):
    """Five sequences of 200-300 tokens on 10 blocks (160 tokens): preempted, recomputed chunk by chunk, and still
    equal."""
    batch = prompts([220, 260, 205, 300, 240], seed=1)
    llm = llm_for(mistral_dir, **ENGINE, num_kv_blocks=10)
    out = llm.generate(batch, GREEDY)
    assert llm.llm_engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    assert_close(out, kept_blocks(monkeypatch, mistral_dir, batch, GREEDY))
    assert_no_leaks(llm)


def test_prefix_cache_hits_take_only_the_window(mistral_dir, monkeypatch):
    """Prompts sharing a 160-token prefix (10 blocks, past the window) one after the other: the later ones hit
    the prefix, take only its blocks inside their first new token's window, and match the no-cache outputs."""
    shared = prompts([160], seed=5)[0]["prompt_token_ids"]
    batch = prompts([40, 70, 55], seed=6, prefix=shared)
    llm = llm_for(mistral_dir, **ENGINE, num_kv_blocks=40, max_num_seqs=1)
    engine = llm.llm_engine
    taken = []
    allocate = engine.block_manager.allocate

    def watch(seq, num_tokens):
        allocate(seq, num_tokens)
        taken.append((seq.num_computed_tokens, seq.num_freed_blocks, len(seq.block_table)))
    monkeypatch.setattr(engine.block_manager, "allocate", watch)
    out = llm.generate(batch, GREEDY)
    assert llm.stats()["prefix_cache_hit_rate"] == round(2 * 160 / (200 + 230 + 215), 4)
    hit_computed, hit_freed, hit_len = taken[1]
    assert hit_computed == 160 and hit_freed == (160 - WINDOW + 1) // BLOCK and hit_len > hit_freed
    assert_close(out, kept_blocks(monkeypatch, mistral_dir, batch, GREEDY, enable_prefix_caching=False))
    assert_no_leaks(llm)


def test_prefix_cache_after_its_first_blocks_are_reused(mistral_dir, monkeypatch):
    """A small cache: the shared prefix's first blocks (freed earliest) are handed out again before the later
    prompts come, so they miss and still match."""
    shared = prompts([200], seed=7)[0]["prompt_token_ids"]
    batch = prompts([100, 90, 120], seed=8, prefix=shared)
    llm = llm_for(mistral_dir, **ENGINE, num_kv_blocks=9, max_num_seqs=1)
    out = llm.generate(batch, GREEDY)
    assert llm.stats()["prefix_cache_hit_rate"] == 0  # the chain's first block is gone: no hit
    assert_close(out, kept_blocks(monkeypatch, mistral_dir, batch, GREEDY, enable_prefix_caching=False))
    assert_no_leaks(llm)


def test_n_completions_share_the_window(mistral_dir, monkeypatch):
    params = SamplingParams(n=3, max_tokens=30, temperature=0.8, seed=11, ignore_eos=True, logprobs=1)
    batch = prompts([230, 190], seed=9)
    llm = llm_for(mistral_dir, **ENGINE, num_kv_blocks=40)
    assert results(llm.generate(batch, params)) == results(kept_blocks(monkeypatch, mistral_dir, batch, params))
    assert_no_leaks(llm)


def test_a_global_layer_frees_nothing(tmp_path):
    """Qwen2 with its first layer global: every block may be read again, so none is freed and the cache caps the
    sequence length."""
    model = tiny_model(tmp_path, architecture="Qwen2ForCausalLM", sliding_window=WINDOW, rope_theta=1e6,
                       layer_types=("full_attention", "sliding_attention"), max_position_embeddings=1024)
    llm = llm_for(model, **ENGINE, num_kv_blocks=40)
    engine = llm.llm_engine
    assert engine.block_manager.window is None and engine.max_seq_len == 40 * BLOCK
    engine.add_request("r", prompts([240])[0]["prompt_token_ids"], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        assert all(seq.num_freed_blocks == 0 for seq in engine.scheduler.running)
    assert_no_leaks(llm)


def test_without_chunked_prefill_the_cache_caps_the_length(mistral_dir):
    """A whole prompt is computed in one step, so it must fit in the cache: max_seq_len stays the cache's."""
    llm = llm_for(mistral_dir, block_size=BLOCK, num_kv_blocks=8, enable_chunked_prefill=False)
    assert llm.llm_engine.block_manager.window == WINDOW and llm.llm_engine.max_seq_len == 8 * BLOCK
    out = llm.generate(prompts([100]), SamplingParams(max_tokens=27, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 27
    assert_no_leaks(llm)


def test_a_fork_after_the_parent_moved_on_computes_its_prompt():
    """A parent that has freed blocks inside its child's first window shares nothing: the child starts at 0."""
    from tinyvllm.config import EngineConfig
    from tinyvllm.engine.block_manager import BlockManager
    from tinyvllm.engine.sequence import Sequence
    from tinyvllm.outputs import RequestMetrics

    bm = BlockManager(EngineConfig(block_size=BLOCK), 32, window=WINDOW)
    parent, child = (Sequence("r", i, None, list(range(3, 103)), SamplingParams(), 0, 0, RequestMetrics(0.0))
                     for i in range(2))
    bm.allocate(parent, 100)
    parent.num_computed_tokens = 100
    bm.free_outside_window(parent)
    assert parent.num_freed_blocks == bm.freeable(99) == (99 - WINDOW + 1) // BLOCK
    assert bm.fork(parent, child) == [(parent.block_table[6], child.block_table[6])]
    assert child.num_freed_blocks == parent.num_freed_blocks and child.num_computed_tokens == 99
    bm.free(child)
    parent.num_computed_tokens = 140
    bm.free_outside_window(parent)
    bm.grow(parent, 141)
    assert bm.fork(parent, child) == [] and not child.block_table and child.num_computed_tokens == 0
    bm.check_block_tables([parent])
