"""DecodeRun: the decoding sequences' per-step state in persistent arrays, updated by deltas as sequences join and
leave, so that a steady-state decode step is scheduled, prepared and read without per-row Python.

A running sequence joins once it decodes and needs nothing the arrays do not hold (`eligible`). It leaves when it
finishes, is aborted, is about to reach its length limit, or when a step needs the scheduler's full path: too few
free blocks or too little budget for every decode (preemption decides then, and none joins for block_size steps),
or a decode that cannot join (then every row leaves, and none joins again while that decode runs). The attached
rows are the step's first rows, in arrival order, as the scheduler orders decodes; prompt chunks and new sequences
follow them.

While a sequence is attached, four of its fields are stale and the run holds them: num_computed_tokens,
num_pending, sample_row and the tail of token_ids (the run buffers the tokens from `base` on, the pending ones
included). write_back() brings the fields up to date, read_in() takes them back; everything else stays live. The
rows' sampled-token logprobs gather in a LogprobBuffer and reach the sequences in blocks (at write_back, or when a
slot's buffer fills): until then an attached sequence's `logprobs` and `cumulative_logprob` lack them.

The prefix-cache commits of the blocks that attached rows fill are logged in the order the output processor would
make them, and made (flush_commits) before anything else reads or writes the prefix cache: an admission's lookup,
a freed sequence, another commit, the eviction of a cached block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tinyvllm.backends.base import LogitsProcessing, Logprobs
from tinyvllm.engine.logprob_buffer import LogprobBuffer
from tinyvllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus

CAPACITY = 256  # tokens a row buffers before its known ones are moved into its token_ids
COMPACT_PER_STEP = 32  # rows past 3/4 of their buffer compacted a step (besides full ones)

# per-slot arrays: name -> dtype
ARRAYS = {
    "gen": np.int64,  # changes when the slot changes hands: a step's row whose sequence left since is told apart
    "held": np.bool_, "live": np.bool_,  # held: attached; live: written back for a moment (write_back_live)
    "ctx": np.int64, "computed": np.int64, "pending": np.int64, "sample_row": np.int64, "base": np.int64,
    "max_len": np.int64, "arrival": np.int64, "trow": np.int64, "nblocks": np.int64, "hashed": np.int64,
    "check": np.bool_,  # its tokens are read one by one (logprobs, stop strings)
    "has_processors": np.bool_,
    # stop strings (the output processor's): which of its masks of tokens that may end a match applies (-1: none,
    # every token is looked at; -2: not chosen yet), the length after which stop strings are looked for, how many
    # of the last tokens read have text still to add (`deferred`), and whether its text holds back bytes that may
    # end a match
    "text_mask": np.int64, "look_after": np.int64, "deferred": np.int64, "text_held": np.bool_,
    "has_logprobs": np.bool_, "has_text": np.bool_,
    "constrained": np.bool_,  # a structured output: each token is looked at (its constraint takes it)
}


@dataclass
class FastRows:
    """The attached rows at the head of a step: their slots, the slots' generations, and (once prepared) where in
    each sequence's token_ids the step's sampled token goes."""

    slots: np.ndarray
    gens: np.ndarray
    sample_index: np.ndarray | None = None


def eligible(seq: Sequence) -> bool:
    """Whether a decoding sequence can join: no completions left to fork, and logits processors that stay the
    same from step to step (allowed_token_ids, logit_bias, single-token bad words, penalties with their slot;
    min_tokens once reached; no bad word of several tokens). A structured output's mask changes every step, but
    it is the constraint's, not the processors'."""
    proc = seq.processors
    return (not seq.forks_left
            and (proc is None or (not proc.bad_sequences and (not proc.penalties or seq.penalty_slot >= 0)
                                  and (not len(proc.min_tokens_ban) or min_tokens_out(seq)))))


def min_tokens_out(seq: Sequence) -> bool:
    """Whether min_tokens are out without its pending tokens: the count an attached sequence's token_ids then
    gives (read_in moves the pending ones out) is never below it, so no min_tokens ban is built for it."""
    return seq.num_output_tokens - seq.num_pending >= seq.params.min_tokens


def decoding(seq: Sequence) -> bool:
    """A running sequence whose next step is a decode (its prompt computed, below its length limit)."""
    n = len(seq.token_ids)
    return n < seq.max_len and seq.num_computed_tokens == n - 1 and seq.num_computed_tokens >= seq.num_prompt_tokens


class DecodeRun:
    def __init__(self, block_manager, batch_rows, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.block_manager, self.batch_rows = block_manager, batch_rows
        self.block_size = block_manager.block_size
        self.seqs: list[Sequence | None] = []
        self.free: list[int] = []
        for name, dtype in ARRAYS.items():
            setattr(self, name, np.zeros(0, dtype))
        self.buf = np.zeros((0, CAPACITY), np.int32)
        self.logprobs = LogprobBuffer()
        self.count = 0
        self.stop_mask = np.zeros(vocab_size, np.bool_)  # tokens that may stop some row: checked one by one
        self.eos_token_ids, self._eos_marked = eos_token_ids, set()  # the engine's set (its parts share it)
        self.blocker: Sequence | None = None  # a running decode that cannot join: none does while it runs
        # steps left without joins after the blocks ran short (preemptions come in bursts: the rows would leave
        # again at once)
        self.hold_off = 0
        self.log: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (slots, gens, full blocks) to commit
        self._order: np.ndarray | None = None
        self._ordered: list[Sequence] = []
        self._fields: tuple[np.ndarray, dict] | None = None  # (order, its rows' BatchRows fields)
        self._processing: tuple[np.ndarray, LogitsProcessing | None] | None = None  # (order, its processing)

    # ---- joining and leaving ---------------------------------------------------------------------------------------

    def join(self, seq: Sequence) -> None:
        if not self.free:
            self._widen()
        slot = self.free.pop()
        seq.run_slot = slot
        self.seqs[slot] = seq
        self.held[slot], self.live[slot] = True, False
        row = self.batch_rows.row(seq)
        self.trow[slot], self.max_len[slot], self.arrival[slot] = row, seq.max_len, seq.arrival_index
        self.constrained[slot] = seq.constraint is not None
        self.check[slot] = seq.logprobs is not None or seq.detokenizer is not None or self.constrained[slot]
        self.has_logprobs[slot], self.has_text[slot] = seq.logprobs is not None, seq.detokenizer is not None
        if seq.logprobs is not None:
            self.logprobs.start(slot, seq.params.logprobs)
        self.deferred[slot] = 0
        self.look_after[slot] = seq.num_prompt_tokens + seq.params.min_tokens
        self.has_processors[slot] = seq.processors is not None
        self._mark_stops(seq.params.stop_token_ids)
        self.read_in(slot)
        self.count += 1
        self._order = None

    def _mark_stops(self, token_ids) -> None:
        self.stop_mask[[t for t in token_ids if 0 <= t < len(self.stop_mask)]] = True

    def leave(self, seq: Sequence) -> None:
        """Detach the sequence, its fields written back (idempotent)."""
        slot = seq.run_slot
        if slot < 0:
            return
        self.flush_commits()
        if not self.live[slot]:
            self.write_back(slot)
        self.held[slot] = self.live[slot] = False
        self.gen[slot] += 1
        self.seqs[slot] = None
        seq.run_slot = -1
        self.free.append(slot)
        self.count -= 1
        self._order = None

    def detach_all(self) -> None:
        for slot in self.order().tolist():
            self.leave(self.seqs[slot])

    def write_back(self, slot: int) -> None:
        seq = self.seqs[slot]
        n = int(self.ctx[slot] - self.base[slot])
        if n:
            seq.token_ids += self.buf[slot, :n].tolist()
        seq.num_computed_tokens = int(self.computed[slot])
        seq.num_pending = int(self.pending[slot])
        seq.sample_row = int(self.sample_row[slot])
        self.base[slot] = self.ctx[slot]
        self.catch_up_text(slot, int(self.ctx[slot] - self.pending[slot]))
        self.flush_logprobs(slot)

    def record_logprobs(self, slots: np.ndarray, rows: np.ndarray, token_ids: np.ndarray, logprobs: Logprobs) -> None:
        """The logprobs of the tokens just read for these attached slots (row rows[i] of the step's `logprobs`),
        buffered; a slot whose buffer fills passes them on."""
        for slot in self.logprobs.record(slots, rows, token_ids, logprobs).tolist():
            self.flush_logprobs(slot)

    def flush_logprobs(self, slot: int) -> None:
        """The slot's buffered logprobs to its sequence: a block of entries, and their sum in its cumulative
        logprob (added one by one in order, as the output processor adds an entry's)."""
        taken = self.logprobs.take(slot) if self.has_logprobs[slot] else None
        if taken is not None:
            seq = self.seqs[slot]
            seq.logprobs.add_block(*taken)
            total = seq.cumulative_logprob
            for value in taken[1].tolist():
                total += value
            seq.cumulative_logprob = total

    def catch_up_text(self, slot: int, upto: int) -> None:
        """Add the text of the row's deferred tokens (those before position `upto`) to its sequence's text."""
        n = int(self.deferred[slot])
        if n:
            self.deferred[slot] = 0
            seq = self.seqs[slot]
            seq.text += seq.detokenizer.extend(self.known_tokens(slot, upto - n, upto))

    def known_tokens(self, slot: int, start: int, stop: int) -> list[int]:
        """The row's tokens at positions start..stop-1 (known ones: in token_ids, then in the buffer)."""
        base, token_ids = int(self.base[slot]), self.seqs[slot].token_ids
        head = token_ids[start:min(stop, base)] if start < base else []
        return head + (self.buf[slot, max(start, base) - base: stop - base].tolist() if stop > base else [])

    def read_in(self, slot: int) -> None:
        """Take the sequence's fields into the arrays; its pending placeholders (the last num_pending token ids)
        move into the buffer."""
        seq = self.seqs[slot]
        tokens, k = seq.token_ids, seq.num_pending
        length = len(tokens)
        assert all(t == PENDING_TOKEN for t in tokens[length - k:]), "pending tokens end token_ids"
        del tokens[length - k:]
        self.buf[slot, :k] = PENDING_TOKEN
        self.ctx[slot], self.base[slot], self.pending[slot] = length, length - k, k
        self.computed[slot], self.sample_row[slot] = seq.num_computed_tokens, seq.sample_row
        self.nblocks[slot], self.hashed[slot] = len(seq.block_table), seq.num_hashed_blocks
        self.text_mask[slot] = -2 if seq.detokenizer is not None else -1  # its text's state: looked at next

    def write_back_live(self, seq: Sequence) -> None:
        """Bring an attached sequence's fields up to date for code that reads and changes them; restore() after."""
        self.write_back(seq.run_slot)
        self.live[seq.run_slot] = True

    def restore(self, seq: Sequence) -> None:
        slot = seq.run_slot
        if slot >= 0:
            self.live[slot] = False
            self.read_in(slot)

    def compact(self, slot: int) -> None:
        """Move the row's known buffered tokens into its token_ids (its pending ones stay buffered)."""
        known = int(self.ctx[slot] - self.pending[slot] - self.base[slot])
        if known > 0:
            self.seqs[slot].token_ids += self.buf[slot, :known].tolist()
            rest = int(self.pending[slot])
            self.buf[slot, :rest] = self.buf[slot, known: known + rest].copy()
            self.base[slot] += known

    def order(self) -> np.ndarray:
        """The attached slots in arrival order."""
        if self._order is None:
            held = np.flatnonzero(self.held)
            self._order = held[np.argsort(self.arrival[held], kind="stable")]
            self._ordered = [self.seqs[slot] for slot in self._order.tolist()]
        return self._order

    def _widen(self) -> None:
        n = max(8, len(self.seqs))
        for name in ARRAYS:
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n, ARRAYS[name])]))
        self.buf = np.concatenate([self.buf, np.zeros((n, CAPACITY), np.int32)])
        self.free += range(len(self.seqs) + n - 1, len(self.seqs) - 1, -1)
        self.seqs += [None] * n

    # ---- one step --------------------------------------------------------------------------------------------------

    def schedule(self, step, running: list[Sequence], budget: int, admitting: bool) -> int:
        """Put every attached row in the step (one token each, new blocks where one fills up), first; return the
        budget left. Rows that cannot all go this way are detached, for the scheduler's full path."""
        if admitting:
            self.flush_commits()  # the admissions look up the prefix cache
        if self.count:
            order = self.order()
            for slot in order[self.ctx[order] >= self.max_len[order]].tolist():
                self.leave(self.seqs[slot])  # its pending token is its last: it is not scheduled again
        if self.count < len(running) and not self._join_decodes(running):
            self.detach_all()
            return budget
        if not self.count:
            return budget
        order = self.order()
        need = order[self.computed[order] + 1 > self.nblocks[order] * self.block_size]
        if budget < self.count or len(need) > self.block_manager.num_free_blocks:
            self.detach_all()
            self.hold_off = self.block_size
            return budget
        if len(need):
            self._grow_tables(need)
        step.seqs = list(self._ordered)
        step.num_new_tokens = [1] * self.count
        step.fast = FastRows(order, self.gen[order])
        return budget - self.count

    def _join_decodes(self, running: list[Sequence]) -> bool:
        """Attach every running decode not attached; False if one cannot join (it blocks the run while it runs)."""
        if self.hold_off:
            self.hold_off -= 1
            return False
        blocker = self.blocker
        if blocker is not None:
            if blocker.status is SequenceStatus.RUNNING and decoding(blocker) and not eligible(blocker):
                return False
            self.blocker = None
        joiners = []
        for seq in running:
            if seq.run_slot < 0 and decoding(seq):
                if not eligible(seq):
                    self.blocker = seq
                    return False
                joiners.append(seq)
        for seq in joiners:
            self.join(seq)
        return True

    def _grow_tables(self, need: np.ndarray) -> None:
        """One more block for each of these slots (in order): the block manager's, the sequence's block table and
        its BatchRows row."""
        rows = self.batch_rows
        rows.widen(int(self.nblocks[need].max()) + 1)
        blocks = self.block_manager.take_blocks(len(need))
        for slot, block in zip(need.tolist(), blocks):
            self.seqs[slot].block_table.append(block)
        trows = self.trow[need]
        rows.block_tables[trows, self.nblocks[need]] = blocks
        for row in trows.tolist():
            rows.lengths[row] += 1
        self.nblocks[need] += 1

    def fields(self, fast: FastRows) -> dict:
        """BatchRows.gather_fields of the rows, kept while the run's rows stay the same."""
        if self._fields is None or self._fields[0] is not fast.slots:
            self._fields = fast.slots, self.batch_rows.gather_fields(self.trow[fast.slots])
        return self._fields[1]

    def inputs(self, fast: FastRows) -> tuple[np.ndarray, ...]:
        """The attached rows' BatchRows rows, block-table lengths, computed tokens (starts), lengths, input token
        ids (a placeholder where pending) and their token sources (the previous step's row, or -1)."""
        slots = fast.slots
        starts, lengths = self.computed[slots], self.ctx[slots]
        pending = self.pending[slots] > 0
        if pending.all():  # the steady state, one step ahead: every row's input is the token in flight
            tokens, sources = np.full(len(slots), PENDING_TOKEN, np.int32), self.sample_row[slots].astype(np.int32)
        else:
            cols = lengths - 1 - self.base[slots]
            tokens = np.where(pending, PENDING_TOKEN, self.buf[slots, np.maximum(cols, 0)]).astype(np.int32)
            for i in np.flatnonzero(~pending & (cols < 0)).tolist():  # a known last token already in token_ids
                tokens[i] = self.seqs[slots[i]].token_ids[lengths[i] - 1]
            sources = np.where(pending, self.sample_row[slots], -1).astype(np.int32)
        return self.trow[slots], self.nblocks[slots], starts, lengths, tokens, sources

    def advance(self, fast: FastRows) -> None:
        """The rows advanced as if the step had run: one computed token more, a pending one at the end."""
        slots = fast.slots
        fill = self.ctx[slots] - self.base[slots]
        due = np.flatnonzero(fill >= CAPACITY * 3 // 4)
        if len(due):
            # a few a step (rows that joined together fill up together), and every full one: its next token has no room
            take = fill[due] >= CAPACITY
            take[:COMPACT_PER_STEP] = True
            for slot in slots[due[take]].tolist():
                self.compact(slot)
        lengths = self.ctx[slots]
        self.buf[slots, lengths - self.base[slots]] = PENDING_TOKEN
        fast.sample_index = lengths
        self.computed[slots] += 1
        self.ctx[slots] = lengths + 1
        self.pending[slots] += 1
        self.sample_row[slots] = np.arange(len(slots))

    def read(self, fast: FastRows, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Read the step's tokens of the rows still attached; return the rows read one by one instead (attached no
        longer), the rows whose tokens need a look (logprobs, stop strings, a possible stop token, the length limit,
        a structured output), those of them that a stop token, EOS or the length limit may end or whose constraint
        is done (read one by one), and the others (read together): each in row order."""
        slots = fast.slots
        valid = self.gen[slots] == fast.gens
        rows = np.flatnonzero(valid)
        held, tokens, index = slots[rows], tokens[rows], fast.sample_index[rows]
        self.buf[held, index - self.base[held]] = tokens
        self.pending[held] -= 1
        if self.eos_token_ids != self._eos_marked:
            self._mark_stops(self.eos_token_ids)
            self._eos_marked = set(self.eos_token_ids)
        may_stop = self.stop_mask[tokens] | (index + 1 >= self.max_len[held])
        done = self._constraints_done(held)  # these end without the token, before their blocks are committed
        if self.block_manager.enable_prefix_caching:
            self._log_commits(held if done is None else held[~done])
        if done is not None:
            may_stop |= done
        check = self.check[held]
        return np.flatnonzero(~valid), rows[check | may_stop], rows[may_stop], rows[check & ~may_stop]

    def _constraints_done(self, slots: np.ndarray) -> np.ndarray | None:
        """Which of the slots hold a structured output whose constraint is done (None: no slot has one)."""
        constrained = np.flatnonzero(self.constrained[slots])
        if not len(constrained):
            return None
        done = np.zeros(len(slots), np.bool_)
        done[constrained] = [self.seqs[slot].constraint.done for slot in slots[constrained].tolist()]
        return done

    def _log_commits(self, slots: np.ndarray) -> None:
        full = np.minimum(self.computed[slots], self.ctx[slots] - self.pending[slots]) // self.block_size
        filled = full > self.hashed[slots]
        if filled.any():
            slots, full = slots[filled], full[filled]
            self.log.append((slots, self.gen[slots], full))
            self.hashed[slots] = full

    def flush_commits(self) -> None:
        log, self.log = self.log, []
        for slots, gens, fulls in log:
            for slot, gen, full in zip(slots.tolist(), gens.tolist(), fulls.tolist()):
                assert self.gen[slot] == gen, "a row leaves only after its commits"
                if self.base[slot] < full * self.block_size:
                    self.compact(slot)
                self.block_manager.commit_blocks(self.seqs[slot], full)

    def logits_processing(self, fast: FastRows, build: Callable[[list[Sequence]], LogitsProcessing | None]
                          ) -> LogitsProcessing | None:
        """The LogitsProcessing of a step of the run's rows alone: `build(seqs)` of its rows, kept while they stay
        the same (what their processors ask is the same every step: see eligible)."""
        if self._processing is None or self._processing[0] is not fast.slots:
            self._processing = fast.slots, (build(self._ordered) if self.has_processors[fast.slots].any() else None)
        return self._processing[1]
