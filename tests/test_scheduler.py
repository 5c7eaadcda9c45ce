"""Block manager and scheduler invariants, without any model: budgets hold, everyone finishes, no block leaks."""

import random

import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence, SequenceStatus
from tinyvllm.outputs import RequestMetrics
from tinyvllm.sampling_params import SamplingParams


def make_seq(i, prompt, max_tokens, **params):
    tokens = list(range(prompt)) if isinstance(prompt, int) else list(prompt)
    return Sequence(str(i), i, None, tokens, SamplingParams(max_tokens=max_tokens, **params), 0, 0,
                    RequestMetrics(0.0))


def test_block_manager_allocates_grows_and_frees():
    bm = BlockManager(EngineConfig(block_size=4, enable_prefix_caching=False), 4)
    seq = make_seq(0, 5, 10)
    assert bm.can_allocate(seq, 5)
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    bm.grow(seq, 8)
    assert len(seq.block_table) == 2
    bm.grow(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 1
    bm.free(seq)
    assert bm.num_free_blocks == 4 and seq.block_table == [] and all(c == 0 for c in bm.ref_counts)


def test_block_manager_refuses_what_does_not_fit():
    bm = BlockManager(EngineConfig(block_size=4), 2)
    assert not bm.can_allocate(make_seq(0, 9, 1), 9)
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(0, 9, 1), 9)


def test_prefix_blocks_are_shared_refcounted_and_evicted_lru():
    bm = BlockManager(EngineConfig(block_size=4), 6)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 5)
    bm.allocate(a, len(a))
    a.num_computed_tokens = len(a)
    bm.commit_full_blocks(a)  # blocks of tokens 1-4 and 5-8 are now cached
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 42], 5)
    bm.allocate(b, len(b))
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    assert bm.ref_counts[a.block_table[0]] == 2
    # a prompt that is all cached still computes its last token: only the first full block is reused
    c = make_seq(2, [1, 2, 3, 4, 5, 6, 7, 8], 5)
    assert len(bm.match_prefix(c)) == 1
    shared = a.block_table[0]
    bm.free(a)
    assert bm.ref_counts[shared] == 1 and shared not in bm.free_blocks  # still used by b: never evicted
    bm.free(b)
    assert bm.num_free_blocks == 6 and not any(bm.ref_counts)
    # freed blocks stay cached until their space is needed
    d = make_seq(3, [1, 2, 3, 4, 5, 6, 7, 8, 9], 5)
    assert len(bm.match_prefix(d)) == 2
    hog = make_seq(4, 24, 1)  # needs all 6 blocks: every cached block is evicted
    bm.allocate(hog, 24)
    assert not bm.cached and len(bm.match_prefix(d)) == 0
    bm.free(hog)
    assert bm.num_free_blocks == 6


def test_a_prefix_hit_needs_every_token_up_to_it_equal():
    bm = BlockManager(EngineConfig(block_size=4), 16)
    for i, tokens in enumerate(([1, 2, 3, 4, 5, 6, 7, 8, 0], [9, 9, 9, 9, 7, 7, 7, 7, 0])):
        seq = make_seq(i, tokens, 1)
        bm.allocate(seq, len(seq))
        seq.num_computed_tokens = len(seq)
        bm.commit_full_blocks(seq)
    # the first sequence's second block, after the second sequence's first block: the chained hash differs
    assert len(bm.match_prefix(make_seq(2, [9, 9, 9, 9, 5, 6, 7, 8, 0], 1))) == 1
    assert len(bm.match_prefix(make_seq(3, [1, 2, 3, 4, 5, 6, 7, 9, 0], 1))) == 1
    assert len(bm.match_prefix(make_seq(4, [1, 2, 3, 4, 5, 6, 7, 8, 1], 1))) == 2


def test_reset_prefix_cache_forgets_every_block_and_only_when_idle():
    bm = BlockManager(EngineConfig(block_size=4), 8)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    bm.allocate(a, len(a))
    a.num_computed_tokens = len(a)
    bm.commit_full_blocks(a)
    with pytest.raises(RuntimeError, match="in use"):
        bm.reset_prefix_cache()
    bm.free(a)
    assert len(bm.match_prefix(make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], 1))) == 2
    bm.reset_prefix_cache()
    assert bm.match_prefix(make_seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)) == []


