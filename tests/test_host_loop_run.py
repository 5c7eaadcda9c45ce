"""The DecodeRun (engine/persistent_batch.py) against the engine without it: over random arrivals, finishes, aborts
and preemptions (a small KV cache), every step's Batch is the one the engine builds from the sequences' fields, the
sequences' state written back is theirs, and the outputs are the same."""

import numpy as np
import pytest

from tinyvllm import SamplingParams
from tinyvllm.engine import logprob_buffer
from tinyvllm.engine import persistent_batch
from tinyvllm.engine.persistent_batch import CAPACITY, DecodeRun
from tinyvllm.logprobs import FlatLogprobs

from helpers import llm_for

BATCH_ARRAYS = ("token_ids", "positions", "slot_mapping", "query_start_loc", "context_lens", "block_tables",
                "token_sources", "block_copies", "bitmask_rows", "logits_indices")


def engine_for(model_dir, with_run: bool, **kw):
    llm = llm_for(model_dir, max_num_seqs=6, num_kv_blocks=kw.pop("num_kv_blocks", 24), block_size=4,
                  max_model_len=96, **kw)
    engine = llm.llm_engine
    if not with_run:
        engine.run = engine.scheduler.run = engine.output_processor.run = None
    batches = []
    submit = engine.backend.submit

    def recording(batch):
        batches.append(snapshot(batch))
        return submit(batch)

    engine.backend.submit = recording
    return llm, engine, batches


def snapshot(batch) -> dict:
    """The batch's arrays and sampling / logits-processing fields, copied (submit overwrites token_ids)."""
    out = {name: None if getattr(batch, name) is None else np.array(getattr(batch, name)) for name in BATCH_ARRAYS}
    out["sampling"] = {k: np.array(v) for k, v in vars(batch.sampling).items()}
    proc = batch.logits_processing
    out["processing"] = None if proc is None else {k: (v if k == "slot_inits" else np.array(v))
                                                  for k, v in vars(proc).items()}
    out["targets"] = {k: v.tolist() for k, v in batch.prompt_logprob_targets.items()}
    return out


def random_params(rng, reference_text: str) -> SamplingParams:
    """Greedy or seeded sampling, with some of: a stop string, a stop token, logprobs, penalties, n = 2,
    min_tokens, a bad word (a row that cannot join the run), prompt logprobs, allowed_token_ids, logit_bias, a
    structured output (a regex, a choice or a JSON schema)."""
    kw = {"max_tokens": int(rng.integers(1, 40)), "temperature": float(rng.choice([0.0, 0.8])),
          "seed": int(rng.integers(1000)), "ignore_eos": bool(rng.random() < 0.5)}
    roll = rng.random(11)
    if roll[0] < 0.25 and len(reference_text) > 4:
        start = int(rng.integers(0, len(reference_text) - 3))
        kw["stop"] = [reference_text[start: start + 2]]
    if roll[1] < 0.2:
        kw["stop_token_ids"] = [int(rng.integers(3, 60))]
    if roll[2] < 0.3:
        kw["logprobs"] = int(rng.integers(0, 3))
    if roll[3] < 0.3:
        kw.update(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1)
    if roll[4] < 0.15:
        kw["n"] = 2
    if roll[5] < 0.15:
        kw["min_tokens"] = min(3, kw["max_tokens"])
    if roll[6] < 0.05:
        kw["bad_words"] = ["ab"]
    if roll[7] < 0.1:
        kw["prompt_logprobs"] = 1
    if roll[8] < 0.1:
        kw["allowed_token_ids"] = rng.choice(np.arange(3, 300), 40, replace=False).tolist()
    if roll[9] < 0.15:
        kw["logit_bias"] = {int(rng.integers(3, 300)): 3.0, int(rng.integers(3, 300)): -100.0}
    if roll[10] < 0.25:
        kw["structured_outputs"] = STRUCTURED[int(rng.integers(len(STRUCTURED)))]
    return SamplingParams(**kw)


STRUCTURED = [{"regex": "(ab|cd)[0-9]{2,12}"}, {"choice": ["yes", "no way", "maybe so"]},
              {"json": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                        "required": ["a", "b"], "additionalProperties": False}}]


def drive(engine, plan, aborts) -> dict:
    """Run the plan (step -> [(request id, prompt, params)]) and the aborts (step -> request ids) to the end;
    {request id: output}. After each step, the running sequences' fields (the run's written back)."""
    outputs, states, step, attached = {}, [], 0, 0
    while step <= max(plan) or engine.has_unfinished_requests():
        for request_id, prompt, params in plan.get(step, []):
            engine.add_request(request_id, prompt, params)
        if step in aborts:
            engine.abort_request(aborts[step])
        for out in engine.step():
            outputs[out.request_id] = out
        states.append(running_state(engine))
        attached += 0 if engine.run is None else engine.run.count
        step += 1
        assert step < 2000, "the engine did not finish"
    assert engine.run is None or attached, "no step had rows in the run"
    return outputs, states


