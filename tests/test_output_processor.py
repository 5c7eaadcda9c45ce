"""OutputProcessor without a backend: hand-made steps and SamplerOutputs (one token or a run per sequence) read into
sequences; stops and max_tokens cut a run, logprobs come per accepted token, n > 1 requests finish together."""

import numpy as np
import pytest

from tinyvllm import SamplingParams
from tinyvllm.backends.base import Batch, Logprobs, QueuedStep, SamplerOutput
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.output_processor import InFlightStep, OutputProcessor
from tinyvllm.logprobs import logprob_dicts
from tinyvllm.engine.scheduler import ScheduledStep
from tinyvllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceGroup, SequenceStatus
from tinyvllm.outputs import RequestMetrics
from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer

EOS = 2
PROMPT = [5, 6, 7]


@pytest.fixture
def tokenizer(tiny_model_dir):
    return Tokenizer.from_dir(tiny_model_dir)


class Harness:
    """An OutputProcessor over a block manager, with the engine's side effects recorded."""

    def __init__(self, tokenizer, prefix_caching: bool = False) -> None:
        config = EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=32, enable_prefix_caching=prefix_caching)
        self.block_manager = BlockManager(config, 32)
        self.released, self.forked = [], []
        self.processor = OutputProcessor(tokenizer, {EOS}, self.block_manager, None, self.release, self.forked.append)
        self.tokenizer = tokenizer

    def release(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        self.released.append(seq)

    def decoding(self, request_id: str = "r", n: int = 1, index: int = 0, group=None, **params) -> Sequence:
        """A sequence that has computed its prompt and one output token (11), decoding its next token."""
        params = SamplingParams(**{"max_tokens": 8, "temperature": 0, **params})
        group = group or SequenceGroup(request_id, None, PROMPT, 0, 0.0, [None] * n, [])
        seq = Sequence(request_id, index, None, PROMPT, params, 0, 0, RequestMetrics(0.0, 0.0), index=index, group=group,
                       status=SequenceStatus.RUNNING)
        seq.max_len = len(PROMPT) + params.max_tokens
        seq.token_ids.append(11)
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, PROMPT, True)
            seq.text = seq.detokenizer.add(11)
        if params.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        self.block_manager.allocate(seq, 8)
        group.seqs.append(seq)
        return seq

    def run(self, seqs: list[Sequence], runs: list[list[int]], logprobs: Logprobs | None = None):
        """A decode step of seqs, prepared as the engine does (a placeholder each), that accepted `runs`."""
        starts, index = [], []
        for seq in seqs:
            starts.append(seq.num_computed_tokens)
            seq.num_computed_tokens = len(seq.token_ids)
            index.append(len(seq.token_ids))
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending += 1
        width = max(map(len, runs))
        ids = np.array([run + [-1] * (width - len(run)) for run in runs], np.int32)
        result = SamplerOutput(ids, np.array(list(map(len, runs)), np.int32), logprobs)
        batch = Batch(1, np.zeros(len(seqs), np.int32), np.zeros(len(seqs), np.int32), np.zeros(len(seqs), np.int32),
                      np.arange(len(seqs) + 1, dtype=np.int32), np.ones(len(seqs), np.int32),
                      np.zeros((len(seqs), 1), np.int32), None)
        launched = InFlightStep(ScheduledStep(seqs, [1] * len(seqs)), batch, starts, index, QueuedStep(lambda: result))
        return self.processor.process(launched, result, [])


def test_a_run_of_tokens_is_read_in_order_and_its_kv_counted(tokenizer):
    h = Harness(tokenizer)
    a, b = h.decoding("a"), h.decoding("b")
    assert h.run([a, b], [[20, 21, 22], [30]]) == []
    assert a.token_ids == PROMPT + [11, 20, 21, 22] and a.num_pending == 0
    assert a.num_computed_tokens == len(a.token_ids) - 1, "every accepted token's KV but the last"
    assert b.token_ids == PROMPT + [11, 30] and b.num_computed_tokens == len(b.token_ids) - 1


@pytest.mark.parametrize("params, run, kept, reason", [
    ({"stop_token_ids": [21]}, [20, 21, 22, 23], [20, 21], ("stop", 21)),
    ({}, [20, EOS, 22], [20, EOS], ("stop", None)),
    ({"ignore_eos": True}, [20, EOS, 22], [20, EOS, 22], None),
    ({"max_tokens": 3}, [20, 21, 22, 23], [20, 21], ("length", None)),
    ({"min_tokens": 3, "stop_token_ids": [21]}, [21, 21, 21, 21], [21, 21, 21], ("stop", 21)),
])
def test_a_stop_or_the_length_limit_inside_a_run_cuts_the_tokens_after_it(tokenizer, params, run, kept, reason):
    h = Harness(tokenizer)
    seq = h.decoding(**params)
    outputs = h.run([seq], [run])
    assert seq.output_token_ids == [11, *kept]
    if reason is None:
        assert outputs == [] and seq.status is SequenceStatus.RUNNING
        return
    assert h.released == [seq] and seq.num_pending == 0
    (out,) = outputs
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == reason
    assert out.outputs[0].token_ids == [11, *kept]
    assert out.metrics.num_generated_tokens == 1 + len(kept)


