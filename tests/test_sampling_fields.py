"""vLLM's sampling fields on the numpy backend: n, penalties, logit_bias, allowed_token_ids, bad_words, min_tokens,
include_stop_str_in_output. Each is checked against a direct computation on the model's logits."""

import numpy as np
import pytest
from helpers import llm_for

from tinyvllm import SamplingParams
from tinyvllm.backends import sampler
from tinyvllm.backends.base import LogitsProcessing

PROMPT = "The quick brown fox jumps over"


def penalized(logits: np.ndarray, prompt: list[int], output: list[int], presence=0.0, frequency=0.0,
              repetition=1.0) -> np.ndarray:
    """vLLM's penalties applied by hand to raw logits, as log-probabilities."""
    x = logits.astype(np.float64)
    counts = np.bincount(output, minlength=len(x)).astype(np.float64)
    x -= frequency * counts + presence * (counts > 0)
    seen = (counts > 0) | np.isin(np.arange(len(x)), prompt)
    x[seen] = np.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
    return x - np.logaddexp.reduce(x)


@pytest.mark.parametrize("penalties", [dict(presence=0.7), dict(frequency=0.9), dict(repetition=1.8),
                                       dict(presence=0.3, frequency=0.5, repetition=1.3)])
def test_penalties_equal_a_direct_computation(tiny_model_dir, monkeypatch, penalties):
    llm = llm_for(tiny_model_dir)
    vocab = llm.model_config.vocab_size
    raw = []  # the model's logits of each step, as they reach the logits processors
    apply = sampler.apply_logits_processing
    monkeypatch.setattr(sampler, "apply_logits_processing",
                        lambda logits, *args: (raw.append(logits[0].copy()), apply(logits, *args)))
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repetition": "repetition_penalty"}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=vocab,
                            **{names[k]: v for k, v in penalties.items()})
    out = llm.generate(PROMPT, params)[0]
    prompt, output = out.prompt_token_ids, out.outputs[0].token_ids
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert output != plain.outputs[0].token_ids, "the penalty was meant to change the greedy text"
    assert len(raw) == len(output)
    for t, entry in enumerate(out.outputs[0].logprobs):
        want = penalized(raw[t], prompt, output[:t], **penalties)
        got = np.array([entry[i].logprob for i in range(vocab)])
        np.testing.assert_allclose(got, want, atol=2e-4)
        assert output[t] == int(np.argmax(want))


def test_penalties_survive_preemption_and_batching(tiny_model_dir):
    prompts = [PROMPT, "Hello there", "a b c d e f g", "Once upon a time"] * 2
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.4, repetition_penalty=1.2) for i in range(len(prompts))]
    alone = [llm_for(tiny_model_dir).generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    tight = llm_for(tiny_model_dir, num_kv_blocks=20, block_size=4)
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.llm_engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert together == alone
    assert sorted(tight.llm_engine.penalty_slots.free) == list(range(8)), "every penalty slot came back"


def test_logit_bias_forces_a_token_and_allowed_ids_restrict(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    forced = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                                                 logit_bias={"77": 100}))[0]
    assert forced.outputs[0].token_ids == [77] * 6
    allowed = [5, 9, 300, 301]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=4, ignore_eos=True,
                                              allowed_token_ids=allowed))[0]
    assert set(out.outputs[0].token_ids) <= set(allowed) and len(set(out.outputs[0].token_ids)) > 1
    with pytest.raises(ValueError, match="logit_bias has token id 1000000000 outside the vocabulary"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, logit_bias={10**9: 1.0}))


def test_min_tokens_defers_eos(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    eos = sorted(llm.llm_engine.eos_token_ids)[0]
    push_eos = {eos: 100}
    early = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, logit_bias=push_eos))[0].outputs[0]
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    late = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, logit_bias=push_eos,
                                               min_tokens=4))[0].outputs[0]
    assert len(late.token_ids) == 5 and late.token_ids[-1] == eos and eos not in late.token_ids[:4]
    assert late.finish_reason == "stop"


