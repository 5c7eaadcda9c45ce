"""The scheduler: which sequences run in the next step, and which are preempted when the cache is full.

Each step is either a prefill (admit waiting sequences and compute their prompts) or a decode (one new token for
every running sequence). Prefill goes first whenever a waiting sequence can be admitted.

- continuous: admit waiting sequences whenever `max_num_seqs`, the token budget and free blocks allow; finished
  sequences leave at once, so their room is reused the next step.
- static: admit a batch of up to `max_num_seqs` and run it until every member has finished; only then the next.

When a decode step finds no free block for a sequence's next token, the most recently arrived running sequence is
preempted: its blocks are freed and it waits to be recomputed (its prompt and output so far prefilled again).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.sequence import Sequence, SequenceStatus

POLICIES = ("continuous", "static")


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "continuous") -> None:
        if policy not in POLICIES:
            raise ValueError(f"invalid batching={policy!r}: choose continuous or static")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.static_batch: set[str] = set()  # static policy: the members of the batch in flight
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        admitted = self._admit()
        if admitted:
            return ScheduledStep(admitted, is_prefill=True)
        if not self.running:
            return None
        return self._schedule_decode()

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)
        self.static_batch.discard(seq.request_id)
        self.block_manager.free(seq)

    def _admit(self) -> list[Sequence]:
        if self.policy == "static" and not self.static_batch:
            self.static_batch = {seq.request_id for _, seq in zip(range(self.max_num_seqs), self.waiting)}
        admitted: list[Sequence] = []
        num_tokens = 0
        while self.waiting:
            seq = self.waiting[0]
            if self.policy == "static" and seq.request_id not in self.static_batch:
                break  # members always come first in the queue: the rest wait for the next batch
            if len(self.running) + len(admitted) >= self.max_num_seqs:
                break
            new_tokens = len(seq) - seq.num_computed_tokens
            # A prompt longer than the whole budget still runs, alone.
            if admitted and num_tokens + new_tokens > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            admitted.append(seq)
            num_tokens += new_tokens
        self.running.extend(admitted)
        return admitted

    def _schedule_decode(self) -> ScheduledStep:
        queue = deque(sorted(self.running, key=lambda s: s.arrival_index))
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            while not self.block_manager.can_append_slot(seq):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        return ScheduledStep(scheduled, is_prefill=False, preempted=preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # victims go latest first, so the queue keeps arrival order
