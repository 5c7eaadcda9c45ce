"""Steps that return a run of tokens per sequence: a stand-in backend (the numpy backend, which on decode rows also
accepts 0-3 "draft" tokens, each the greedy token after the one before, as a speculative verify would) must give
exactly plain greedy decoding's outputs: tokens, text, stops mid-run, max_tokens, logprobs, prefix caching."""

import importlib.util

import numpy as np
import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.backends import sampler
from tinyvllm.backends.base import Batch, Logprobs, SamplerOutput
from tinyvllm.backends.numpy_backend import NumpyBackend
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence
from tinyvllm.outputs import RequestMetrics

PROMPTS = ["Hello there", "The quick brown fox jumps over", "a", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
           "Once upon a time, in a land far away, there lived", "x y z"]


class RunsBackend(NumpyBackend):
    """Accepts, after each decode row's sampled token, up to its lookahead of further tokens (how many: a function
    of the position, so every count 0-3 comes up), each computed by one more greedy decode of that row: the KV of
    every accepted token but the last is written, as the Batch contract says."""

    num_lookahead_slots = 3

    def __init__(self, model, engine_config) -> None:
        super().__init__(model, engine_config)
        self.accepted: list[int] = []  # extra tokens accepted per decode row, every step

    def execute(self, batch: Batch, bitmask=None) -> SamplerOutput:
        out = super().execute(batch, bitmask)
        lookahead = batch.num_lookahead_slots
        if lookahead is None or not lookahead.any():
            return out
        rows = batch.sampled_rows
        greedy = batch.sampling.temperature == 0
        extra = np.where(greedy, np.minimum(lookahead, sampler.mix32(batch.positions[rows]) % 4), 0).astype(np.int32)
        self.accepted += extra[lookahead > 0].tolist()
        ids = np.full((batch.num_seqs, 1 + int(extra.max())), -1, np.int32)
        ids[:, 0] = out.last_token_ids
        lps = [[] for _ in range(batch.num_seqs)]  # per row: the extra tokens' (token_lp, top_ids, top_lp)
        for j in range(1, ids.shape[1]):
            active = np.flatnonzero(extra >= j)
            logits = self.forward(self._next_decode(batch, active, ids[active, j - 1], j), np.arange(len(active)))
            ids[active, j] = logits.argmax(-1)
            if out.logprobs is not None:
                got = sampler.gather_logprobs(logits, ids[active, j], batch.sampling.num_logprobs)
                for n, row in enumerate(active.tolist()):
                    lps[row].append((got.token_logprobs[n], got.top_ids[n], got.top_logprobs[n]))
        return SamplerOutput(ids, (1 + extra).astype(np.int32), _ragged_logprobs(out.logprobs, lps),
                             out.prompt_logprobs)

    def _next_decode(self, batch: Batch, rows: np.ndarray, tokens: np.ndarray, j: int) -> Batch:
        """A decode of `tokens` at j positions past rows' sampled rows (their KV slots are reserved)."""
        positions = batch.positions[batch.sampled_rows[rows]] + j
        tables = batch.block_tables[rows]
        bs = self.engine_config.block_size
        slots = (tables[np.arange(len(rows)), positions // bs] * bs + positions % bs).astype(np.int32)
        return Batch(1, tokens.astype(np.int32), positions.astype(np.int32), slots,
                     np.arange(len(rows) + 1, dtype=np.int32), (batch.context_lens[rows] + j).astype(np.int32),
                     tables, batch.sampling)


def _ragged_logprobs(first: Logprobs | None, extra: list[list[tuple]]) -> Logprobs | None:
    """Row i's first token's logprobs, then its extra tokens', row after row."""
    if first is None:
        return None
    token_lp, top_ids, top_lp = [], [], []
    for i, rest in enumerate(extra):
        for lp, ids, tops in [(first.token_logprobs[i], first.top_ids[i], first.top_logprobs[i]), *rest]:
            token_lp.append(lp)
            top_ids.append(ids)
            top_lp.append(tops)
    k = first.top_ids.shape[1]
    return Logprobs(np.asarray(token_lp, np.float32), np.asarray(top_ids, np.int32).reshape(-1, k),
                    np.asarray(top_lp, np.float32).reshape(-1, k))


def plain_and_runs(model_dir, monkeypatch, **kw) -> tuple[LLM, LLM]:
    kw.setdefault("max_num_seqs", 8)
    plain = LLM(model_dir, backend="numpy", **kw)
    monkeypatch.setattr("tinyvllm.llm.create_backend", lambda model, config: RunsBackend(model, config))
    runs = LLM(model_dir, backend="numpy", **kw)
    assert isinstance(runs.backend, RunsBackend)
    return plain, runs


def completions(outputs) -> list[tuple]:
    return [(c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason) for o in outputs for c in o.outputs]


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert not llm.llm_engine.has_unfinished_requests()


def test_runs_of_accepted_tokens_give_plain_greedy_outputs_in_fewer_steps(tiny_model_dir, monkeypatch):
    plain, runs = plain_and_runs(tiny_model_dir, monkeypatch)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 2, 5, 9, 17, 24)]
    want = plain.generate(PROMPTS, params)
    got = runs.generate(PROMPTS, params)
    assert completions(got) == completions(want)
    assert [len(o.outputs[0].token_ids) for o in got] == [1, 2, 5, 9, 17, 24]
    assert set(runs.backend.accepted) == {0, 1, 2, 3}, "every run length was exercised"
    assert runs.llm_engine.num_steps < plain.llm_engine.num_steps
    assert_no_leaks(runs)