def test_bad_words_are_never_generated(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    tok = llm.tokenizer
    base = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].token_ids

    def own_tokens(ids: list[int]) -> bool:  # the text of `ids` tokenizes back to `ids`: banning it bans them
        return tok.encode(tok.decode(ids), add_special_tokens=False) == ids

    # A two-token word the greedy output contains: banned, its second token must not follow its first.
    k = next((k for k in range(len(base) - 1) if own_tokens(base[k:k + 2])), None)
    assert k is not None, f"no two greedy tokens in a row tokenize back to themselves: {base}"
    first, second = base[k], base[k + 1]
    ids = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                              bad_words=[tok.decode([first, second])]))[0].outputs[0].token_ids
    assert ids[:k + 1] == base[:k + 1] and ids[k + 1] != second
    assert not any(a == first and b == second for a, b in zip(ids, ids[1:]))
    # A one-token word the greedy output contains: never generated.
    single = next((t for t in base if own_tokens([t])), None)
    assert single is not None, f"no greedy token tokenizes back to itself: {base}"
    ids = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                              bad_words=[tok.decode([single])]))[0].outputs[0].token_ids
    assert single not in ids


def test_n_completions_share_one_prefill(tiny_model_dir):
    llm = llm_for(tiny_model_dir, block_size=4)
    backend = llm.llm_engine.backend
    computed: list[int] = []  # positions of every token the backend computes
    execute = backend.execute

    def counting(batch, *args):
        computed.extend(batch.positions.tolist())
        return execute(batch, *args)

    backend.execute = counting
    prompt_len = len(llm.tokenizer.encode(PROMPT))
    params = SamplingParams(n=4, max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and len(set(samples)) == 4
    # The prompt's positions but the last were computed once; the last once per completion.
    counts = np.bincount(computed)
    assert all(counts[:prompt_len - 1] == 1) and counts[prompt_len - 1] == 4
    again = llm_for(tiny_model_dir, block_size=4).generate(PROMPT, params)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples, "seeded n > 1 is reproducible"
    first_alone = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True))[0]
    assert first_alone.outputs[0].token_ids == list(samples[0]), "completion 0 samples as n=1 does"
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_n_under_preemption_matches_roomy_cache(tiny_model_dir):
    prompts = [PROMPT, "Hello there, how are you today my friend"]
    params = SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=5, ignore_eos=True, presence_penalty=0.5)
    roomy = llm_for(tiny_model_dir, block_size=4).generate(prompts, params)
    tight = llm_for(tiny_model_dir, block_size=4, num_kv_blocks=14, max_num_seqs=4)
    got = tight.generate(prompts, params)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in roomy]


def test_include_stop_str_in_output(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    text = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0].text
    stop = text[5:7]
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))[0]
    kept = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == cut.outputs[0].text + stop and text.startswith(kept.outputs[0].text)