def simulate(policy, num_blocks, block_size, max_num_seqs, budget, seqs, seed=0, chunked=True, caching=True):
    """Drive the scheduler as the engine does, with a fake model that appends a token per finished prefill."""
    rng = random.Random(seed)
    config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, batching=policy,
                          enable_prefix_caching=caching, enable_chunked_prefill=chunked)
    bm = BlockManager(config, num_blocks)
    scheduler = Scheduler(config, bm)
    for seq in seqs:
        scheduler.add(seq)
    finished, steps, batches = [], 0, []
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        assert step.seqs, "the scheduler stalled with work left"
        steps += 1
        assert len(scheduler.running) <= max_num_seqs
        assert len(set(map(id, scheduler.running))) == len(scheduler.running)
        held = {b for s in scheduler.running for b in s.block_table}
        assert all(bm.ref_counts[b] == sum(s.block_table.count(b) for s in scheduler.running) for b in held)
        assert held.isdisjoint(bm.free_blocks) and len(held) + bm.num_free_blocks == num_blocks
        if len(step.seqs) > 1 or chunked:
            assert sum(step.num_new_tokens) <= budget
        for seq, n in zip(step.seqs, step.num_new_tokens):
            assert n >= 1 and seq.num_computed_tokens + n <= len(seq)
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n, "a token has no slot"
            seq.num_computed_tokens += n
            bm.commit_full_blocks(seq)
            if seq.num_computed_tokens < len(seq):
                continue
            seq.token_ids.append(rng.randrange(100))
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq)
                finished.append(seq)
        batches.append({s.request_id for s in step.seqs})
        assert steps < 10_000
    assert bm.num_free_blocks == num_blocks and all(c == 0 for c in bm.ref_counts)
    return finished, scheduler, batches


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_every_request_finishes_under_a_tight_cache(policy, chunked, caching):
    rng = random.Random(1)
    # (the engine caps a sequence at the cache's size, 48 tokens here); shared prefixes exercise the cache
    seqs = [make_seq(i, [7] * rng.choice([0, 4, 8]) + [rng.randrange(50) for _ in range(rng.randint(1, 12))],
                     rng.randint(1, 28)) for i in range(40)]
    finished, scheduler, _ = simulate(policy, num_blocks=12, block_size=4, max_num_seqs=8, budget=16, seqs=seqs,
                                      chunked=chunked, caching=caching)
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert scheduler.num_preemptions > 0, "the cache was meant to be too small to avoid preemption"


def test_schedule_asserts_its_invariants():
    config = EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    bm = BlockManager(config, 8)
    scheduler = Scheduler(config, bm)
    a, b = make_seq(0, 4, 10), make_seq(1, 4, 10)
    for seq in (a, b):
        scheduler.add(seq)
    assert scheduler.schedule().seqs == [a, b]
    a.block_table.append(b.block_table[0])  # owned twice, reference count 1: another sequence's KV
    with pytest.raises(AssertionError, match="reference count"):
        scheduler.schedule()
    a.block_table.pop()
    scheduler.running.append(make_seq(2, 4, 10))  # one more than max_num_seqs
    with pytest.raises(AssertionError, match="3 sequences running"):
        scheduler.schedule()


def test_preemption_picks_the_latest_arrival():
    seqs = [make_seq(i, 4, 20) for i in range(3)]
    bm = BlockManager(EngineConfig(block_size=4, enable_prefix_caching=False), 3)
    scheduler = Scheduler(EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=100), bm)
    for s in seqs:
        scheduler.add(s)
    step = scheduler.schedule()
    assert step.num_new_tokens == [4, 4, 4]
    for s in seqs:
        s.num_computed_tokens = len(s)
        s.token_ids.append(0)  # 5 tokens each: each needs a second block, none is free
    step = scheduler.schedule()
    assert [s.request_id for s in step.preempted] == ["2", "1"]
    assert [s.request_id for s in step.seqs] == ["0"]
    assert [s.request_id for s in scheduler.waiting] == ["1", "2"]