def test_stops_inside_a_run_cut_the_tokens_after_them(tiny_model_dir, monkeypatch):
    """A stop token id, an EOS and a stop string that fall inside an accepted run end the output there, as when
    the tokens come one per step."""
    plain, runs = plain_and_runs(tiny_model_dir, monkeypatch)
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reference = plain.generate(PROMPTS, free)
    params, eos_ids = [], set()
    for i, out in enumerate(reference):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[ids[7 + i]]))
        elif i % 3 == 1:
            eos_ids.add(ids[5 + i])
            params.append(SamplingParams(max_tokens=24, temperature=0))
        else:
            params.append(SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[text[6:9]]))
    for llm in (plain, runs):
        llm.llm_engine.eos_token_ids |= eos_ids  # the set the engine's parts share
    want, got = plain.generate(PROMPTS, params), runs.generate(PROMPTS, params)
    assert completions(got) == completions(want)
    assert all(c.finish_reason == "stop" for o in got for c in o.outputs)
    assert all(len(g.outputs[0].token_ids) < 24 for g in got)
    assert_no_leaks(runs)


def test_logprobs_come_per_accepted_token(tiny_model_dir, monkeypatch):
    plain, runs = plain_and_runs(tiny_model_dir, monkeypatch)
    params = SamplingParams(max_tokens=13, temperature=0, ignore_eos=True, logprobs=3)
    want, got = plain.generate(PROMPTS, params), runs.generate(PROMPTS, params)
    assert completions(got) == completions(want)
    for w, g in zip(want, got):
        wc, gc = w.outputs[0], g.outputs[0]
        assert len(gc.logprobs) == len(gc.token_ids) == 13
        for we, ge in zip(wc.logprobs, gc.logprobs):
            assert we.keys() == ge.keys()
            assert np.allclose([ge[t].logprob for t in we], [we[t].logprob for t in we], atol=1e-4)
        assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-3)


def test_runs_under_a_tight_cache_with_preemption(tiny_model_dir, monkeypatch):
    """The extra tokens' KV slots are reserved: a tight cache preempts, and outputs stay exact."""
    plain, runs = plain_and_runs(tiny_model_dir, monkeypatch, num_kv_blocks=20, block_size=4)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want, got = plain.generate(PROMPTS, params), runs.generate(PROMPTS, params)
    assert completions(got) == completions(want)
    assert runs.llm_engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert_no_leaks(runs)


def test_blocks_filled_by_runs_are_committed_to_the_prefix_cache(tiny_model_dir, monkeypatch):
    """A prompt made of a finished request's prompt and output hits every full block of it, those filled by runs
    of accepted tokens too."""
    plain, runs = plain_and_runs(tiny_model_dir, monkeypatch, block_size=4, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=21, temperature=0, ignore_eos=True)
    first = runs.generate(PROMPTS[1], params)[0]
    assert completions([first]) == completions(plain.generate(PROMPTS[1], params))
    again = list(first.prompt_token_ids) + list(first.outputs[0].token_ids) + [5]
    bm = runs.llm_engine.block_manager
    hits = bm.num_hit_tokens
    follow = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    assert completions(runs.generate([again], follow)) == completions(plain.generate([again], follow))
    # the output's last token has no KV yet: its block is not full of computed tokens
    assert bm.num_hit_tokens - hits == (len(again) - 2) // 4 * 4, "every full block of prompt + output was cached"
    assert_no_leaks(runs)


