"""Turn a scheduled step into the flat arrays a backend consumes (a `Batch`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tinyvllm.backends.base import Batch, SamplingBatch
from tinyvllm.backends.sampler import step_keys
from tinyvllm.engine.persistent_batch import DecodeRun
from tinyvllm.engine.scheduler import ScheduledStep
from tinyvllm.engine.sequence import Sequence


class BatchRows:
    """Each running sequence's row in a few persistent arrays: its block table (zero past its end), kept up to date
    as the table grows, and what a step needs of its sampling parameters, written once when it takes the row. A
    step's block tables and sampling arrays are then gathers by the rows: copying them from 512 sequences' lists
    and parameters took ~1.2 ms and ~0.5 ms a step. A sequence holds its row from its first step until release(); a
    table that the block manager replaced (freed on preemption, then allocated again) is written again whole."""

    # per-row fields copied from a sequence when it takes a row: name -> (dtype, the value)
    FIELDS: dict[str, tuple[type, Callable[[Sequence], float]]] = {
        "temperature": (np.float32, lambda seq: seq.params.temperature),
        "top_p": (np.float32, lambda seq: seq.params.top_p),
        "top_k": (np.int32, lambda seq: seq.params.top_k),
        "min_p": (np.float32, lambda seq: seq.params.min_p),
        "sampling_key": (np.uint32, lambda seq: seq.sampling_key),
        "num_prompt_tokens": (np.int32, lambda seq: seq.num_prompt_tokens),
        "logprobs": (np.int32, lambda seq: -1 if seq.params.logprobs is None else seq.params.logprobs),
        "prompt_logprobs": (np.bool_, lambda seq: seq.params.prompt_logprobs is not None),
    }

    def __init__(self) -> None:
        self.block_tables = np.zeros((8, 8), np.int32)
        self.fields = {name: np.zeros(8, dtype) for name, (dtype, _) in self.FIELDS.items()}
        self.owners: list[Sequence | None] = [None] * 8  # Sequence.table_row is only a hint: this says whose it is
        self.tables: list[list[int] | None] = [None] * 8  # the list each row was copied from
        self.lengths = [0] * 8  # how much of it
        self.free = list(range(7, -1, -1))

    def gather(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """The sequences' rows, and their block tables [S, longest table]."""
        rows, width = self.rows(seqs)
        rows = np.array(rows, np.intp)
        return rows, self.block_tables[rows, :width]

    def gather_fields(self, rows: np.ndarray) -> dict:
        """The FIELDS of these rows, with the most logprobs asked (num_logprobs), the rows asking logprobs when only
        some do (logprob_rows, else None), the rows asking prompt logprobs (prompt_logprob_rows) and those that
        sample at random (random_rows: temperature > 0)."""
        fields = {name: values[rows] for name, values in self.fields.items()}
        fields["num_logprobs"] = int(fields["logprobs"].max())
        asked = fields["logprobs"] >= 0
        fields["logprob_rows"] = np.flatnonzero(asked).astype(np.int32) if 0 < asked.sum() < len(rows) else None
        fields["prompt_logprob_rows"] = np.flatnonzero(fields["prompt_logprobs"]).tolist()
        fields["random_rows"] = np.flatnonzero(fields["temperature"] > 0)
        return fields

    def rows(self, seqs: list[Sequence]) -> tuple[list[int], int]:
        """The sequences' rows (their tables brought up to date), and the longest table's length."""
        owners, tables, lengths = self.owners, self.tables, self.lengths
        # most steps change no table: a row still held, with the same list at the same length, is taken as it is
        rows = [row if 0 <= (row := seq.table_row) < len(owners) and owners[row] is seq
                and tables[row] is seq.block_table and lengths[row] == len(seq.block_table) else self._update(seq)
                for seq in seqs]
        return rows, max(map(lengths.__getitem__, rows))

    def row(self, seq: Sequence) -> int:
        """The sequence's row, its table brought up to date."""
        return self.rows([seq])[0][0]

    def widen(self, length: int) -> None:
        """Room for block tables of `length` entries."""
        width = self.block_tables.shape[1]
        if length > width:
            self.block_tables = np.pad(self.block_tables, ((0, 0), (0, max(length, 2 * width) - width)))

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
            for name, (_, value) in self.FIELDS.items():
                self.fields[name][row] = value(seq)
        known, length = self.lengths[row], len(table)
        if self.tables[row] is not table or length < known:
            self.tables[row], known = table, 0
            self.block_tables[row] = 0
        if length > known:
            self.widen(length)
            self.block_tables[row, known:length] = table[known:]
        self.lengths[row] = length
        return row

    def _take(self) -> int:
        if not self.free:
            n = len(self.owners)
            self.block_tables = np.pad(self.block_tables, ((0, n), (0, 0)))
            self.fields = {name: np.pad(values, (0, n)) for name, values in self.fields.items()}
            self.owners += [None] * n
            self.tables += [None] * n
            self.lengths += [0] * n
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()