def running_state(engine) -> list[tuple]:
    """Each running sequence's scheduling state, as its fields would hold it without the run."""
    run = engine.run
    state = []
    for seq in engine.scheduler.running:
        tokens, computed, pending, row = list(seq.token_ids), seq.num_computed_tokens, seq.num_pending, seq.sample_row
        if run is not None and seq.run_slot >= 0:
            slot = seq.run_slot
            tokens += run.buf[slot, : run.ctx[slot] - run.base[slot]].tolist()
            computed, pending, row = int(run.computed[slot]), int(run.pending[slot]), int(run.sample_row[slot])
        state.append((seq.request_id, seq.index, tuple(tokens), computed, pending, row, tuple(seq.block_table),
                      seq.num_hashed_blocks if run is None or seq.run_slot < 0 else None))
    return state


def completions(outputs: dict) -> dict:
    return {rid: (out.error, [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
                              for c in out.outputs], out.prompt_logprobs) for rid, out in outputs.items()}


def random_plan(rng, vocab: int, reference_text: str) -> tuple[dict, dict]:
    plan, aborts, prompts = {}, {}, []
    for i in range(int(rng.integers(10, 18))):
        step = int(rng.integers(0, 40))
        if prompts and rng.random() < 0.3:  # a shared prefix: prefix-cache hits on prompt and output blocks
            prompt = prompts[int(rng.integers(len(prompts)))] + rng.integers(3, vocab, int(rng.integers(1, 6))).tolist()
        else:
            prompt = rng.integers(3, vocab, int(rng.integers(2, 30))).tolist()
        prompts.append(prompt)
        plan.setdefault(step, []).append((f"r{i}", prompt, random_params(rng, reference_text)))
        if rng.random() < 0.1:
            aborts.setdefault(step + int(rng.integers(1, 12)), []).append(f"r{i}")
    return plan, aborts


CONFIGS = [{}, {"enable_prefix_caching": False}, {"enable_chunked_prefill": False, "max_num_batched_tokens": 32},
           {"batching": "static"}]


@pytest.mark.parametrize("seed,config", [(seed, {}) for seed in range(6)]
                         + [(10 + i, config) for i, config in enumerate(CONFIGS[1:])])
@pytest.mark.parametrize("num_kv_blocks", [24, 200])  # 24: preemptions
def test_run_matches_the_engine_without_it(tiny_model_dir, seed, config, num_kv_blocks):
    """Same batches step by step (the run's deltas against the rebuild from the sequences' fields), same running
    state, same outputs, same preemptions and prefix-cache contents; also without prefix caching, without chunked
    prefill (a small budget) and with static batching."""
    rng = np.random.default_rng(seed)
    _, plain, plain_batches = engine_for(tiny_model_dir, False, num_kv_blocks=num_kv_blocks, **config)
    _, fast, fast_batches = engine_for(tiny_model_dir, True, num_kv_blocks=num_kv_blocks, **config)
    reference_text = plain.tokenizer.decode(rng.integers(3, 200, 40).tolist())
    plan, aborts = random_plan(rng, plain.config.vocab_size, reference_text)
    want, want_states = drive(plain, plan, aborts)
    got, got_states = drive(fast, plan, aborts)
    assert len(fast_batches) == len(plain_batches)
    for i, (a, b) in enumerate(zip(fast_batches, plain_batches)):
        np.testing.assert_equal(a, b, err_msg=f"batch {i}")
    for i, (a, b) in enumerate(zip(got_states, want_states)):
        assert [s[:7] for s in a] == [s[:7] for s in b], f"state after step {i}"
    assert completions(got) == completions(want)
    assert fast.scheduler.num_preemptions == plain.scheduler.num_preemptions
    assert fast.block_manager.cached == plain.block_manager.cached
    assert fast.run.count == 0 and not fast.run.log