def test_a_stop_string_inside_a_run_cuts_text_and_tokens(tokenizer):
    h = Harness(tokenizer)
    run = tokenizer.encode(" stop here", add_special_tokens=False)[:6]  # " s", "t", "o", "p", " he", "re"
    assert tokenizer.decode(run) == " stop here"
    seq = h.decoding(stop=["op"])
    (out,) = h.run([seq], [run])
    completion = out.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "op")
    assert tokenizer.decode([11] + run[:4]).endswith(" stop") and completion.token_ids == [11, *run[:4]]
    assert completion.text == tokenizer.decode(PROMPT + [11, *run[:4]])[len(tokenizer.decode(PROMPT)):-2]


def test_logprobs_are_read_per_accepted_token(tokenizer):
    h = Harness(tokenizer)
    a, b = h.decoding("a", logprobs=1), h.decoding("b", logprobs=1)
    # rows: a's two tokens, then b's one
    logprobs = Logprobs(np.array([-0.5, -1.0, -2.0], np.float32), np.array([[20], [9], [30]], np.int32),
                        np.array([[-0.5], [-0.2], [-2.0]], np.float32))
    h.run([a, b], [[20, 21], [30]], logprobs)
    assert a.logprobs == [{20: -0.5}, {9: pytest.approx(-0.2), 21: -1.0}]
    assert b.logprobs == [{30: -2.0}]
    assert a.cumulative_logprob == pytest.approx(-1.5)
    assert logprob_dicts(logprobs, [20, 21], 1) == a.logprobs


def test_full_blocks_of_a_run_are_committed_to_the_prefix_cache(tokenizer):
    h = Harness(tokenizer, prefix_caching=True)
    seq = h.decoding()  # 4 tokens known, block size 4
    h.run([seq], [[20, 21, 22, 23]])  # 8 tokens, 7 with KV: one full block computed
    assert seq.num_hashed_blocks == 1
    h.run([seq], [[24, 25]])  # 10 tokens, 9 with KV: two
    assert seq.num_hashed_blocks == 2 and len(h.block_manager.cached) == 2


def test_a_request_finishes_once_all_its_completions_have(tokenizer):
    h = Harness(tokenizer)
    first = h.decoding("n", n=2, index=0)
    second = h.decoding("n", n=2, index=1, group=first.group)
    first.forks_left = 1  # ended before its sibling forked the rest: passed on
    assert h.run([first, second], [[EOS], [20]]) == []
    assert h.forked == [first]
    (out,) = h.run([second], [[21, EOS, 5]])
    assert [c.token_ids for c in out.outputs] == [[11, EOS], [11, 20, 21, EOS]]


def test_a_sequence_finished_before_its_step_is_read_is_skipped(tokenizer):
    h = Harness(tokenizer)
    seq = h.decoding()
    seq.status = SequenceStatus.FINISHED  # it stopped (or was aborted) after this step was queued
    assert h.run([seq], [[20, 21]]) == [] and h.released == []


@pytest.mark.parametrize("seed", range(6))
def test_logprob_entries_match_one_dict_per_row(seed):
    """The batched entries equal {top ids: values (-inf left out), token: its logprob} made row by row, for any k
    (each row its own, at most the arrays' width), forbidden (-inf) tops and NaN, rows in any order."""
    from tinyvllm.logprobs import logprob_entries

    rng = np.random.default_rng(seed)
    n, width = 40, 5
    top = rng.standard_normal((n, width)).astype(np.float32)
    top[rng.random((n, width)) < (0.2 if seed % 2 else 0.0)] = -np.inf
    if seed == 5:
        top[3, 1] = np.nan
    logprobs = Logprobs(rng.standard_normal(n).astype(np.float32), rng.integers(0, 50, (n, width)).astype(np.int32),
                        top)
    rows = rng.permutation(n)[:17].tolist()
    tokens = rng.integers(0, 50, len(rows)).tolist()
    for ks in ([seed % 4] * len(rows), rng.integers(0, width + 1, len(rows)).tolist()):
        want = []
        for r, token, k in zip(rows, tokens, ks):
            entry = {int(t): float(v) for t, v in zip(logprobs.top_ids[r, :k], top[r, :k]) if v > -np.inf}
            entry[token] = float(logprobs.token_logprobs[r])
            want.append(entry)
        got = logprob_entries(logprobs, rows, tokens, ks)
        assert [list(e.items()) for e in got] == [list(e.items()) for e in want]