def test_chunked_prefill_never_starves_decodes():
    long_prompt = make_seq(1, 40, 2)
    short = make_seq(0, 3, 10)
    bm = BlockManager(EngineConfig(block_size=4), 100)
    scheduler = Scheduler(EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=8), bm)
    scheduler.add(short)
    step = scheduler.schedule()
    short.num_computed_tokens = 3
    short.token_ids.append(1)
    scheduler.add(long_prompt)
    chunks = []
    while long_prompt.num_computed_tokens < len(long_prompt):
        step = scheduler.schedule()
        assert step.seqs[0] is short and step.num_new_tokens[0] == 1, "the decode must run every step"
        assert sum(step.num_new_tokens) <= 8
        for seq, n in zip(step.seqs, step.num_new_tokens):
            seq.num_computed_tokens += n
            if seq is long_prompt:
                chunks.append(n)
        short.token_ids.append(1)
    assert sum(chunks) == 40 and max(chunks) == 7


def test_static_batches_do_not_mix():
    seqs = [make_seq(i, 3, 2 + i % 3) for i in range(10)]
    _, _, batches = simulate("static", num_blocks=100, block_size=4, max_num_seqs=4, budget=100, seqs=seqs)
    groups = [{"0", "1", "2", "3"}, {"4", "5", "6", "7"}, {"8", "9"}]
    for ids in batches:
        assert any(ids <= g for g in groups), f"step mixed static batches: {ids}"


def test_continuous_admits_as_soon_as_room_frees():
    seqs = [make_seq(0, 3, 1), make_seq(1, 3, 10), make_seq(2, 3, 10)]
    _, _, batches = simulate("continuous", num_blocks=100, block_size=4, max_num_seqs=2, budget=100, seqs=seqs)
    # request 0 finishes after its prefill; request 2 is admitted in the very next step
    assert batches[0] == {"0", "1"} and batches[1] == {"1", "2"}


def test_a_sequence_preempted_with_a_token_in_flight_waits_for_it_and_can_finish_while_waiting():
    """The engine schedules step N+1 before reading step N: a sequence preempted then keeps its unknown token, is
    not readmitted until that token is known, and if the token stops it, it finishes from the waiting queue."""
    bm = BlockManager(EngineConfig(block_size=4, enable_prefix_caching=False), 3)
    scheduler = Scheduler(EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16), bm)
    old, new = make_seq(0, 4, 10), make_seq(1, 4, 10)
    for seq in (old, new):
        scheduler.add(seq)
    assert scheduler.schedule().seqs == [old, new]
    for seq in (old, new):  # as the engine launches step N: prompts computed, a token each in flight
        seq.num_computed_tokens = len(seq)
        seq.token_ids.append(-1)
        seq.num_pending = 1
    step = scheduler.schedule()  # step N+1: 3 blocks cannot hold both at 5 tokens; the later arrival goes
    assert step.seqs == [old] and step.preempted == [new] and list(scheduler.waiting) == [new]
    assert new.block_table == [] and new.num_pending == 1 and new.token_ids[-1] == -1
    scheduler.finish(new)  # reading step N: its token is a stop token
    assert not scheduler.waiting and new.status is SequenceStatus.FINISHED
    scheduler.finish(old)
    assert bm.num_free_blocks == 3 and not any(bm.ref_counts)


def test_a_waiting_sequence_is_not_admitted_while_its_token_is_in_flight():
    config = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    scheduler = Scheduler(config, BlockManager(config, 8))
    seq = make_seq(0, 4, 10)
    seq.token_ids.append(-1)  # preempted while step N samples its 5th token
    seq.num_pending = 1
    scheduler.add(seq)
    assert scheduler.schedule().seqs == []
    seq.token_ids[-1], seq.num_pending = 7, 0  # step N read
    assert scheduler.schedule().seqs == [seq]


def test_a_sequence_whose_token_in_flight_reaches_its_limit_is_not_scheduled_again():
    config = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    scheduler = Scheduler(config, BlockManager(config, 8))
    seq = make_seq(0, 4, 1)
    seq.max_len = 5  # the prompt and one output token
    scheduler.add(seq)
    assert scheduler.schedule().seqs == [seq]
    seq.num_computed_tokens = 4
    seq.token_ids.append(-1)
    seq.num_pending = 1
    assert scheduler.schedule().seqs == []  # its last token is in flight: it is certain to finish
