"""Logits processors, the token-count table and KV block copies on the GPU: each kernel against its numpy twin on
fresh random inputs, then the engine end to end (penalties under one-step-ahead pipelining, n > 1 sharing the
prompt) against the numpy backend."""

from dataclasses import replace

import numpy as np
import pytest

from agreement import agreed_tokens
from tinyvllm import LLM, SamplingParams
from tinyvllm.backends import sampler
from tinyvllm.backends.base import LogitsProcessing
from tinyvllm.model.dummy import random_weights, save_hf_model_dir, smollm2_135m_config

pytestmark = pytest.mark.gpu


def random_processing(rng, rows: int, vocab: int, slots: int) -> tuple[LogitsProcessing, np.ndarray]:
    """A LogitsProcessing touching every feature, and each row's last input token."""
    penalty_slots = np.where(rng.random(rows) < 0.6, rng.permutation(slots)[:rows], -1).astype(np.int32)
    allowed_lens = np.where(rng.random(rows) < 0.3, rng.integers(1, 40, rows), 0)
    bias_lens = rng.integers(0, 12, rows)
    allowed = [np.unique(rng.integers(0, vocab, n)).astype(np.int32) for n in allowed_lens]
    last = rng.integers(0, vocab, rows).astype(np.int32)
    bias_ids = rng.integers(0, vocab, bias_lens.sum()).astype(np.int32)
    bias_ids[::5] = bias_ids[0]  # repeated ids add up
    bias_values = rng.normal(0, 3, len(bias_ids)).astype(np.float32)
    bias_values[::7] = -np.inf
    row_of = np.repeat(np.arange(rows), bias_lens)
    bias_cond = np.where(rng.random(len(bias_ids)) < 0.3, np.where(rng.random(len(bias_ids)) < 0.5,
                                                                   last[row_of], last[row_of] + 1), -1)
    return LogitsProcessing(
        penalty_slots=penalty_slots, count_slots=np.where(rng.random(rows) < 0.8, penalty_slots, -1).astype(np.int32),
        presence=rng.uniform(-2, 2, rows).astype(np.float32), frequency=rng.uniform(-2, 2, rows).astype(np.float32),
        repetition=rng.uniform(0.5, 3, rows).astype(np.float32),
        allowed_ptr=np.r_[0, np.cumsum([len(a) for a in allowed])].astype(np.int32),
        allowed_ids=np.concatenate(allowed).astype(np.int32),
        bias_ptr=np.r_[0, np.cumsum(bias_lens)].astype(np.int32), bias_ids=bias_ids, bias_values=bias_values,
        bias_cond=bias_cond.astype(np.int32),
        slot_inits=[(slot, rng.integers(0, vocab, rng.integers(1, 50)).astype(np.int32),
                     rng.integers(0, vocab, rng.integers(0, 30)).astype(np.int32)) for slot in range(slots)]), last


@pytest.mark.parametrize("rows,vocab", [(7, 1000), (33, 49152)])
def test_logits_processors_match_numpy(cuda, ops, rows, vocab):
    rng = np.random.default_rng(rows)
    slots = rows + 3
    proc, last = random_processing(rng, rows, vocab, slots)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
    # half the rows' last tokens come from the previous step's sampled ids on the device
    prev_sampled = rng.integers(0, vocab, rows).astype(np.int32)
    last_src = np.where(rng.random(rows) < 0.5, rng.integers(0, rows, rows), -1).astype(np.int32)
    resolved = np.where(last_src >= 0, prev_sampled[np.maximum(last_src, 0)], last)

    table = sampler.TokenCounts(slots, vocab)
    table.init_slots(proc.slot_inits)
    want = logits.copy()
    sampler.apply_logits_processing(want, proc, resolved, table)

    d = {name: cuda.to_device(np.ascontiguousarray(a)) for name, a in {
        "logits": logits, "last": last, "last_src": last_src, "sampled": prev_sampled,
        "penalty_slots": proc.penalty_slots, "presence": proc.presence, "frequency": proc.frequency,
        "repetition": proc.repetition, "allowed_ptr": proc.allowed_ptr, "allowed_ids": np.r_[proc.allowed_ids, 0],
        "bias_ptr": proc.bias_ptr,
        "bias": np.stack([proc.bias_ids, proc.bias_values.view(np.int32), proc.bias_cond], 1).ravel(),
        "counts": np.full((slots, vocab), 12345, np.int32), "prompt_mask": np.full((slots, vocab), 7, np.uint8),
        "slots": np.array([s for s, _, _ in proc.slot_inits], np.int32),
        "tokens": np.concatenate([t for _, p, o in proc.slot_inits for t in (p, o)]).astype(np.int32),
        "token_slots": np.concatenate([np.r_[np.full(len(p), -1 - s), np.full(len(o), s)]
                                       for s, p, o in proc.slot_inits]).astype(np.int32)}.items()}
    ops.clear_token_slots(d["counts"], d["prompt_mask"], vocab, d["slots"], slots)
    ops.fill_token_slots(d["counts"], d["prompt_mask"], vocab, d["tokens"], d["token_slots"],
                         sum(len(p) + len(o) for _, p, o in proc.slot_inits))
    ops.apply_logits_processors(d["logits"], rows, vocab, d["last"], d["last_src"], d["sampled"],
                                d["penalty_slots"], d["presence"], d["frequency"], d["repetition"], d["counts"],
                                d["prompt_mask"], d["allowed_ptr"], d["allowed_ids"], d["bias_ptr"], d["bias"])
    got = cuda.from_device(d["logits"], (rows, vocab), np.float32)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)

    sampled = rng.integers(0, vocab, rows).astype(np.int32)
    d["new"] = cuda.to_device(sampled)
    d["count_slots"] = cuda.to_device(proc.count_slots)
    ops.count_tokens(d["counts"], vocab, d["new"], d["count_slots"], rows)
    table.count(proc, sampled)
    assert np.array_equal(cuda.from_device(d["counts"], (slots, vocab), np.int32), table.counts)
    assert np.array_equal(cuda.from_device(d["prompt_mask"], (slots, vocab), np.uint8).astype(bool),
                          table.prompt_mask)


