"""A sliding-window model on the GPU whose KV blocks behind the window are freed: Mistral-7B's shapes (2 layers,
random bf16 weights, sliding_window 4096), a 16k-token prompt on a KV cache of 6,400 tokens. It runs, the blocks in
use stay within one window and chunk, and its tokens equal those of the same engine with every block kept on a
cache that holds the whole sequence."""

import numpy as np
import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.backends.base import missing_cuda_kernels
from tinyvllm.engine import llm_engine
from tinyvllm.model.dummy import RandomBf16Weights, build_tokenizer, tiny_config
from tinyvllm.model.loader import LoadedModel
from tinyvllm.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

WINDOW, BLOCK, PROMPT, STEPS = 4096, 16, 16384, 32
MISTRAL_7B = dict(architecture="MistralForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  rope_theta=10000.0, max_position_embeddings=32768, sliding_window=WINDOW, torch_dtype="bfloat16")
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=2048, block_size=BLOCK, max_model_len=PROMPT + 1024)
SMALL_CACHE = 400  # blocks: 6,400 tokens, under half the prompt; a window and a 2048-token chunk need 258


@pytest.fixture(scope="module")
def model():
    config = tiny_config(**MISTRAL_7B)
    missing = missing_cuda_kernels(config, ENGINE["max_model_len"])
    if missing:
        pytest.skip(missing)
    return LoadedModel(config, RandomBf16Weights(config, seed=3), Tokenizer(build_tokenizer(1024), eos_tokens=[]),
                       "random:mistral-7b-2l")


def run(model, prompts, num_kv_blocks, backend="cuda"):
    """The outputs, and the most KV blocks in use after any schedule()."""
    llm = LLM(model, backend=backend, num_kv_blocks=num_kv_blocks, **ENGINE)
    engine = llm.llm_engine
    bm, schedule, used = engine.block_manager, engine.scheduler.schedule, []

    def watched():
        step = schedule()
        used.append(bm.num_blocks - bm.num_free_blocks)
        return step
    engine.scheduler.schedule = watched
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=1, detokenize=False)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
        return outputs, bm, max(used)
    finally:
        llm.backend.close()


def greedy(outputs):
    return [tuple(o.outputs[0].token_ids) for o in outputs]


def test_16k_prompt_on_a_cache_smaller_than_it(model, monkeypatch):
    prompt = np.random.default_rng(0).integers(3, 32000, PROMPT).tolist()
    outputs, bm, most = run(model, [prompt], SMALL_CACHE)
    assert bm.window == WINDOW
    assert [len(t) for t in greedy(outputs)] == [STEPS]
    assert most <= bm.max_blocks_per_sequence(ENGINE["max_num_batched_tokens"]) == (WINDOW + 2046) // BLOCK + 2
    with monkeypatch.context() as m:
        m.setattr(llm_engine, "FREE_OUTSIDE_WINDOW", False)
        kept, kept_bm, kept_most = run(model, [prompt], -(-(PROMPT + STEPS) // BLOCK) + 8)
    assert kept_bm.window is None and kept_most >= PROMPT // BLOCK
    assert greedy(outputs) == greedy(kept)
    got = [lp[t].logprob for lp, t in zip(outputs[0].outputs[0].logprobs, outputs[0].outputs[0].token_ids)]
    want = [lp[t].logprob for lp, t in zip(kept[0].outputs[0].logprobs, kept[0].outputs[0].token_ids)]
    np.testing.assert_allclose(got, want, atol=1e-3)


def test_two_16k_prompts_share_the_small_cache(model):
    """Two at once: more than the cache holds in prefill, so one waits or is preempted; both finish, none leaks."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 32000, PROMPT - 100 * i).tolist() for i in range(2)]
    outputs, bm, most = run(model, prompts, SMALL_CACHE)
    assert [len(t) for t in greedy(outputs)] == [STEPS, STEPS]
    assert most <= bm.num_blocks
