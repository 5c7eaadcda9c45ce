"""The engine end to end on the numpy backend with a tiny random model: batching, preemption, sampling, stops."""

import numpy as np
import pytest
from helpers import llm_for

from tinyvllm import SamplingParams
from tinyvllm.backends import sampler
from tinyvllm.engine import block_manager

PROMPTS = ["Hello there", "The quick brown fox jumps over", "a", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
           "émoji 🙂 and 漢字", "Once upon a time, in a land far away, there lived", "x y z", "tinyvllm"]


def texts_and_ids(outputs):
    return [(o.outputs[0].text, tuple(o.outputs[0].token_ids)) for o in outputs]


def assert_no_leaks(llm):
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert not llm.llm_engine.has_unfinished_requests()


def test_greedy_identical_alone_static_continuous_and_under_preemption(tiny_model_dir):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [llm_for(tiny_model_dir).generate(p, params)[0] for p in PROMPTS]
    static_llm = llm_for(tiny_model_dir, batching="static", max_num_seqs=3)
    static = static_llm.generate(PROMPTS, params)
    tight = llm_for(tiny_model_dir, batching="continuous", num_kv_blocks=24, block_size=4)
    continuous = tight.generate(PROMPTS, params)
    assert texts_and_ids(static) == texts_and_ids(alone)
    assert texts_and_ids(continuous) == texts_and_ids(alone)
    assert tight.llm_engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert all(len(o.outputs[0].token_ids) == 24 for o in continuous)
    assert_no_leaks(static_llm)
    assert_no_leaks(tight)


def test_seeded_sampling_independent_of_batch(tiny_model_dir):
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    llm = llm_for(tiny_model_dir)
    together = llm.generate(PROMPTS, params)
    alone = [llm.generate(p, sp)[0] for p, sp in zip(PROMPTS, params)]
    reordered = llm_for(tiny_model_dir, max_num_seqs=3, num_kv_blocks=12, block_size=4).generate(
        PROMPTS[::-1], params[::-1])[::-1]
    assert texts_and_ids(together) == texts_and_ids(alone) == texts_and_ids(reordered)
    other_seed = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != together[0].outputs[0].token_ids


