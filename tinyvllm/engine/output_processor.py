"""Output processing: a step's tokens read into its sequences (one or a run of accepted tokens each), stop rules,
logprobs, text, and the RequestOutputs of the requests that finish. It needs no backend: it reads a SamplerOutput
that is given to it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tinyvllm.backends.base import Batch, Logprobs, QueuedStep, SamplerOutput
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.persistent_batch import DecodeRun, FastRows
from tinyvllm.engine.scheduler import ScheduledStep
from tinyvllm.engine.sequence import Sequence, SequenceStatus
from tinyvllm.engine.structured_outputs import OutputConstraint, StructuredOutputManager
from tinyvllm.logprobs import logprob_dicts, logprob_entries
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.tokenizer import decode_continuations


MAX_TEXT_MASKS = 32  # kinds of stop-string rows whose text may be added later (more: each token looked at)


@dataclass
class InFlightStep:
    """A step submitted to the backend, with what is needed to read its output."""

    step: ScheduledStep
    batch: Batch
    # Per row after the run's (all rows without `fast`): the sequence's computed tokens before this step, and where
    # in token_ids the step's first sampled token goes (-1: a prompt chunk, none); its further accepted tokens
    # follow it. The run's rows are decodes: their fast.sample_index, and one less.
    starts: list[int]
    sample_index: list[int]
    queued: QueuedStep | None = None  # once submitted
    fast: FastRows | None = None  # its first rows, the DecodeRun's

    def start(self, i: int) -> int:
        num_fast = 0 if self.fast is None else len(self.fast.slots)
        return int(self.fast.sample_index[i]) - 1 if i < num_fast else self.starts[i - num_fast]

    def index(self, i: int) -> int:
        num_fast = 0 if self.fast is None else len(self.fast.slots)
        return int(self.fast.sample_index[i]) if i < num_fast else self.sample_index[i - num_fast]

    @property
    def may_return_runs(self) -> bool:
        """Whether some row may get more than one token (then the next step is scheduled after this one is read)."""
        lookahead = self.batch.num_lookahead_slots
        return lookahead is not None and bool(lookahead.any())


class OutputProcessor:
    """Reads each step's tokens into its sequences and finishes those that stop.

    `release(seq)` takes a finished sequence out of the engine (scheduler, penalty slot, batch row);
    `pass_on_forks(seq)` starts the completions a finished sequence had still to fork; `run` is the engine's
    DecodeRun (None: none), whose rows' tokens it reads in its arrays."""

    def __init__(self, tokenizer, eos_token_ids: set[int], block_manager: BlockManager,
                 structured_outputs: StructuredOutputManager, release: Callable[[Sequence], None],
                 pass_on_forks: Callable[[Sequence], None], run: DecodeRun | None = None) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.block_manager, self.block_size = block_manager, block_manager.block_size
        self.structured_outputs = structured_outputs
        self.release, self.pass_on_forks = release, pass_on_forks
        self.run = run
        # per stop-string row kind (tokenizer, last characters): which tokens may end a match (_mask_id)
        width = 0 if run is None else len(run.stop_mask)
        self.text_masks, self._mask_ids = np.zeros((0, width), np.bool_), {}

    def process(self, launched: InFlightStep, result: SamplerOutput,
                advance: list[tuple[OutputConstraint, int]]) -> list[RequestOutput]:
        """Read a step's tokens into its sequences; finish those that stop. The constrained sequences that go on
        leave their tokens in `advance`, for their constraints to take. The run's rows still attached are read in
        its arrays; only those whose tokens need a look (logprobs, stop strings, a stop token, the length limit)
        are gone through one by one, like the other rows."""
        now = time.time()
        ended: list[Sequence] = []
        step, fast = launched.step, launched.fast
        sampled = result.sampled_token_ids
        runs = sampled.shape[1] > 1  # else one token each: the common path
        counts = result.num_sampled.tolist() if runs else None
        # each row's first row of result.logprobs: the rows before it hold its predecessors' accepted tokens
        lp_rows = (np.cumsum(result.num_sampled) - result.num_sampled).tolist() if runs else range(len(sampled))
        rows, may_stop, hits, entries = range(len(sampled)), set(), set(), {}
        first = sampled[:, 0].tolist() if fast is None else []
        if fast is not None:
            num_fast = len(fast.slots)
            unattached, looked_at, stoppable, plain = self.run.read(fast, sampled[:num_fast, 0])
            if len(looked_at) or len(unattached) or len(sampled) > num_fast:  # a steady decode needs none
                first = sampled[:, 0].tolist()
            if len(looked_at):
                hits, may_stop = self._look_at(step.seqs, fast, plain, stoppable, first, result, advance)
                entries = self._look_ahead(step.seqs, sorted(may_stop), first, result.logprobs)
            rows = [*sorted({*unattached.tolist(), *may_stop, *hits}), *range(num_fast, len(sampled))]
        for i in rows:
            seq = step.seqs[i]
            if i in hits:  # attached: its token is in the run and its text cut already
                if seq.constraint is not None:
                    self.structured_outputs.take(seq.constraint, first[i])  # for `complete`, as _take
                self._end(seq, launched.index(i) + 1, now, ended)
                continue
            if i in may_stop:  # attached: its token is in the run already; only the stop rules and logprobs are left
                slot, index = int(fast.slots[i]), launched.index(i)
                self.run.catch_up_text(slot, index)
                self.run.flush_logprobs(slot)  # its entries so far come before this one
                if seq.constraint is not None and seq.constraint.done:  # as _read_row: this token is dropped
                    seq.finish_reason = "stop"
                    self._end(seq, index, now, ended)
                    continue
                self._take(seq, first[i], index + 1, result.logprobs, i, now, ended, advance, entries[i])
                self.run.text_mask[slot] = -2 if self.run.has_text[slot] else -1  # its text's state: looked at next
                continue
            attached = seq.run_slot >= 0
            if attached:
                self.run.write_back_live(seq)
            run = None if counts is None or counts[i] == 1 else sampled[i, :counts[i]].tolist()
            self._read_row(launched, i, seq, first[i], run, result, lp_rows[i], now, ended, advance)
            if attached:
                self.run.restore(seq)
        if ended:
            self._detokenize(ended)
        return [output for seq in ended if (output := self._finish(seq)) is not None]

    def _look_at(self, seqs: list[Sequence], fast: FastRows, plain: np.ndarray, stoppable: np.ndarray,
                 first: list[int], result: SamplerOutput, advance: list[tuple[OutputConstraint, int]]
                 ) -> tuple[set[int], set[int]]:
        """The run's rows whose tokens need a look: those only a stop string can end (`plain`) are read together
        (_take_texts), their structured outputs' constraints given their tokens in `advance`; return the rows a
        stop string ended and those left to read one by one (`stoppable`: a stop token, EOS or the length limit
        may end them, or their constraint is done)."""
        may_stop = set(stoppable.tolist())
        constrained = plain[self.run.constrained[fast.slots[plain]]].tolist()
        hits = set(self._take_texts(seqs, plain, fast, result.sampled_token_ids[plain, 0], first, result.logprobs))
        advance += [(seqs[i].constraint, first[i]) for i in constrained if i not in hits]
        return hits, may_stop

    @staticmethod
    def _look_ahead(seqs: list[Sequence], rows: list[int], tokens: list[int],
                    logprobs: Logprobs | None) -> dict[int, dict[int, float] | None]:
        """For rows of one token each: their logprob entries (None: none asked), made from one copy of the
        arrays."""
        with_logprobs = [i for i in rows if seqs[i].logprobs is not None]
        entries = dict.fromkeys(rows)
        entries.update(zip(with_logprobs, logprob_entries(logprobs, with_logprobs, [tokens[i] for i in with_logprobs],
                                                          [seqs[i].params.logprobs for i in with_logprobs])))
        return entries

    def _read_row(self, launched: InFlightStep, i: int, seq: Sequence, token: int, run: list[int] | None,
                  result: SamplerOutput, lp_row: int, now: float, ended: list[Sequence],
                  advance: list[tuple[OutputConstraint, int]]) -> None:
        """Read row i's token (or run of tokens, `run`) into its sequence, from its fields."""
        index = launched.index(i)
        if seq.status is SequenceStatus.FINISHED:
            return  # it stopped at the previous step: this step's work for it is dropped
        if index >= 0 and seq.constraint is not None and seq.constraint.done:
            # Complete with the token before (it has taken every token up to this one): this one, EOS or
            # whatever its mask allowed once nothing more could follow, is dropped.
            seq.finish_reason = "stop"
            self._end(seq, index, now, ended)
            return
        if result.prompt_logprobs and i in result.prompt_logprobs and seq.prompt_logprobs is not None:
            # (a later completion of n recomputing its prompt after preemption: the first one holds them)
            self._read_prompt_logprobs(seq, launched.start(i), result.prompt_logprobs[i],
                                       launched.batch.prompt_logprob_targets[i])
        if index >= 0:
            seq.token_ids[index] = token
            seq.num_pending -= 1
            if run is not None:
                _append_run(seq, index, run)
        if seq.num_computed_tokens // self.block_size > seq.num_hashed_blocks:  # a block may have filled up
            if self.run is not None:
                self.run.flush_commits()  # the run's rows' commits come first
            self.block_manager.commit_full_blocks(seq)
        if index < 0:
            return  # a prompt chunk: nothing sampled
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        if run is None:
            self._take(seq, token, index + 1, result.logprobs, lp_row, now, ended, advance)
            return
        for j, token in enumerate(run):  # in order: a stop cuts the tokens after it
            if self._take(seq, token, index + j + 1, result.logprobs, lp_row + j, now, ended, advance):
                break

    def _read_prompt_logprobs(self, seq: Sequence, start: int, logprobs: Logprobs, targets: np.ndarray) -> None:
        entries = logprob_dicts(logprobs, targets, seq.params.prompt_logprobs)
        # Entry p + 1 comes from position p; a recompute after preemption repeats what is already known; the
        # positions a prefix-cache hit skipped have none.
        seq.prompt_logprobs.extend([None] * (start + 1 - len(seq.prompt_logprobs)))
        seq.prompt_logprobs.extend(entries[len(seq.prompt_logprobs) - start - 1:])

    def _take(self, seq: Sequence, token: int, length: int, logprobs: Logprobs | None, lp_row: int, now: float,
              ended: list[Sequence], advance: list[tuple[OutputConstraint, int]],
              entry: dict[int, float] | None = None) -> bool:
        """Go through one token read (the sequence is `length` tokens long with it): its logprobs (entry: made
        beforehand, _look_ahead), then the stop rules; True if the sequence ends there."""
        if seq.logprobs is not None:
            entry = entry or logprob_dicts(logprobs, [token], seq.params.logprobs, lp_row)[0]
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[token]
        if self._check_stop(seq, token, length):
            if seq.constraint is not None:
                self.structured_outputs.take(seq.constraint, token)  # for `complete`
            self._end(seq, length, now, ended)
            return True
        if seq.constraint is not None:
            advance.append((seq.constraint, token))
        return False

    def _take_texts(self, seqs: list[Sequence], rows: np.ndarray, fast: FastRows, tokens: np.ndarray,
                    first: list[int], logprobs: Logprobs | None) -> list[int]:
        """_take() of attached rows' tokens that no stop token, EOS, length limit or done constraint can end: their
        logprobs (buffered by the run), then their stop strings (a structured output's token goes to its constraint
        after, in _look_at); the rows a stop string ends (their text cut, their stop reason set). A token whose
        bytes hold no stop string's last character cannot end a match: its text is added later, with the row's next
        token that may (DecodeRun.catch_up_text), or when the row leaves."""
        run = self.run
        slots, lengths = fast.slots[rows], fast.sample_index[rows] + 1
        with_logprobs = run.has_logprobs[slots]
        if with_logprobs.any():
            run.record_logprobs(slots[with_logprobs], rows[with_logprobs], tokens[with_logprobs], logprobs)
        text = run.has_text[slots]
        mask = run.text_mask[slots]
        deferred = text & (mask >= 0) & ~run.text_held[slots] & (lengths - 1 > run.look_after[slots])
        if deferred.any():
            deferred[deferred] = ~self.text_masks[mask[deferred], tokens[deferred]]
            run.deferred[slots[deferred]] += 1
        looked = text & ~deferred
        hits = []
        for i, slot, length in zip(rows[looked].tolist(), slots[looked].tolist(), lengths[looked].tolist()):
            seq = seqs[i]
            run.catch_up_text(slot, length - 1)
            if (delta := seq.detokenizer.add(first[i])) and _stop_found(
                    seq, delta, length - seq.num_prompt_tokens > seq.params.min_tokens):
                hits.append(i)
            else:
                self._note_text(slot, seq)
        return hits

    def _note_text(self, slot: int, seq: Sequence) -> None:
        """The row's text state in the run: its mask of tokens that may end a stop string (chosen once), and
        whether its detokenizer holds back bytes (then its next token is looked at whatever it is)."""
        run = self.run
        if run.text_mask[slot] == -2:
            run.text_mask[slot] = self._mask_id(seq)
        if run.text_mask[slot] >= 0:
            run.text_held[slot] = bool(seq.detokenizer.pending)

    def _mask_id(self, seq: Sequence) -> int:
        """The row of text_masks for the sequence's stop strings: the tokens whose bytes hold one of their last
        characters (-1: none applies: a tokenizer without byte pieces, a last character beyond ASCII, too many
        masks already)."""
        pieces, stops = getattr(seq.detokenizer, "pieces", None), seq.params.stop
        last = {ord(stop[-1]) if stop else 256 for stop in stops}
        if pieces is None or not last or max(last) > 127:
            return -1
        lasts = bytes(sorted(last))
        key = (id(pieces), lasts)
        if key not in self._mask_ids:
            if len(self._mask_ids) >= MAX_TEXT_MASKS:
                return -1
            mask = np.zeros(self.text_masks.shape[1], np.bool_)  # the model's vocabulary: no text past the table
            n = min(len(pieces), len(mask))
            mask[:n] = [len(piece.translate(None, lasts)) < len(piece) for piece in pieces[:n]]
            self.text_masks = np.concatenate([self.text_masks, mask[None]])
            self._mask_ids[key] = len(self._mask_ids)
        return self._mask_ids[key]

    def _end(self, seq: Sequence, length: int, now: float, ended: list[Sequence]) -> None:
        """Stop the sequence at `length` tokens (dropping the next step's pending token, if it was queued); it joins
        `ended`, whose texts and outputs are made together once the step is read."""
        if self.run is not None:
            self.run.leave(seq)  # its fields written back
        del seq.token_ids[length:]
        seq.num_pending = 0
        seq.metrics.finished_time = now
        seq.metrics.num_generated_tokens = seq.num_output_tokens
        self.release(seq)
        ended.append(seq)

    def _check_stop(self, seq: Sequence, token: int, length: int) -> bool:
        """Decide whether the sequence, `length` tokens long with this token, is done; set its finish and stop
        reasons. Up to min_tokens output tokens, only the length limit ends it (as vLLM: EOS and stop tokens are
        banned from sampling then, stop strings not looked for). A complete structured output ends at the next
        token read (process)."""
        params = seq.params
        stops_allowed = length - seq.num_prompt_tokens > params.min_tokens
        if stops_allowed and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return True
        if stops_allowed and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
            return True
        if seq.detokenizer is not None and _stop_string_hit(seq, token, stops_allowed):
            return True
        if length >= seq.max_len:
            seq.finish_reason = "length"
            return True
        return False

    def _detokenize(self, seqs: list[Sequence]) -> None:
        """The text of the sequences that did not detokenize as they went (no stop strings), in one batch: a step
        where hundreds of requests end decodes them in parallel, without the GIL."""
        todo = [seq for seq in seqs if seq.detokenizer is None and seq.params.detokenize]
        requests = []
        for seq in todo:
            # the EOS or stop token that ended it is not text (the last token of a complete structured output is)
            ended_by_token = seq.finish_reason == "stop" and (isinstance(seq.stop_reason, int) or (
                seq.stop_reason is None and seq.output_token_ids[-1] in self.eos_token_ids))
            text_ids = seq.output_token_ids[:-1] if ended_by_token else seq.output_token_ids
            requests.append((seq.prompt_token_ids, text_ids, seq.params.skip_special_tokens))
        for seq, text in zip(todo, decode_continuations(self.tokenizer, requests)):
            seq.text = text

    def _finish(self, seq: Sequence) -> RequestOutput | None:
        """Record a finished sequence's completion; its request's output once all n are done."""
        group = seq.group
        group.completions[seq.index] = CompletionOutput(
            seq.index, seq.text, seq.output_token_ids, seq.cumulative_logprob, seq.logprobs, seq.finish_reason,
            seq.stop_reason, None if seq.constraint is None else seq.constraint.complete)
        if seq.forks_left:  # it ended before all could fork (no room yet)
            self.pass_on_forks(seq)
        if not group.done:
            return None
        # No cycle left (sequence <-> group): reference counting frees the request once its output is dropped,
        # where a cycle would wait for a full collection (gc_scope.py)
        for done in group.seqs:
            done.group = None
        first = group.seqs[0]
        metrics = first.metrics
        if len(group.seqs) > 1:  # the request's span: from its arrival to its last completion
            all_metrics = [s.metrics for s in group.seqs]
            metrics = RequestMetrics(group.arrival_time,
                                     min(m.first_scheduled_time for m in all_metrics),
                                     min(m.first_token_time for m in all_metrics),
                                     max(m.finished_time for m in all_metrics),
                                     max(m.num_generated_tokens for m in all_metrics))
        if first.prompt_logprobs is not None:  # the same entries whether a prefix-cache hit skipped them or not
            skipped = min(first.params.prompt_logprobs_start, len(first.prompt_logprobs))
            first.prompt_logprobs[:skipped] = [None] * skipped
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, list(group.completions), True,
                             metrics, prompt_logprobs=first.prompt_logprobs,
                             extra={"num_preemptions": sum(s.num_preemptions for s in group.seqs)})


