"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, reference counts.

Token i of a sequence lives in block block_table[i // block_size] at offset i % block_size; its cache slot is
block * block_size + offset. The block manager only counts; the backend owns the memory.
"""

from __future__ import annotations

from collections import deque

from tinyvllm.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give the sequence blocks for all its current tokens."""
        needed = self.blocks_needed(len(seq)) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError("allocate() called without can_allocate()")
        for _ in range(needed):
            seq.block_table.append(self._take())

    def can_append_slot(self, seq: Sequence) -> bool:
        """Whether the sequence's last token (sampled by the previous step, written by the next) has a slot."""
        return self.blocks_needed(len(seq)) <= len(seq.block_table) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the sequence's last token (the one the next decode step writes)."""
        if self.blocks_needed(len(seq)) > len(seq.block_table):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block