def test_stop_string_token_and_length(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    base = llm.generate("Hello there", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    full = base.outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    # a stop string taken from the middle of the greedy text: output is cut before it
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = llm.generate("Hello there", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                     stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.find(stop)]
    # a stop token id: generation ends on it
    token = full.token_ids[5]
    by_token = llm.generate("Hello there", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                          stop_token_ids=[token]))[0].outputs[0]
    first = full.token_ids.index(token)
    assert by_token.token_ids == full.token_ids[: first + 1] and by_token.stop_reason == token


def test_logprobs_and_prompt_logprobs(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=5, temperature=0, logprobs=3,
                                                             prompt_logprobs=2, ignore_eos=True))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for token, entry in zip(comp.token_ids, comp.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert entry[token].logprob == pytest.approx(max(v.logprob for v in entry.values()))  # greedy: the most likely
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    # prompt logprobs agree with the logprob the model gives each next token when generating greedily
    ids = out.prompt_token_ids
    prefix = llm.generate([ids[:2]], SamplingParams(max_tokens=1, temperature=0, logprobs=0, ignore_eos=True))[0]
    first = prefix.outputs[0]
    if first.token_ids[0] == ids[2]:
        assert out.prompt_logprobs[2][ids[2]].logprob == pytest.approx(first.logprobs[0][ids[2]].logprob, abs=1e-4)
    assert all(ids[i] in out.prompt_logprobs[i] and len(out.prompt_logprobs[i]) <= 3 for i in range(1, len(ids)))
    # the prompt logprob of token i equals log_softmax of the logits at position i-1 (checked via a 1-token step)
    probe = llm.generate([ids[:3]], SamplingParams(max_tokens=1, temperature=0, logprobs=20, ignore_eos=True))[0]
    probe_entry = probe.outputs[0].logprobs[0]
    if ids[3] in probe_entry:
        assert out.prompt_logprobs[3][ids[3]].logprob == pytest.approx(probe_entry[ids[3]].logprob, abs=1e-4)


def test_more_logprobs_than_the_backend_returns_fail_alone(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    llm.llm_engine.backend.max_logprobs = 4  # as the cuda backend has (64)
    outs = llm.generate(["a", "b", "c"], [SamplingParams(max_tokens=3, logprobs=4), SamplingParams(max_tokens=3,
                        logprobs=5), SamplingParams(max_tokens=3, prompt_logprobs=9)], error_outputs=True)
    assert outs[0].error is None and len(outs[0].outputs[0].logprobs) == 3
    assert [o.outputs[0].finish_reason for o in outs[1:]] == ["error", "error"]
    assert "at most 4" in outs[1].error and "9 logprobs" in outs[2].error


def test_over_long_and_empty_prompts_fail_alone(tiny_model_dir):
    llm = llm_for(tiny_model_dir, max_model_len=32)
    outs = llm.generate(["ok prompt", "word " * 200, "", [10, 11, 12]], SamplingParams(max_tokens=4, temperature=0),
                        error_outputs=True)
    assert outs[0].error is None and outs[0].outputs[0].finish_reason in ("stop", "length")
    assert outs[1].outputs[0].finish_reason == "error" and "max_model_len" in outs[1].error
    assert len(outs[1].prompt_token_ids) > 32  # the rejected prompt's tokens are still reported
    assert outs[2].outputs[0].finish_reason == "error" and "empty" in outs[2].error
    assert outs[3].error is None and outs[3].prompt_token_ids == [10, 11, 12]
    assert_no_leaks(llm)


def test_generation_stops_at_max_model_len(tiny_model_dir):
    llm = llm_for(tiny_model_dir, max_model_len=20)
    out = llm.generate([list(range(3, 13))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 20


def test_metrics_are_ordered(tiny_model_dir):
    out = llm_for(tiny_model_dir).generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for o in out:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.queue_ms >= 0 and m.ttft_ms >= m.queue_ms and m.e2e_ms >= m.ttft_ms and m.tpot_ms >= 0


def test_chat_uses_template(tiny_model_dir):
    llm = llm_for(tiny_model_dir)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt == llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "hi" in out.prompt and out.prompt != "hi"


def test_invalid_sampling_params_name_the_field():
    for kwargs, name in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0},
                                                                                            "max_tokens"),
                         ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_sampling_noise_depends_on_seed_and_step_only():
    keys = sampler.step_keys(np.array([sampler.seed_key(42)] * 2, np.uint32), np.array([3, 3]))
    assert keys[0] == keys[1]


SHARED_PREFIX = "You are a careful assistant. Answer briefly and well. " * 3


@pytest.mark.parametrize("block_size,budget", [(4, 7), (5, 13), (16, 64)])
def test_prefix_caching_and_chunked_prefill_do_not_change_outputs(tiny_model_dir, block_size, budget):
    prompts = [SHARED_PREFIX + p for p in PROMPTS]
    params = [SamplingParams(max_tokens=12, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    reference = llm_for(tiny_model_dir, block_size=block_size, enable_prefix_caching=False,
                        enable_chunked_prefill=False, max_num_batched_tokens=4096).generate(prompts, params)
    cached = llm_for(tiny_model_dir, block_size=block_size, max_num_batched_tokens=budget)
    # run twice: the second pass finds every shared prefix (and the first pass's whole prompts) cached
    first = cached.generate(prompts, params)
    second = cached.generate(prompts, params)
    bm = cached.llm_engine.block_manager
    assert bm.num_hit_tokens > 0 and 0 < bm.prefix_cache_hit_rate < 1
    assert texts_and_ids(first) == texts_and_ids(reference)
    assert texts_and_ids(second) == texts_and_ids(reference)
    assert_no_leaks(cached)


def test_prefix_cache_is_not_fooled_by_colliding_hashes(tiny_model_dir, monkeypatch):
    """Blocks used to be keyed by Python's 64-bit hash(): with every hash() colliding, another prompt's KV was
    served. The keys must not rest on hash(): different prompts miss, the same prompt still hits."""
    monkeypatch.setattr(block_manager, "hash", lambda value: 0, raising=False)  # shadows the builtin there
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [list(range(1, 20)), list(range(100, 119)), list(range(1, 20))]
    reference = llm_for(tiny_model_dir, block_size=4, enable_prefix_caching=False)
    cached = llm_for(tiny_model_dir, block_size=4)
    bm = cached.llm_engine.block_manager
    hits = []
    for prompt in prompts:  # one at a time: each finds what the ones before it cached
        assert texts_and_ids(cached.generate([prompt], params)) == texts_and_ids(reference.generate([prompt], params))
        hits.append(bm.num_hit_tokens)
    assert hits == [0, 0, 16]  # the repeat reuses its 4 full blocks (its last token is always computed)
    assert_no_leaks(cached)


def test_chunked_prefill_keeps_prompt_logprobs(tiny_model_dir):
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, ignore_eos=True)
    whole = llm_for(tiny_model_dir, enable_chunked_prefill=False).generate(SHARED_PREFIX, params)[0]
    chunked = llm_for(tiny_model_dir, max_num_batched_tokens=5).generate(SHARED_PREFIX, params)[0]
    assert len(chunked.prompt_logprobs) == len(whole.prompt_logprobs) == len(whole.prompt_token_ids)
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(a[k].logprob == pytest.approx(b[k].logprob, abs=1e-4) for k in a)
    assert whole.outputs[0].token_ids == chunked.outputs[0].token_ids


def test_one_step_ahead_drops_the_extra_token_and_wastes_no_step_at_the_length_limit(tiny_model_dir):
    """The engine queues step N+1 before reading step N's tokens: a sequence stopped by a sampled token must end
    exactly there, mixed in a batch with others, with its blocks all returned; a length limit costs no extra step."""
    llm = llm_for(tiny_model_dir)
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = [o.outputs[0] for o in llm.generate(PROMPTS, free)]
    # every other prompt stops on the 4th token it generates, while the rest run on in the same batches
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[c.token_ids[3]])
              if i % 2 == 0 else free for i, c in enumerate(full)]
    mixed = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    for i, (c, m) in enumerate(zip(full, mixed)):
        if i % 2 == 0:
            assert m.token_ids == c.token_ids[: c.token_ids.index(c.token_ids[3]) + 1] and m.finish_reason == "stop"
        else:
            assert m.token_ids == c.token_ids and m.finish_reason == "length"
    assert_no_leaks(llm)
    alone = llm_for(tiny_model_dir)
    alone.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert alone.llm_engine.num_steps == 5  # one prefill + 4 decodes: no step for a token past max_tokens


def test_stops_and_preemption_while_a_step_is_in_flight(tiny_model_dir):
    """Under a cache so tight that sequences are preempted while their next token is still being sampled, with
    stop tokens ending many of them on such a token: outputs equal each request run alone, and nothing leaks."""
    llm = llm_for(tiny_model_dir)
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[ids[10 + i]])
              for i, ids in enumerate(full)]
    alone = [llm.generate(p, sp)[0] for p, sp in zip(PROMPTS, params)]
    tight = llm_for(tiny_model_dir, num_kv_blocks=24, block_size=4)
    together = tight.generate(PROMPTS, params)
    assert texts_and_ids(together) == texts_and_ids(alone)
    assert [o.outputs[0].finish_reason for o in together] == ["stop"] * len(PROMPTS)
    assert tight.llm_engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert_no_leaks(tight)