def _append_run(seq: Sequence, index: int, run: list[int]) -> None:
    """The tokens of a run after its first (already at token_ids[index]). The step computed the KV of every
    accepted token but the last (the next step's input); no later step is in flight for the sequence (the engine
    reads a step that may return runs before it schedules the next)."""
    assert seq.num_pending == 0 and index + 1 == len(seq.token_ids), "a later step holds a placeholder"
    seq.token_ids += run[1:]
    seq.num_computed_tokens += len(run) - 1


def _stop_string_hit(seq: Sequence, token: int, look: bool) -> bool:
    """Append the token's text; if `look` and a stop string now appears, cut the text before it (or after it, with
    include_stop_str_in_output) and finish."""
    delta = seq.detokenizer.add(token)
    return bool(delta) and _stop_found(seq, delta, look)


def _stop_found(seq: Sequence, delta: str, look: bool) -> bool:
    """_stop_string_hit() of the token's text, `delta` (not empty)."""
    before = len(seq.text)
    text = seq.text = seq.text + delta
    if not look:
        return False
    stops = seq.params.stop  # a match is new if it ends in delta: it starts at most a stop's length back
    if len(stops) == 1:
        stop = stops[0]
        pos = text.find(stop, max(0, before - len(stop) + 1))
        if pos < 0:
            return False
    else:
        search_from = max(0, before - max(map(len, stops)) + 1)
        hits = [(pos, s) for s in stops if (pos := text.find(s, search_from)) >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
    seq.text = seq.text[:pos + len(stop) if seq.params.include_stop_str_in_output else pos]
    seq.finish_reason, seq.stop_reason = "stop", stop
    return True