def build_batch(step: ScheduledStep, block_size: int, batch_rows: BatchRows | None = None,
                run: DecodeRun | None = None) -> Batch:
    """The step's Batch; `batch_rows`: the engine's BatchRows (None: a throwaway one); `run`: the DecodeRun holding
    the step's first rows (step.fast), if any."""
    seqs = step.seqs
    n = len(seqs)
    batch_rows = BatchRows() if batch_rows is None else batch_rows
    num_fast = 0 if step.fast is None else len(step.fast.slots)
    # a step of the run's rows alone: one new token each
    query_lens = np.ones(n, np.int32) if num_fast == n else np.asarray(step.num_new_tokens, np.int32)
    parts = []
    if num_fast:
        parts.append(run.inputs(step.fast))
    if num_fast < n:
        parts.append(_row_inputs(seqs[num_fast:], query_lens[num_fast:], batch_rows))
    rows, widths, starts, lengths, token_ids, sources = (
        parts[0] if len(parts) == 1 else [np.concatenate(columns) for columns in zip(*parts)])
    width = int(widths.max())
    block_tables = batch_rows.block_tables[rows, :width]
    ends = starts + query_lens
    if num_fast == n:
        query_start_loc, max_query_len = np.arange(n + 1, dtype=np.int32), 1
    else:
        query_start_loc = np.zeros(n + 1, np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        max_query_len = int(query_lens.max())
    positions = (np.concatenate([np.arange(s, e, dtype=np.int32) for s, e in zip(starts, ends)])
                 if max_query_len > 1 else starts.astype(np.int32))
    # A token still being sampled by the previous step (the engine runs one step ahead) is read on the backend
    # from that step's sampled ids: token_sources gives the row there, -1 where token_ids holds the token.
    token_sources = None
    if max_query_len == 1:  # a token per row: the rows' sources as they are
        token_sources = sources.astype(np.int32, copy=False) if (sources >= 0).any() else None
    elif (sources >= 0).any():
        token_sources = np.full(len(token_ids), -1, np.int32)
        token_sources[query_start_loc[1:] - 1] = sources
    seq_index = np.repeat(np.arange(n), query_lens) if max_query_len > 1 else np.arange(n)
    slot_mapping = (block_tables[seq_index, positions // block_size] * block_size
                    + positions % block_size).astype(np.int32)

    # the run's rows' fields change only when its rows do
    fields = run.fields(step.fast) if num_fast == n else batch_rows.gather_fields(rows)
    sampling = SamplingBatch(
        temperature=fields["temperature"], top_p=fields["top_p"], top_k=fields["top_k"], min_p=fields["min_p"],
        noise_keys=_noise_keys(fields, lengths),
        num_logprobs=fields["num_logprobs"], logprob_rows=fields["logprob_rows"],
    )
    targets = _prompt_logprob_targets(seqs, starts, ends, fields)
    num_prompt_logprobs = max((seqs[i].params.prompt_logprobs for i in targets), default=0)
    copies = np.asarray(step.block_copies, np.int32).reshape(-1, 2) if step.block_copies else None
    lookahead = None if step.num_lookahead_slots is None else np.asarray(step.num_lookahead_slots, np.int32)
    return Batch(max_query_len, token_ids, positions, slot_mapping, query_start_loc, ends.astype(np.int32),
                 block_tables, sampling, targets, num_prompt_logprobs, token_sources, block_copies=copies,
                 logits_indices=query_start_loc[1:] - 1, num_lookahead_slots=lookahead)


def _noise_keys(fields: dict, lengths: np.ndarray) -> np.ndarray:
    """Each row's noise key for the token it samples (step_keys of its request's key and the token's output index);
    0 for a greedy row, which draws no noise (most batches: no key is made at all)."""
    random = fields["random_rows"]
    if len(random) == len(lengths):
        return step_keys(fields["sampling_key"], lengths - fields["num_prompt_tokens"])
    keys = np.zeros(len(lengths), np.uint32)
    if len(random):
        keys[random] = step_keys(fields["sampling_key"][random], lengths[random] - fields["num_prompt_tokens"][random])
    return keys


def _row_inputs(seqs: list[Sequence], query_lens: np.ndarray, batch_rows: BatchRows) -> tuple[np.ndarray, ...]:
    """What build_batch needs of sequences read from their fields: their BatchRows rows, block-table lengths,
    computed tokens (starts), lengths, new token ids and each one's token source (the previous step's row where its
    last new token is pending there, else -1)."""
    n = len(seqs)
    rows, _ = batch_rows.rows(seqs)
    widths = np.fromiter([batch_rows.lengths[row] for row in rows], np.int64, n)
    starts = np.fromiter([seq.num_computed_tokens for seq in seqs], np.int64, n)
    lengths = np.fromiter([len(seq.token_ids) for seq in seqs], np.int64, n)
    ends = starts + query_lens
    if int(query_lens.max()) > 1:
        token_ids = np.concatenate([np.asarray(seq.token_ids[s:e], np.int32) for seq, s, e in zip(seqs, starts, ends)])
    else:
        # one new token each: mostly the last sampled one, but it can be a 1-token prompt chunk
        token_ids = np.fromiter([seq.token_ids[s] for seq, s in zip(seqs, starts.tolist())], np.int32, n)
    sources = np.full(n, -1, np.int32)
    pending = np.flatnonzero((ends == lengths) & (np.fromiter([seq.num_pending for seq in seqs], np.int32, n) > 0))
    sources[pending] = [seqs[i].sample_row for i in pending.tolist()]
    return np.array(rows, np.intp), widths, starts, lengths, token_ids, sources


def _prompt_logprob_targets(seqs: list[Sequence], starts: np.ndarray, ends: np.ndarray,
                            fields: dict) -> dict[int, np.ndarray]:
    """Prompt logprobs: new position p predicts prompt token p + 1, for as long as that is a prompt token."""
    targets = {}
    for i in fields["prompt_logprob_rows"]:
        seq, s, e = seqs[i], int(starts[i]), int(ends[i])
        if s + 1 < seq.num_prompt_tokens:
            targets[i] = np.asarray(seq.prompt_token_ids[s + 1: min(e + 1, seq.num_prompt_tokens)], np.int32)
    return targets
