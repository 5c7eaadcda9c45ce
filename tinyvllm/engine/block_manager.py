"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, reference counts, prefix caching.

Token i of a sequence lives in block block_table[i // block_size] at offset i % block_size; its cache slot is
block * block_size + offset. The block manager only counts; the backend owns the memory.

Prefix caching: a full block is named by a sha256 chained over its tokens and its parent block's hash, so equal
hashes mean equal prefixes (a hit is trusted: a 64-bit hash could collide and serve another prompt's KV). A new
sequence reuses every leading full block already cached (shared read-only, its reference count raised). A freed
block keeps its hash and contents until its space is needed: free blocks are handed out least recently freed first,
and only then is the cached block forgotten.

Sliding windows: where every layer of the model attends over a window (`window`, the largest of them), a query at
position p reads the keys of positions p - window + 1 .. p only. The blocks of a sequence whose every position lies
before the window of its next query are then never read again: `free_outside_window` gives them back (registered in
the prefix cache first, so they stay cached as any freed block does), so a sequence's KV memory follows its window,
not its length. They are always its leading blocks (`Sequence.num_freed_blocks`); their block-table entries hold
FREED_BLOCK. A chunk of prompt from position c needs the blocks from c's window to its end (`chunk_limit`).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable
from itertools import chain

from tinyvllm.config import EngineConfig
from tinyvllm.engine.sequence import Sequence


FREED_BLOCK = 0  # the block-table entry of a block freed behind the window: a block of the cache, never read for it


@functools.cache
def _int32_packer(count: int) -> Callable[..., bytes]:
    """struct's packer of `count` little-endian int32 (compiled once per block length: a third of a hash's time)."""
    return struct.Struct(f"<{count}i").pack


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """sha256 of the parent block's hash (b"" for the first block) and the block's token ids as int32."""
    return hashlib.sha256(parent + _int32_packer(len(tokens))(*tokens)).digest()


class BlockManager:
    def __init__(self, config: EngineConfig, num_blocks: int, window: int | None = None) -> None:
        self.num_blocks = num_blocks  # the backend's cache size (config.num_kv_blocks may be None: from memory)
        self.block_size = config.block_size
        self.window = window  # every layer's queries read at most this many keys back; None: any key, ever
        self.enable_prefix_caching = config.enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding that prefix block
        # called before a cached block is evicted: commits held back elsewhere (the engine's DecodeRun) are made
        # first, so the cache changes in the order they would have been made in
        self.before_evict: Callable[[], None] | None = None
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # ... and found there

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def freeable(self, position: int) -> int:
        """How many leading blocks lie wholly before the window of a query at `position` (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, (position - self.window + 1) // self.block_size)

    def chunk_limit(self, start: int) -> int:
        """The most tokens a sequence can compute from position `start` in one step: the blocks from start's window
        (without one: from position 0) to the chunk's end fit in the cache."""
        return (self.num_blocks + self.freeable(start)) * self.block_size - start

    def longest_sequence(self, max_model_len: int, chunked_prefill: bool) -> int:
        """The longest sequence served, such that it never needs more blocks at once than the cache has (a lone
        sequence is always schedulable): the cache's tokens, or with a window and chunked prefill, max_model_len
        where every chunk_limit is at least one token (the cache holds a window and a block)."""
        if self.window is not None and chunked_prefill and (self.num_blocks - 1) * self.block_size >= self.window - 1:
            return max_model_len
        return min(max_model_len, self.num_blocks * self.block_size)

    def max_blocks_per_sequence(self, num_tokens: int) -> int:
        """The most blocks a sequence holds at once while it computes num_tokens tokens a step (1: decoding)."""
        if self.window is None:
            return self.num_blocks
        return min(self.num_blocks, (self.window + num_tokens - 2) // self.block_size + 2)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding the sequence's leading full blocks (at least one token is left to compute;
        with prompt logprobs, every position that predicts a token whose logprob is asked)."""
        if not self.enable_prefix_caching:
            return []
        reusable = len(seq) - 1
        if seq.params.prompt_logprobs is not None:
            reusable = min(reusable, seq.params.prompt_logprobs_start - 1)  # position p predicts token p + 1
        blocks = []
        for index in range(max(0, reusable) // self.block_size):
            block = self.cached.get(self._block_hash(seq, index))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the blocks for the sequence's first num_tokens tokens can be had (reusing cached ones)."""
        if seq.block_table:
            return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks
        hits = self.match_prefix(seq)
        kept = hits[self.freeable(len(hits) * self.block_size):]  # those before the first new token's window: not
        needed = self.blocks_needed(num_tokens) - len(hits) + sum(1 for b in kept if self.ref_counts[b] == 0)
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give a new (or preempted) sequence blocks for its first num_tokens tokens, reusing cached prefix blocks,
        and mark the reused tokens computed."""
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError("allocate() called without room")
        if not seq.block_table:
            hits = self.match_prefix(seq)
            skipped = self.freeable(len(hits) * self.block_size)  # outside the first new token's window: not taken
            seq.block_table.extend([FREED_BLOCK] * skipped)
            for block in hits[skipped:]:
                if self.ref_counts[block] == 0:
                    del self.free_blocks[block]
                self.ref_counts[block] += 1
                seq.block_table.append(block)
            seq.num_freed_blocks = skipped
            seq.num_hashed_blocks = len(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            if self.enable_prefix_caching:
                self.num_queried_tokens += seq.num_prompt_tokens
                self.num_hit_tokens += min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make sure the sequence's block table covers num_tokens tokens."""
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take())

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        missing = num_tokens - len(seq.block_table) * self.block_size
        return missing <= 0 or -(-missing // self.block_size) <= len(self.free_blocks)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of the sequence's blocks that are now full of computed tokens (whose ids are known:
        a pending token's is not yet)."""
        self.commit_blocks(seq, min(seq.num_computed_tokens, len(seq) - seq.num_pending) // self.block_size)

    def commit_blocks(self, seq: Sequence, full: int) -> None:
        """Register the hashes of the sequence's first `full` blocks (full of known tokens, in token_ids)."""
        if not self.enable_prefix_caching or full <= seq.num_hashed_blocks:
            return
        for index in range(max(seq.num_hashed_blocks, seq.num_freed_blocks), full):
            h = self._block_hash(seq, index)
            block = seq.block_table[index]
            self.block_hashes[block] = h
            self.cached.setdefault(h, block)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free_outside_window(self, seq: Sequence) -> None:
        """Give back the sequence's blocks that no query from its next one on reads (none without a window), each
        registered in the prefix cache first."""
        end = min(self.freeable(seq.num_computed_tokens), len(seq.block_table))
        if end <= seq.num_freed_blocks:
            return
        self.commit_blocks(seq, min(end, (len(seq) - seq.num_pending) // self.block_size))
        table = seq.block_table
        for index in range(seq.num_freed_blocks, end):
            self._release(table[index])
            table[index] = FREED_BLOCK
        seq.num_freed_blocks = end

    def free(self, seq: Sequence) -> None:
        # Freed last block first: the blocks deepest in a prefix are evicted before their parents.
        for block in reversed(seq.block_table[seq.num_freed_blocks:]):
            self._release(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.num_freed_blocks = 0

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Give `child` the parent's KV of all prompt tokens but the last, which the child computes itself to sample
        its own first token: full blocks shared, the last partial block copied (the copy returned as a (source,
        destination) pair for the backend). None when no block is free for the copy. A parent that has freed
        blocks inside the window of the child's first query shares nothing: the child computes its prompt itself."""
        shared = parent.num_prompt_tokens - 1
        full, partial = divmod(shared, self.block_size)
        freed = parent.num_freed_blocks
        if freed > self.freeable(shared):
            return []
        if partial and not self.free_blocks:
            return None
        child.block_table.extend([FREED_BLOCK] * freed)
        child.num_freed_blocks = freed
        for block in parent.block_table[freed:full]:
            self.ref_counts[block] += 1
            child.block_table.append(block)
        copies = []
        if partial:
            copy = self._take()
            copies.append((parent.block_table[full], copy))
            child.block_table.append(copy)
        child.num_computed_tokens = shared
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        return copies

    def check_block_tables(self, seqs: list[Sequence]) -> None:
        """Assert that the block tables of seqs (every sequence holding blocks) account for the blocks in use: each
        block's reference count is the number of tables holding it, a block held twice is a prefix-cache block, and
        no table holds a free block (nor a freed entry before a window that is not behind it)."""
        assert all(seq.num_freed_blocks <= self.freeable(seq.num_computed_tokens) for seq in seqs), \
            "a block inside a window was freed"
        held = Counter(chain.from_iterable(seq.block_table[seq.num_freed_blocks:] for seq in seqs))
        assert len(held) == self.num_blocks - len(self.free_blocks), "a block in use is in no block table"
        assert held.keys().isdisjoint(self.free_blocks.keys()), "a free block is in a block table"  # views: O(held)
        assert list(map(self.ref_counts.__getitem__, held)) == list(held.values()), next(
            f"block {b}: {n} tables, reference count {self.ref_counts[b]}" for b, n in held.items()
            if self.ref_counts[b] != n)
        holders = {}  # a block held twice is a prefix-cache block, or one that forked completions of a request share
        for seq in seqs:
            for block in seq.block_table[seq.num_freed_blocks:]:
                holders.setdefault(block, set()).add(seq.request_id)
        assert all(self.block_hashes[b] is not None or len(holders[b]) == 1 for b, n in held.items() if n > 1), \
            "a shared block is neither cached nor shared by one request's completions"

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (for benchmarks: one workload must not warm the next). Only when no block is in
        use: a block shared by running sequences must stay a prefix-cache block."""
        if len(self.free_blocks) != self.num_blocks:
            raise RuntimeError("reset_prefix_cache() while blocks are in use")
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks

    def _block_hash(self, seq: Sequence, index: int) -> bytes:
        """The hash of the sequence's block `index`, which must be full of known tokens. Such tokens never change,
        so each block's hash is computed once per sequence (kept across preemption), in order."""
        hashes = seq.block_hashes
        while len(hashes) <= index:
            start = len(hashes) * self.block_size
            hashes.append(block_hash(hashes[-1] if hashes else b"", seq.token_ids[start: start + self.block_size]))
        return hashes[index]

    def take_blocks(self, count: int) -> list[int]:
        """`count` free blocks, in the order grow() would take them one by one."""
        return [self._take() for _ in range(count)]

    def _take(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        h = self.block_hashes[block]
        if h is not None:  # evict: this block's cached prefix is forgotten
            if self.before_evict is not None:
                self.before_evict()
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hashes[block] = None
        self.ref_counts[block] = 1
        return block
