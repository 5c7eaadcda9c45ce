"""Turn a scheduled step into the flat arrays a backend consumes (a `Batch`)."""

from __future__ import annotations

import numpy as np

from tinyvllm.backends.base import Batch, SamplingBatch
from tinyvllm.backends.sampler import step_keys
from tinyvllm.engine.scheduler import ScheduledStep
from tinyvllm.engine.sequence import Sequence


class BlockTables:
    """The sequences' block tables kept as rows of one int32 array (zero past each table's end) and updated as the
    tables grow, so that a step's [S, width] block table is one gather: copying S Python lists into an array took
    ~1.2 ms a step at 512 rows. A sequence holds its row from its first step until release(); a table that the block
    manager replaced (freed on preemption, then allocated again) is written again whole."""

    def __init__(self) -> None:
        self.rows = np.zeros((8, 8), np.int32)
        self.owners: list[Sequence | None] = [None] * 8  # Sequence.table_row is only a hint: this says whose it is
        self.tables: list[list[int] | None] = [None] * 8  # the list each row was copied from
        self.lengths = [0] * 8  # how much of it
        self.free = list(range(7, -1, -1))

    def gather(self, seqs: list[Sequence]) -> np.ndarray:
        rows = [self._update(seq) for seq in seqs]
        width = max(self.lengths[row] for row in rows)
        return self.rows[rows, :width]

    def release(self, seq: Sequence) -> None:
        row = seq.table_row
        if 0 <= row < len(self.owners) and self.owners[row] is seq:
            self.owners[row] = self.tables[row] = None
            self.free.append(row)
        seq.table_row = -1

    def _update(self, seq: Sequence) -> int:
        row, table = seq.table_row, seq.block_table
        if not (0 <= row < len(self.owners) and self.owners[row] is seq):
            row = seq.table_row = self._take()
            self.owners[row] = seq
        known, length = self.lengths[row], len(table)
        if self.tables[row] is not table or length < known:
            self.tables[row], known = table, 0
            self.rows[row] = 0
        if length > known:
            if length > self.rows.shape[1]:
                self.rows = np.pad(self.rows, ((0, 0), (0, max(length, 2 * self.rows.shape[1]) - self.rows.shape[1])))
            self.rows[row, known:length] = table[known:]
        self.lengths[row] = length
        return row

    def _take(self) -> int:
        if not self.free:
            n = len(self.owners)
            self.rows = np.pad(self.rows, ((0, n), (0, 0)))
            self.owners += [None] * n
            self.tables += [None] * n
            self.lengths += [0] * n
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()


def build_batch(step: ScheduledStep, block_size: int, tables: BlockTables | None = None) -> Batch:
    """The step's Batch; `tables`: the engine's BlockTables (None: a throwaway one)."""
    seqs = step.seqs
    n = len(seqs)
    starts = np.fromiter([seq.num_computed_tokens for seq in seqs], np.int32, n)
    query_lens = np.asarray(step.num_new_tokens, np.int32)
    ends = starts + query_lens
    query_start_loc = np.zeros(n + 1, np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    is_prefill = bool(query_lens.max() > 1)
    if is_prefill:
        token_ids = np.concatenate([np.asarray(seq.token_ids[s:e], np.int32) for seq, s, e in zip(seqs, starts, ends)])
        positions = np.concatenate([np.arange(s, e, dtype=np.int32) for s, e in zip(starts, ends)])
    else:
        # one new token each: mostly the last sampled one, but it can be a 1-token prompt chunk
        token_ids = np.fromiter([seq.token_ids[s] for seq, s in zip(seqs, starts.tolist())], np.int32, n)
        positions = starts
    # A token still being sampled by the previous step (the engine runs one step ahead) is read on the backend
    # from that step's sampled ids: token_sources gives the row there, -1 where token_ids holds the token.
    pending = [i for i, (seq, e) in enumerate(zip(seqs, ends.tolist())) if seq.num_pending and e == len(seq.token_ids)]
    token_sources = None
    if pending:
        token_sources = np.full(len(token_ids), -1, np.int32)
        token_sources[query_start_loc[1:][pending] - 1] = [seqs[i].sample_row for i in pending]
    block_tables = (tables or BlockTables()).gather(seqs)
    seq_index = np.repeat(np.arange(n), query_lens)
    slot_mapping = (block_tables[seq_index, positions // block_size] * block_size
                    + positions % block_size).astype(np.int32)

    params = [seq.params for seq in seqs]
    sampling = SamplingBatch(
        temperature=np.array([p.temperature for p in params], np.float32),
        top_p=np.array([p.top_p for p in params], np.float32),
        top_k=np.array([p.top_k for p in params], np.int32),
        min_p=np.array([p.min_p for p in params], np.float32),
        noise_keys=step_keys(np.array([seq.sampling_key for seq in seqs], np.uint32),
                             np.fromiter([len(seq.token_ids) - seq.num_prompt_tokens for seq in seqs], np.uint32, n)),
        num_logprobs=max((-1 if p.logprobs is None else p.logprobs for p in params), default=-1),
    )
    # Prompt logprobs: new position p predicts prompt token p + 1, for as long as that is a prompt token.
    targets = {}
    for i in [i for i, p in enumerate(params) if p.prompt_logprobs is not None]:
        seq, s, e = seqs[i], int(starts[i]), int(ends[i])
        if s + 1 < seq.num_prompt_tokens:
            targets[i] = np.asarray(seq.prompt_token_ids[s + 1: min(e + 1, seq.num_prompt_tokens)], np.int32)
    num_prompt_logprobs = max((seqs[i].params.prompt_logprobs for i in targets), default=0)
    copies = np.asarray(step.block_copies, np.int32).reshape(-1, 2) if step.block_copies else None
    return Batch(is_prefill, token_ids, positions, slot_mapping, query_start_loc, ends.astype(np.int32),
                 block_tables, sampling, targets, num_prompt_logprobs, token_sources, block_copies=copies)