def test_copy_blocks_matches_numpy(cuda, ops):
    rng = np.random.default_rng(1)
    num_caches, num_blocks, block_elems = 6, 40, 16 * 3 * 64
    caches = [rng.integers(0, 1 << 16, num_blocks * block_elems).astype(np.uint16) for _ in range(num_caches)]
    pairs = np.array([[3, 9], [10, 0], [39, 38]], np.int32)
    dev = [cuda.to_device(c) for c in caches]
    pointers = cuda.to_device(np.array([int(c) for c in dev], np.uint64))
    ops.copy_blocks(pointers, num_caches, cuda.to_device(pairs), len(pairs), block_elems)
    for cache, device in zip(caches, dev):
        want = cache.reshape(num_blocks, block_elems).copy()
        for src, dst in pairs:
            want[dst] = want[src]
        assert np.array_equal(cuda.from_device(device, cache.shape, np.uint16).reshape(want.shape), want)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = replace(smollm2_135m_config(), num_hidden_layers=2)
    return save_hf_model_dir(tmp_path_factory.mktemp("smollm2_2l"), config, random_weights(config, 5),
                             dtype="bfloat16")


def test_penalties_and_biases_through_the_pipelined_engine(cuda, model_dir):
    """Strong penalties, biases, bans and min_tokens on several requests batched on the GPU (one step ahead): the
    tokens follow the numpy backend's for as long as no near-tie splits them, and every processed logprob where
    they agree is close; a wrong count or a missed pending token would move a logprob by a whole penalty."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 49152, rng.integers(4, 40)).tolist() for _ in range(8)]
    fields = [dict(frequency_penalty=1.5), dict(presence_penalty=1.8, repetition_penalty=1.5),
              dict(repetition_penalty=2.5), dict(logit_bias={100: 8.0, 200: 6.0}, frequency_penalty=0.7),
              dict(allowed_token_ids=list(range(50, 90))), dict(min_tokens=6), {}, dict(presence_penalty=-1.0)]
    params = [SamplingParams(max_tokens=24, temperature=0, logprobs=8, ignore_eos=i != 5, **f)
              for i, f in enumerate(fields)]
    outs = {}
    for backend in ("numpy", "cuda"):
        llm = LLM(model_dir, backend=backend, max_num_seqs=8, num_kv_blocks=256, max_model_len=512)
        outs[backend] = llm.generate(prompts, params)
        if backend == "cuda":
            llm.backend.close()
    agreed = 0
    for want, got, sp in zip(outs["numpy"], outs["cuda"], params):
        agreed += agreed_tokens(want.outputs[0], got.outputs[0])
        if sp.allowed_token_ids:
            assert set(got.outputs[0].token_ids) <= set(sp.allowed_token_ids)
    assert agreed >= 100, f"only {agreed} tokens agreed"
    print(f"REPORT logits processors: {agreed} of {sum(len(o.outputs[0].token_ids) for o in outs['cuda'])} "
          "tokens agree with numpy")


def test_n_completions_prefill_the_prompt_once(cuda, model_dir):
    # room for all 64 x 8 at once (with less, a completion that cannot fork before its siblings finish starts
    # afresh: the prefix cache then serves the full blocks and only the last partial block is computed again)
    llm = LLM(model_dir, backend="cuda", max_num_seqs=512, num_kv_blocks=4096, max_model_len=512, block_size=16)
    backend = llm.llm_engine.backend
    computed = []
    submit = backend.submit

    def counting(batch):
        computed.extend(batch.positions.tolist())
        return submit(batch)

    backend.submit = counting
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 49152, 37).tolist() for _ in range(64)]
    params = SamplingParams(n=8, max_tokens=12, temperature=1.0, seed=9, ignore_eos=True)
    outs = llm.generate(prompts, params)
    counts = np.bincount(computed)
    assert all(counts[:36] == len(prompts)) and counts[36] == 8 * len(prompts)
    assert all(len({tuple(c.token_ids) for c in o.outputs}) == 8 for o in outs)
    again = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in outs]
    print(f"REPORT n=8 on {len(prompts)} prompts of 37 tokens: prompt positions 0..35 computed "
          f"{int(counts[:36].max())}x each (once per prompt), position 36 {int(counts[36])}x (once per completion)")
    llm.backend.close()