def test_prompt_logprobs_start_lets_the_prefix_cache_serve_the_context(tiny_model_dir):
    """A prompt-logprob request that asks only from index `start` on takes the blocks before it from the prefix cache:
    those positions are not computed again, the logprobs it asks for equal a cold run's, the others are None."""
    rng = np.random.default_rng(3)
    context, tail = rng.integers(3, 500, 37).tolist(), rng.integers(3, 500, 5).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2, prompt_logprobs_start=len(context))
    cold = llm_for(tiny_model_dir, block_size=4, enable_prefix_caching=False).generate([context + tail], params)[0]
    llm = llm_for(tiny_model_dir, block_size=4)
    llm.generate([context], SamplingParams(max_tokens=1))  # caches the context's 9 full blocks
    computed: list[int] = []
    execute = llm.backend.execute

    def counting(batch, *args):
        computed.extend(batch.positions.tolist())
        return execute(batch, *args)

    llm.backend.execute = counting
    warm = llm.generate([context + tail], params)[0]
    assert min(computed) == 36 // 4 * 4, "positions before the last block that predicts no asked token come cached"
    assert warm.prompt_logprobs[: len(context)] == [None] * len(context) == cold.prompt_logprobs[: len(context)]
    for a, b in zip(warm.prompt_logprobs[len(context):], cold.prompt_logprobs[len(context):]):
        assert a.keys() == b.keys() and np.allclose([v.logprob for v in a.values()], [v.logprob for v in b.values()],
                                                    atol=1e-5)
    everything = llm.generate([context + tail], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert everything.prompt_logprobs[0] is None and all(e is not None for e in everything.prompt_logprobs[1:])
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs_start"):
            SamplingParams(prompt_logprobs=1, prompt_logprobs_start=bad)
    from tinyvllm.io.readers import BadRow, parse_request
    assert parse_request({"prompt": "x", "prompt_logprobs_start": 4.0}).overrides["prompt_logprobs_start"] == 4
    with pytest.raises(BadRow, match="prompt_logprobs_start"):
        parse_request({"prompt": "x", "prompt_logprobs_start": -2})


def test_batch_rows_follow_growth_replacement_and_release():
    """The engine's persistent rows equal the sequences' block tables through growth (past the array's first width
    and row count), a table replaced after preemption (also a shorter one), rows released and reused, and other
    instances gathering the same sequences; and the sampling fields of a row are those of the sequence holding it,
    also after the row went to another sequence."""
    from tinyvllm.engine.model_inputs import BatchRows, _noise_keys
    from tinyvllm.engine.sequence import Sequence
    from tinyvllm.outputs import RequestMetrics

    rng = np.random.default_rng(0)

    def sequence(i, prompt, **kw):
        temperature = 0.0 if i % 5 == 0 else float(rng.random())  # every fifth greedy
        params = SamplingParams(temperature=temperature, top_p=float(rng.uniform(0.1, 1)),
                                top_k=int(rng.integers(0, 50)), min_p=float(rng.random() / 2),
                                logprobs=None if i % 3 else int(rng.integers(0, 5)),
                                prompt_logprobs=None if i % 4 else 1)
        return Sequence(str(i), i, None, prompt, params, 0, int(rng.integers(1 << 32)), RequestMetrics(0.0), **kw)

    seqs = [sequence(i, [1, 2]) for i in range(20)]
    tables = BatchRows()

    def check(batch):
        width = max(len(s.block_table) for s in batch)
        want = np.zeros((len(batch), width), np.int32)
        for row, s in enumerate(batch):
            want[row, : len(s.block_table)] = s.block_table
        rows, got = tables.gather(batch)
        np.testing.assert_array_equal(got, want)
        for name, (dtype, value) in BatchRows.FIELDS.items():
            np.testing.assert_array_equal(tables.fields[name][rows], np.array([value(s) for s in batch], dtype))
        assert tables.fields["sampling_key"][rows].tolist() == [s.sampling_key for s in batch]
        fields, asked = tables.gather_fields(rows), [i for i, s in enumerate(batch) if s.params.logprobs is not None]
        assert fields["num_logprobs"] == max((batch[i].params.logprobs for i in asked), default=-1)
        some = 0 < len(asked) < len(batch)  # the rows asking logprobs are listed only when not every row asks
        assert (fields["logprob_rows"].tolist() if some else fields["logprob_rows"]) == (asked if some else None)
        # noise keys: step_keys where the row samples at random; 0 for greedy rows, which draw no noise
        lengths = np.array([len(s.token_ids) + 3 for s in batch])
        keys = _noise_keys(fields, lengths)
        drawn = sampler.step_keys(fields["sampling_key"], lengths - fields["num_prompt_tokens"])
        random = np.array([s.params.temperature > 0 for s in batch])
        assert (keys[random] == drawn[random]).all() and not keys[~random].any()
        # a throwaway instance (as build_batch makes without one) on the same sequences: their rows elsewhere are
        # no claim on its rows
        np.testing.assert_array_equal(BatchRows().gather(batch[::-1])[1], want[::-1])
        np.testing.assert_array_equal(tables.gather(batch)[1], want)

    for step in range(60):
        for s in seqs:
            if rng.random() < 0.3:
                s.block_table.append(int(rng.integers(1000)))
            if rng.random() < 0.03:  # preempted and allocated again: a new list, maybe shorter
                s.block_table = [int(b) for b in rng.integers(1000, size=rng.integers(1, 4))]
        if step % 7 == 3:
            gone = seqs.pop(int(rng.integers(len(seqs))))
            tables.release(gone)
            assert gone.table_row == -1
            seqs.append(sequence(100 + step, [1], block_table=[int(b) for b in rng.integers(1000, size=3)]))
        batch = [s for s in seqs if s.block_table and rng.random() < 0.8]
        if batch:
            check(batch)
    assert len({s.table_row for s in seqs if s.table_row >= 0}) == sum(s.table_row >= 0 for s in seqs)


def test_block_hash_is_sha256_of_the_parent_and_the_token_ids_as_int32():
    """A prefix-cache key: sha256 over the parent block's hash and the block's ids as little-endian int32, for a full
    block and any other length (the packer is made once per length)."""
    import hashlib
    import struct

    block_hash = block_manager.block_hash
    first = block_hash(b"", list(range(16)))
    assert first == hashlib.sha256(struct.pack("<16i", *range(16))).digest()
    ids = [7, -1, 2**31 - 1]
    assert block_hash(first, ids) == hashlib.sha256(first + struct.pack("<3i", *ids)).digest()
    assert block_hash(first, [1, 2]) != block_hash(b"", [1, 2])


@pytest.mark.parametrize("prompt,error", [
    ([5, 1.5, 7], "prompt token id 1.5 is not an integer"),  # not truncated to 1
    ([5, np.float32(2.25)], "prompt token id 2.25 is not an integer"),
    ([5, "3"], "prompt token id '3' is not an integer"),
    ([5, None], "prompt token id None is not an integer"),
    (4, "a prompt is text or a list of token ids, not int"),
    (b"ab", "a prompt is text or a list of token ids, not bytes"),
])
def test_prompt_token_ids_that_are_not_integers_are_refused(tiny_model_dir, prompt, error):
    """A token id must be an integer (or an integral float): any other is refused in one line, never truncated."""
    engine = llm_for(tiny_model_dir).llm_engine
    assert engine.add_request("r", prompt, SamplingParams(max_tokens=2)) == error
    assert [out.error for out in engine.step()] == [error]


def test_prompt_token_ids_keep_their_values():
    """Ints, numpy ints, bools and integral floats become the same ints, from a list, a tuple or an array."""
    from tinyvllm.engine.requests import _token_ids

    assert _token_ids([3, np.int64(4), True, 5.0, np.float64(6.0)]) == [3, 4, 1, 5, 6]
    assert _token_ids((7, 8)) == [7, 8] == _token_ids(np.array([7, 8], np.int32))
    assert all(type(t) is int for t in _token_ids(np.array([7, 8.0])))
    assert _token_ids(iter([1, 2.0])) == [1, 2]  # an iterator, read once, through the careful path


@pytest.mark.parametrize("prompt,bad", [([5, -1, 7, 100000], -1), ([5, 6, 100000, -2], 100000),
                                        ([np.int64(4), 3.0], None), (np.array([4, 3], np.int32), None),
                                        (np.array([5, -1, 7, 100000], np.int32), -1),
                                        (np.array([5, 6, 100000, -2], np.int64), 100000),
                                        (np.array([5, 6, 7, 100000], np.uint32), 100000),
                                        (np.array([9, 4, 8, 3], np.int16)[1::2], None)])
def test_prompt_token_ids_outside_the_vocabulary_are_refused_by_the_first(tiny_model_dir, prompt, bad):
    """A token-id prompt with ids outside the vocabulary gets an error output naming the first of them; numpy ints
    and integral floats are taken as ints; integer arrays (a job's worker sends int32 ones), strided too, are
    checked in one reduction with the same outcome."""
    engine = llm_for(tiny_model_dir).llm_engine
    vocab = engine.requests.vocab_size
    assert engine.add_request("r", prompt, SamplingParams(max_tokens=2)) == (
        None if bad is None else f"prompt token id {bad} is outside the vocabulary (size {vocab})")
    outputs = []
    while engine.has_unfinished_requests() or not outputs:
        outputs += engine.step()
    error = outputs[0].error
    if bad is None:
        assert error is None and outputs[0].prompt_token_ids == [4, 3]
    else:
        assert error == f"prompt token id {bad} is outside the vocabulary (size {vocab})"


def test_device_busy_follows_the_queued_step(tiny_model_dir):
    """LLMEngine.device_busy() is what the step queued last says of itself: busy while its done() is False, not
    once it is True, and not where the backend cannot tell (done None) or nothing is queued."""
    engine = llm_for(tiny_model_dir).llm_engine
    assert not engine.device_busy()  # nothing queued
    engine.add_request("r", [4, 3], SamplingParams(max_tokens=8))
    engine.step()
    queued = engine._in_flight.queued
    assert queued.done is None and not engine.device_busy()  # the numpy backend runs a step at once
    finished = [False]
    queued.done = lambda: finished[0]
    assert engine.device_busy()
    finished[0] = True
    assert not engine.device_busy()