@pytest.mark.parametrize("per_step", [0, 1, 32])
def test_run_holds_steady_decodes_and_buffers_past_its_capacity(tiny_model_dir, monkeypatch, per_step):
    """A long greedy decode of a few sequences is held by the run (its steps' rows attached) and outlasts the
    buffer's capacity (its known tokens are moved into token_ids: a few rows a step once past 3/4 of it, every
    full one at once; per_step 0: only full ones), with the outputs of the engine without it."""
    monkeypatch.setattr(persistent_batch, "COMPACT_PER_STEP", per_step)
    params = SamplingParams(max_tokens=CAPACITY + 40, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    outs = []
    for with_run in (True, False):
        llm = llm_for(tiny_model_dir, max_model_len=CAPACITY + 64)
        engine = llm.llm_engine
        if not with_run:
            engine.run = engine.scheduler.run = engine.output_processor.run = None
        attached = []
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out.outputs[0].token_ids
            if with_run:
                attached.append(engine.run.count)
        outs.append(done)
        if with_run:
            assert isinstance(engine.run, DecodeRun) and attached.count(3) >= CAPACITY
    assert outs[0] == outs[1] and all(len(ids) == CAPACITY + 40 for ids in outs[0].values())


def test_run_holds_rows_with_logits_processors_that_stay_the_same(tiny_model_dir):
    """allowed_token_ids, logit_bias, penalties and min_tokens (once reached) let a row join: every step's Batch
    (its LogitsProcessing kept while the rows stay) and the outputs are the engine's without the run."""
    rng = np.random.default_rng(7)
    plan = {0: [], 3: []}
    for i in range(8):
        params = SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 0.7, seed=i, ignore_eos=True,
                                allowed_token_ids=list(range(3, 80)) if i % 3 == 0 else None,
                                logit_bias={int(rng.integers(3, 80)): 2.5}, presence_penalty=0.3 * (i % 2),
                                repetition_penalty=1.0 + 0.1 * (i % 3), min_tokens=4 if i % 4 == 0 else 0)
        plan[0 if i < 5 else 3].append((f"r{i}", rng.integers(3, 300, 6 + i).tolist(), params))
    results = []
    for with_run in (False, True):
        _, engine, batches = engine_for(tiny_model_dir, with_run, num_kv_blocks=200)
        outputs, _ = drive(engine, plan, {})
        results.append((completions(outputs), batches))
        if with_run:
            assert engine.run.blocker is None
    (want, want_batches), (got, got_batches) = results
    assert got == want and len(got_batches) == len(want_batches)
    for i, (a, b) in enumerate(zip(got_batches, want_batches)):
        np.testing.assert_equal(a, b, err_msg=f"batch {i}")


@pytest.mark.parametrize("seed", range(4))
def test_run_commits_before_a_cached_block_is_evicted(tiny_model_dir, seed):
    """Greedy requests repeating earlier prompts fill blocks whose hashes a freed block still holds; with the cache
    tight, those freed blocks are evicted while the run's commits are logged: the prefix cache ends as the engine's
    without the run (the logged commits are made before an eviction)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 300, int(rng.integers(5, 12))).tolist() for _ in range(3)]
    plan = {}
    for i in range(12):
        params = SamplingParams(max_tokens=int(rng.integers(10, 30)), temperature=0, ignore_eos=True)
        plan.setdefault(int(rng.integers(0, 60)), []).append((f"r{i}", prompts[i % 3], params))
    results = []
    for with_run in (False, True):
        _, engine, _ = engine_for(tiny_model_dir, with_run, num_kv_blocks=40)
        outputs, _ = drive(engine, plan, {})
        results.append((completions(outputs), dict(engine.block_manager.cached), engine.block_manager.block_hashes,
                        engine.block_manager.num_hit_tokens))
    assert results[1] == results[0]


@pytest.mark.parametrize("seed", range(3))
def test_run_buffers_logprobs_in_blocks(tiny_model_dir, monkeypatch, seed):
    """Every row asks for logprobs (k 0-3, some with a stop string, some aborted, preemptions in a small cache);
    with a slot's buffer of 3 positions the run passes most entries on in blocks, when a buffer fills, when a row
    leaves and before a row's token is looked at alone: the entries and cumulative logprobs are the engine's
    without the run, and each completion has one entry per token (stop tokens looked at alone included)."""
    monkeypatch.setattr(logprob_buffer, "LOGPROB_CHUNK", 3)
    rng = np.random.default_rng(seed)
    plan, aborts = {}, {}
    for i in range(12):
        kw = {"max_tokens": int(rng.integers(5, 40)), "temperature": float(rng.choice([0.0, 0.8])), "seed": i,
              "ignore_eos": bool(rng.random() < 0.5), "logprobs": i % 4}
        if i % 3 == 0:
            kw["stop"] = ["ab", "x"]
        prompt = rng.integers(3, 300, int(rng.integers(2, 20))).tolist()
        plan.setdefault(int(rng.integers(0, 20)), []).append((f"r{i}", prompt, SamplingParams(**kw)))
        if i % 5 == 0:
            aborts.setdefault(int(rng.integers(5, 30)), []).append(f"r{i}")
    # a row whose stop tokens are most of the vocabulary: once it has joined, the others' tokens are often looked
    # at alone (a possible stop token), between tokens the run buffers
    plan.setdefault(0, []).append(("s", [3, 4, 5], SamplingParams(max_tokens=30, stop_token_ids=list(range(3, 250)),
                                                                   min_tokens=2)))
    results, blocks = [], []
    for with_run in (False, True):
        _, engine, _ = engine_for(tiny_model_dir, with_run, num_kv_blocks=24)
        if with_run:
            record = engine.run.logprobs.record
            engine.run.logprobs.record = lambda *a: blocks.append(len(out := record(*a))) or out
        outputs, _ = drive(engine, plan, aborts)
        results.append(completions(outputs))
        for out in outputs.values():
            for c in out.outputs if out.request_id != "s" else ():
                assert isinstance(c.logprobs, FlatLogprobs) and len(c.logprobs) == len(c.token_ids)
    assert results[1] == results[0]
    assert sum(blocks) >= 3, "no buffer filled"