def test_apply_logits_processing_twin_on_random_rows():
    rng = np.random.default_rng(0)
    rows, vocab = 5, 64
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    table = sampler.TokenCounts(4, vocab)
    table.init_slots([(2, np.array([1, 2, 3], np.int32), np.array([7, 7, 9], np.int32)),
                      (0, np.array([4], np.int32), np.zeros(0, np.int32))])
    proc = LogitsProcessing(
        penalty_slots=np.array([2, -1, 0, -1, -1], np.int32), count_slots=np.array([2, -1, 0, -1, -1], np.int32),
        presence=np.array([0.5, 0, 0.1, 0, 0], np.float32), frequency=np.array([0.3, 0, 0, 0, 0], np.float32),
        repetition=np.array([1.5, 1, 2.0, 1, 1], np.float32),
        allowed_ptr=np.array([0, 0, 3, 3, 3, 3], np.int32), allowed_ids=np.array([4, 8, 60], np.int32),
        bias_ptr=np.array([0, 1, 1, 1, 3, 4], np.int32), bias_ids=np.array([5, 6, 6, 11], np.int32),
        bias_values=np.array([2.0, -np.inf, 1.5, 3.0], np.float32), bias_cond=np.array([-1, 17, -1, 99], np.int32))
    got = logits.copy()
    sampler.apply_logits_processing(got, proc, np.array([0, 0, 0, 17, 98], np.int32), table)
    want = logits.copy()
    want[0, 5] += 2.0
    c = np.bincount([7, 7, 9], minlength=vocab)
    want[0] -= 0.3 * c + 0.5 * (c > 0)
    seen = (c > 0) | np.isin(np.arange(vocab), [1, 2, 3])
    want[0, seen] = np.where(want[0, seen] > 0, want[0, seen] / 1.5, want[0, seen] * 1.5)
    keep = np.isin(np.arange(vocab), [4, 8, 60])
    want[1, ~keep] = -np.inf
    want[2, 4] = want[2, 4] / 2.0 if want[2, 4] > 0 else want[2, 4] * 2.0
    want[3, 6] = -np.inf  # cond 17 == last token 17
    want[3, 6] += 1.5
    # row 4: cond 99 != 98: untouched
    np.testing.assert_allclose(got, want, rtol=1e-6)
    table.count(proc, np.array([7, 0, 4, 0, 0], np.int32))
    assert table.counts[2, 7] == 3 and table.counts[0, 4] == 1 and table.counts.sum() == 5


def test_n_beyond_max_num_seqs_still_prefills_each_prompt_once(tiny_model_dir):
    """More completions than running slots: a first sequence that finishes before all its siblings could fork hands
    the forking to a running sibling (same prompt KV), so no prompt is computed twice."""
    llm = llm_for(tiny_model_dir, block_size=4, max_num_seqs=6)
    backend = llm.llm_engine.backend
    computed: list[int] = []
    execute = backend.execute

    def counting(batch, *args):
        computed.extend(batch.positions.tolist())
        return execute(batch, *args)

    backend.execute = counting
    prompts = [PROMPT, "Hello there, how are you today my friend?"]
    lengths = [len(llm.tokenizer.encode(p)) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(n=8, max_tokens=3, temperature=1.0, seed=2, ignore_eos=True))
    assert [len(o.outputs) for o in outs] == [8, 8]
    counts = np.bincount(computed, minlength=max(lengths))
    short = min(lengths)
    assert all(counts[:short - 1] == 2) and counts[short - 1] == 8 + (lengths[0] != lengths[1])


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_model_dir):
    """The prompt's last N tokens run as if they were the prompt (greedy: the same tokens and logprobs); -1 keeps as
    many as leave max_tokens room under the length limit; a prompt over the limit runs once truncated."""
    llm = llm_for(tiny_model_dir)
    ids = llm.get_tokenizer().encode(PROMPT * 4)
    greedy = dict(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)
    cut = llm.generate(PROMPT * 4, SamplingParams(truncate_prompt_tokens=7, **greedy))[0]
    alone = llm.generate({"prompt_token_ids": ids[-7:]}, SamplingParams(**greedy))[0]
    assert cut.prompt_token_ids == ids[-7:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    assert cut.outputs[0].logprobs == alone.outputs[0].logprobs
    limit = llm.llm_engine.model_config.max_model_len
    long = {"prompt_token_ids": (ids * (limit // len(ids) + 2))[:limit + 9]}
    with pytest.raises(ValueError, match="the limit is"):
        llm.generate(long, SamplingParams(**greedy))
    out = llm.generate(long, SamplingParams(truncate_prompt_tokens=-1, **greedy))[0]
    assert len(out.prompt_token_ids) == limit - 5 and len(out.outputs[0].token_ids) == 5
    assert out.prompt_token_ids == long["prompt_token_ids"][-(limit - 5):]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=0"):
        SamplingParams(truncate_prompt_tokens=0)