def test_sampled_and_processed_rows_get_no_lookahead(tiny_model_dir, monkeypatch):
    """Random sampling is left to one token per step by the stand-in; logits processors and structured outputs
    see one token per step, so the scheduler gives them no lookahead: their outputs equal the plain engine's."""
    plain, runs = plain_and_runs(tiny_model_dir, monkeypatch)
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=3), SamplingParams(max_tokens=10, temperature=0,
              repetition_penalty=1.3), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]
    if importlib.util.find_spec("llguidance") is not None:  # a step with token masks and runs: masks filled first
        params.append(SamplingParams(max_tokens=10, temperature=0, structured_outputs={"regex": "(ab|cd)[0-9]{2,4}"}))
    prompts = PROMPTS[:len(params)]
    want, got = plain.generate(prompts, params), runs.generate(prompts, params)
    assert completions(got) == completions(want)
    assert [o.outputs[0].finish_reason for o in got][:3] == ["length"] * 3
    assert max(runs.backend.accepted) > 0, "the greedy request got runs beside the others"
    assert_no_leaks(runs)


def decoding(prompt_len: int, max_tokens: int, **params) -> Sequence:
    seq = Sequence("r", 0, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **params),
                   0, 0, RequestMetrics(0.0))
    seq.max_len = prompt_len + max_tokens
    return seq


def test_the_scheduler_reserves_lookahead_slots_within_the_length_limit():
    config = EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=16, max_num_seqs=4)
    scheduler = Scheduler(config, BlockManager(config, 16), num_lookahead_slots=3)
    seqs = [decoding(6, 10), decoding(6, 2), decoding(6, 10, repetition_penalty=1.2)]
    seqs[2].processors = object()  # as request_processors makes for a penalty
    for seq in seqs:
        scheduler.add(seq)
    prefill = scheduler.schedule()
    assert prefill.num_lookahead_slots == [0, 0, 0]  # prompts get none
    for seq in seqs:
        seq.num_computed_tokens = 6
        seq.token_ids.append(9)  # the first output token, read
    step = scheduler.schedule()
    assert step.num_new_tokens == [1, 1, 1]
    # 3 more; room for none (the token sampled now is its last: 6 + 2 tokens); none with a logits processor
    assert step.num_lookahead_slots == [3, 0, 0]
    assert [len(s.block_table) for s in seqs] == [3, 2, 2]  # KV of 7 + 3 tokens: three blocks; of 7: two
    assert Scheduler(config, BlockManager(config, 16)).schedule().num_lookahead_slots is None


def test_the_one_token_step_in_the_ragged_contract(tiny_model_dir):
    """build_batch says the query lengths and sampled rows; the numpy backend returns [S, 1] and counts of 1."""
    from tinyvllm.engine.model_inputs import build_batch
    from tinyvllm.engine.scheduler import ScheduledStep

    llm = LLM(tiny_model_dir, backend="numpy", max_num_seqs=4, block_size=4)
    bm = llm.llm_engine.block_manager
    seqs = [decoding(n, 4) for n in (3, 6)]
    for seq in seqs:
        bm.allocate(seq, len(seq.token_ids))
    batch = build_batch(ScheduledStep(seqs, [3, 6]), 4)
    assert batch.max_query_len == 6 and batch.logits_indices.tolist() == [2, 8]
    assert batch.num_lookahead_slots is None
    out = llm.backend.execute(batch)
    assert out.sampled_token_ids.shape == (2, 1) and out.num_sampled.tolist() == [1, 1]
    assert out.last_token_ids.tolist() == out.sampled_token_ids[:, 0].tolist()
    with pytest.raises(ValueError, match="one row per sequence"):
        batch.logits_indices = np.array([1, 2, 8], np.int32)
        llm.backend.execute(batch)


def test_a_sequence_takes_no_undeclared_field():
    seq = decoding(3, 4)
    with pytest.raises(AttributeError):
        seq.groupp = None
