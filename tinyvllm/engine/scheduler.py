"""The scheduler: which sequences run in the next step, how many new tokens each, and who is preempted.

A step carries, within the token budget `max_num_batched_tokens`: first every running sequence's next token
(decodes), then the next chunk of prompts already being prefilled, then newly admitted sequences. With chunked
prefill a prompt longer than what is left of the budget is split over several steps, so a long prompt never
stalls the decodes; without it a prompt is admitted only whole (alone if it exceeds the budget).

- continuous: admit waiting sequences whenever `max_num_seqs`, the token budget and free blocks allow; finished
  sequences leave at once, so their room is reused the next step.
- static: admit a batch of up to `max_num_seqs` and run it until every member has finished; only then the next.

When a running sequence finds no free block for its new tokens, the most recently arrived running sequence is
preempted: its blocks are freed and it waits to be recomputed (prompt and output so far prefilled again).

A model whose every layer slides (BlockManager.window): each step first frees every running sequence's blocks that
are behind its next query's window, and a sequence computes at most BlockManager.chunk_limit tokens a step, so that
a lone sequence's window and chunk always fit in the cache however long the sequence (a 16k-token prompt on a cache
of a few thousand tokens is prefilled chunk by chunk, freeing as it goes).

The engine schedules a step while the previous one still runs (see llm_engine), so a sequence may end in a token
not known yet (Sequence.num_pending). Such a sequence decodes that token next like any other; one whose pending
token reaches its length limit is not scheduled again (it is certain to finish), and a preempted one is not
readmitted until its token is known.

The engine's DecodeRun (engine/persistent_batch.py), when there is one, schedules the decodes it holds first, in
the order this scheduler gives decodes, or hands them all back when they cannot all run without a preemption;
_schedule_running goes through the other running sequences.

Lookahead slots (`num_lookahead_slots` > 0, from a backend that may return a run of tokens per decode): a decode
gets that many more KV slots reserved (fewer near its length limit; none with logits processors or a structured
output, which see one token per step), and ScheduledStep.num_lookahead_slots says how many each sequence got.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.persistent_batch import DecodeRun, FastRows
from tinyvllm.engine.sequence import Sequence, SequenceStatus

DEBUG_CHECK_MAX_BLOCKS = 256  # block-table entries up to which schedule() checks every block's owners


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens computed this step, from seq.num_computed_tokens on
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) KV blocks, before
    # per sequence: tokens beyond one it may get this step (KV slots reserved for them); None: one each
    num_lookahead_slots: list[int] | None = None
    fast: FastRows | None = None  # the step's first rows, when a DecodeRun holds them (engine/persistent_batch)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, num_lookahead_slots: int = 0) -> None:
        self.block_manager = block_manager
        self.num_lookahead_slots = num_lookahead_slots
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.policy = config.batching
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.static_batch: set[str] = set()  # static policy: the members of the batch in flight
        self.num_preemptions = 0
        self._block_copies: list[tuple[int, int]] = []  # forks' copies, made before the next step
        self.run: DecodeRun | None = None  # the engine's, when its backend returns one token per row

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:  # preempted while its last token was being sampled
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.static_batch.discard(seq.request_id)
        self.block_manager.free(seq)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Run `child` beside `parent` (another completion of its request) on parent's prompt blocks; False when
        there is no room this step (max_num_seqs, or no block for the copy of the last partial one)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        copies = self.block_manager.fork(parent, child)
        if copies is None:
            return False
        self._block_copies += copies
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        return True

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep([], [], block_copies=self._block_copies,
                             num_lookahead_slots=[] if self.num_lookahead_slots else None)
        self._block_copies = []
        budget = self.max_num_batched_tokens
        if self.block_manager.window is not None:
            for seq in self.running:
                self.block_manager.free_outside_window(seq)
        if self.run is not None:  # the decodes it holds first, as _schedule_running would order them
            budget = self.run.schedule(step, self.running, budget, bool(self.waiting))
        if self.run is None or self.run.count < len(self.running):
            budget = self._schedule_running(step, budget)
        self._admit(step, budget)
        self._check(step)
        return step

    def _check(self, step: ScheduledStep) -> None:
        """The budget invariants, as vLLM asserts them at the end of its schedule(). The O(seqs) ones always; the
        exact block accounting (~0.2-0.5 us per block-table entry) only when __debug__ and the step is small, which
        covers the tests' small configurations without slowing a large batch."""
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} sequences running"
        num_tokens = sum(step.num_new_tokens)
        # without chunked prefill a prompt larger than the budget runs alone
        assert num_tokens <= self.max_num_batched_tokens or (not self.enable_chunked_prefill and len(step.seqs) == 1), \
            f"{num_tokens} tokens scheduled"
        if __debug__ and len(self.running) <= DEBUG_CHECK_MAX_BLOCKS \
                and sum(len(seq.block_table) for seq in self.running) <= DEBUG_CHECK_MAX_BLOCKS:
            block_size = self.block_manager.block_size
            assert all(len(seq.block_table) * block_size >= seq.num_computed_tokens + n
                       for seq, n in zip(step.seqs, step.num_new_tokens)), "a scheduled token has no cache slot"
            self.block_manager.check_block_tables(self.running)

    def _schedule_running(self, step: ScheduledStep, budget: int) -> int:
        # Decodes first (one token each), then prompts part-way through their prefill: a long prompt waits, they don't.
        by_arrival = attrgetter("arrival_index")
        live = [s for s in self.running if len(s.token_ids) < s.max_len and s.run_slot < 0]
        queue = deque(sorted((s for s in live if s.num_computed_tokens >= s.num_prompt_tokens), key=by_arrival))
        queue.extend(sorted((s for s in live if s.num_computed_tokens < s.num_prompt_tokens), key=by_arrival))
        block_size, lookahead = self.block_manager.block_size, step.num_lookahead_slots
        while queue and budget > 0:
            seq = queue.popleft()
            limit = self.block_manager.chunk_limit(seq.num_computed_tokens)
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget, limit)
            extra = 0 if lookahead is None else min(self.lookahead(seq, num_new), limit - num_new)
            end = seq.num_computed_tokens + num_new + extra
            if len(seq.block_table) * block_size < end and not self._make_room(seq, end, queue, step):
                continue  # it was preempted itself
            step.seqs.append(seq)
            step.num_new_tokens.append(num_new)
            if lookahead is not None:
                lookahead.append(extra)
            budget -= num_new
        return budget

    def lookahead(self, seq: Sequence, num_new: int) -> int:
        """The tokens beyond one that the sequence may get this step: a decode's, as many as its length allows
        (the KV of all accepted tokens but the last is written, so slots up to max_len - 1)."""
        if (num_new != 1 or seq.num_computed_tokens + 1 != len(seq.token_ids)
                or seq.num_computed_tokens < seq.num_prompt_tokens or seq.processors is not None
                or seq.constraint is not None):
            return 0
        return max(0, min(self.num_lookahead_slots, seq.max_len - len(seq.token_ids) - 1))

    def _make_room(self, seq: Sequence, num_tokens: int, queue: deque[Sequence], step: ScheduledStep) -> bool:
        """Grow the sequence's block table to num_tokens tokens, preempting the latest arrivals still queued (or
        itself, last) while the blocks are missing; False if it was preempted."""
        while not self.block_manager.can_grow(seq, num_tokens):
            victim = max(queue, key=lambda s: s.arrival_index, default=seq)
            if victim is not seq:
                queue.remove(victim)
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is seq:
                return False
        self.block_manager.grow(seq, num_tokens)
        return True

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        if self.policy == "static" and not self.static_batch and not self.running:
            self.static_batch = {seq.request_id for _, seq in zip(range(self.max_num_seqs), self.waiting)}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.policy == "static" and seq.request_id not in self.static_batch:
                break  # members always come first in the queue: the rest wait for the next batch
            if seq.num_pending:
                break  # preempted while its last token was in flight: readmitted once that token is known
            cached = len(self.block_manager.match_prefix(seq)) * self.block_manager.block_size
            remaining = len(seq) - cached
            if self.enable_chunked_prefill:
                num_new = min(remaining, budget, self.block_manager.chunk_limit(cached))
            elif remaining > budget and step.seqs:
                break  # a whole prompt larger than what is left waits (alone, it may exceed the budget)
            else:
                num_new = remaining
            if not self.block_manager.can_allocate(seq, cached + num_new):
                break
            self.block_manager.allocate(seq, cached + num_new)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            step.seqs.append(seq)
            step.num_new_tokens.append(num_new)
            if step.num_lookahead_slots is not None:
                step.num_lookahead_slots.append(0)
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # recomputed before anything new is admitted
