"""Block manager and scheduler invariants, without any model: budgets hold, everyone finishes, no block leaks."""

import random

import pytest

from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence, SequenceStatus
from tinyvllm.outputs import RequestMetrics
from tinyvllm.sampling_params import SamplingParams


def make_seq(i, prompt_len, max_tokens):
    return Sequence(str(i), i, None, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), 0, 0,
                    RequestMetrics(0.0))


def test_block_manager_allocates_appends_and_frees():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(0, 5, 10)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    assert [bm.slot(seq, p) for p in (0, 3, 4)] == [seq.block_table[0] * 4, seq.block_table[0] * 4 + 3,
                                                    seq.block_table[1] * 4]
    seq.token_ids += [1, 2, 3]  # 8 tokens: still 2 blocks
    bm.append_slot(seq)
    assert len(seq.block_table) == 2
    seq.token_ids.append(4)  # 9 tokens: a third block
    bm.append_slot(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 1
    bm.free(seq)
    assert bm.num_free_blocks == 4 and seq.block_table == [] and all(c == 0 for c in bm.ref_counts)


def test_block_manager_refuses_what_does_not_fit():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(make_seq(0, 9, 1))
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(0, 9, 1))


def simulate(policy, num_blocks, block_size, max_num_seqs, budget, seqs, seed=0):
    """Drive the scheduler as the engine does, with a fake model that appends a token per scheduled sequence."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(bm, max_num_seqs, budget, policy)
    for seq in seqs:
        scheduler.add(seq)
    finished, steps, batches = [], 0, []
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        assert step is not None and step.seqs, "the scheduler stalled with work left"
        steps += 1
        assert len(scheduler.running) <= max_num_seqs
        used = sum(len(s.block_table) for s in scheduler.running)
        assert used + bm.num_free_blocks == num_blocks, "blocks leaked or double-counted"
        if step.is_prefill and len(step.seqs) > 1:
            assert sum(len(s) - s.num_computed_tokens for s in step.seqs) <= budget
        for seq in step.seqs:
            assert len(seq.block_table) * block_size >= len(seq), "a token has no slot"
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(rng.randrange(100))
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq)
                finished.append(seq)
        batches.append({s.request_id for s in step.seqs})
        assert steps < 10_000
    assert bm.num_free_blocks == num_blocks and all(c == 0 for c in bm.ref_counts)
    return finished, scheduler, batches


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_every_request_finishes_under_a_tight_cache(policy):
    rng = random.Random(1)
    # (the engine caps a sequence at the cache's size, 48 tokens here)
    seqs = [make_seq(i, rng.randint(1, 20), rng.randint(1, 28)) for i in range(40)]
    finished, scheduler, _ = simulate(policy, num_blocks=12, block_size=4, max_num_seqs=8, budget=32, seqs=seqs)
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert scheduler.num_preemptions > 0, "the cache was meant to be too small to avoid preemption"


def test_preemption_picks_the_latest_arrival():
    seqs = [make_seq(i, 4, 20) for i in range(3)]
    bm = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(bm, 8, 100, "continuous")
    for s in seqs:
        scheduler.add(s)
    step = scheduler.schedule()
    assert step.is_prefill and len(step.seqs) == 3
    for s in seqs:
        s.num_computed_tokens = len(s)
        s.token_ids.append(0)  # 5 tokens each: each needs a second block, none is free
    step = scheduler.schedule()
    assert [s.request_id for s in step.preempted] == ["2", "1"]
    assert [s.request_id for s in step.seqs] == ["0"]
    assert [s.request_id for s in scheduler.waiting] == ["1", "2"]


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
    assert batches[0] == {"0", "1"} and batches[1] == {"2"}
