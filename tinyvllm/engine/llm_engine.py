"""The step pipeline: requests in (RequestAdmission), scheduled steps through the backend, their tokens read
(OutputProcessor), finished RequestOutputs out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tinyvllm.backends.base import Backend
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.logits_processing import PenaltySlots, build_logits_processing
from tinyvllm.engine.model_inputs import BatchRows, build_batch
from tinyvllm.engine.output_processor import InFlightStep, OutputProcessor
from tinyvllm.engine.persistent_batch import DecodeRun
from tinyvllm.engine.requests import RequestAdmission
from tinyvllm.engine.scheduler import ScheduledStep, Scheduler
from tinyvllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from tinyvllm.engine.structured_outputs import OutputConstraint, StructuredOutputManager
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

log = logging.getLogger(__name__)

FREE_OUTSIDE_WINDOW = True  # tests switch it off to compare a sliding-window model with every block kept


def kv_window(config, max_model_len: int) -> int | None:
    """How far back any layer's queries read keys, where every layer slides over a window shorter than
    max_model_len (the largest window); None otherwise: any block may be read again (Gemma's global layers)."""
    windows = config.layer_windows
    if not FREE_OUTSIDE_WINDOW or None in windows or max(windows) >= max_model_len:
        return None
    return max(windows)


@dataclass(frozen=True)
class ServedModelConfig:
    """What vLLM's `llm_engine.model_config` tells callers (lm-eval reads max_model_len): the model as served."""

    model: str
    max_model_len: int  # the longest sequence served, prompt + output (max_model_len, capped by the KV cache)


class LLMEngine:
    """Runs the steps: each turn reads the step before last, schedules and prepares the next, and queues it."""

    def __init__(self, model, backend: Backend, engine_config: EngineConfig) -> None:
        assert engine_config.max_model_len is not None, "resolve it first: EngineConfig.for_model"
        self.config = model.config
        self.tokenizer = model.tokenizer
        self.backend = backend
        self.engine_config = engine_config
        self.num_kv_blocks = backend.init_kv_cache()
        window = kv_window(self.config, engine_config.max_model_len)
        self.block_manager = BlockManager(engine_config, self.num_kv_blocks, window)
        self.scheduler = Scheduler(engine_config, self.block_manager, backend.num_lookahead_slots)
        # A sequence never needs more blocks at once than the whole cache: a lone sequence is always schedulable.
        self.max_seq_len = self.block_manager.longest_sequence(engine_config.max_model_len,
                                                               engine_config.enable_chunked_prefill)
        if window is not None:
            log.info("every layer slides over %d tokens: a decoding sequence holds at most %d of the %d KV blocks "
                     "(those behind its window are freed); sequences up to %d tokens", window,
                     self.block_manager.max_blocks_per_sequence(1), self.num_kv_blocks, self.max_seq_len)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)
        self.model_config = ServedModelConfig(model.source, self.max_seq_len)
        self.penalty_slots = PenaltySlots(engine_config.max_num_seqs)
        self.batch_rows = BatchRows()
        # Decodes in persistent arrays, for a backend that returns one token per row and a budget for every decode
        # (and blocks that only grow: none freed behind a window).
        self.run = (DecodeRun(self.block_manager, self.batch_rows, self.config.vocab_size, self.eos_token_ids)
                    if not backend.num_lookahead_slots and window is None and engine_config.max_num_batched_tokens
                    >= engine_config.max_num_seqs else None)
        self.scheduler.run = self.run
        if self.run is not None:
            self.block_manager.before_evict = self.run.flush_commits
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        self.requests = RequestAdmission(engine_config, self.config.vocab_size, self.tokenizer, self.eos_token_ids,
                                         backend, self.max_seq_len, self.num_kv_blocks,
                                         self.structured_outputs, self.scheduler)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.block_manager,
                                                self.structured_outputs, self._release, self.requests.pass_on_forks,
                                                self.run)
        self._rejected: list[RequestOutput] = []
        # Steps queued on the backend whose tokens are not read yet: the last one (whose sampling may still wait for
        # its token masks), and the one before it.
        self._in_flight: InFlightStep | None = None
        self._unread: InFlightStep | None = None
        self.num_steps = 0

    # ---- requests in -----------------------------------------------------------------------------------------------

    def get_tokenizer(self):
        """The tokenizer, as vLLM's LLMEngine.get_tokenizer()."""
        return self.tokenizer

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prompt_is_templated: bool = False) -> str | None:
        """Queue a request. Problems of this request alone come back from step() as an error output; the reason
        is also returned (None: accepted)."""
        admitted = self.requests.admit(request_id, prompt, params, prompt_is_templated)
        if isinstance(admitted, RequestOutput):
            self._rejected.append(admitted)
            return admitted.error
        self.scheduler.add(admitted)
        return None

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Drop these requests, wherever they are: no output comes back for them."""
        ids = set(request_ids)
        self._rejected = [out for out in self._rejected if out.request_id not in ids]
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request_id in ids:
                self._release(seq)  # a step in flight skips it, as it skips one that stopped
                seq.forks_left = 0

    def has_unfinished_requests(self) -> bool:
        return (bool(self._rejected) or self.scheduler.has_unfinished() or self._in_flight is not None
                or self._unread is not None)

    def get_num_waiting_requests(self) -> int:
        """Sequences queued and not yet scheduled (preempted ones included)."""
        return len(self.scheduler.waiting)

    def device_busy(self) -> bool:
        """Whether the device is still running the step queued last, as far as the backend can tell: host work done
        before the next step() (admitting requests) then delays nothing. False once it has finished (the device
        waits for the next step()), with no step queued, or where the backend cannot tell."""
        queued = None if self._in_flight is None else self._in_flight.queued
        return queued is not None and queued.done is not None and not queued.done()

    def _release(self, seq: Sequence) -> None:
        """Take a finished (or aborted) sequence out: its blocks, penalty slot and batch row."""
        if self.run is not None:
            self.run.leave(seq)
        self.scheduler.finish(seq)
        self.penalty_slots.release(seq)
        self.batch_rows.release(seq)

    # ---- one step --------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One turn of the loop, while the GPU runs the last step's forward: read the tokens of the step before it,
        fill the last step's token masks (constrained rows: their last tokens are known now), schedule and prepare
        the next step, then queue the last step's sampling (if it waited for masks) and the next step back to
        back. Return the requests that finished.

        Running one step ahead hides the host's work (scheduling, input preparation, output processing, masks)
        behind the GPU's. Its cost: a sequence that stops on a sampled token (EOS, stop string) has already been
        given one more step, whose token is dropped; one that reaches its length limit is not (the scheduler knows
        that limit). A step that may return a run of tokens per sequence is read before the next is scheduled: how
        many each sequence accepts decides where the next step's tokens go.
        """
        finished, self._rejected = self._rejected, []
        advance: list[tuple[OutputConstraint, int]] = []
        if self._unread is not None:
            finished += self._process(self._unread, advance)
        last = self._in_flight
        if last is not None and last.may_return_runs:
            finished += self._process_now(last, advance)
            last = None
        deferred = last is not None and last.queued.sample is not None
        # The constraints take their new tokens, then the last step's masks are filled, on a worker thread (the
        # library releases the GIL) while this one schedules and prepares the next step.
        background = (self.structured_outputs.start(advance, *(self._bitmask_rows(last) if deferred else ()))
                      if advance or deferred else None)
        self.requests.fork_ready()
        step = self.scheduler.schedule()
        for seq in step.preempted:
            self.penalty_slots.release(seq)  # its counts are rebuilt when it runs again
        following = self._prepare(step) if step.seqs else None
        if background is not None:
            self._warn_broken(self.structured_outputs.finish(background))
        if deferred:
            last.queued.sample()
        if following is not None:
            following.queued = self.backend.submit(following.batch)
            self.num_steps += 1
        self._unread, self._in_flight = last, following
        return finished

    def _prepare(self, step: ScheduledStep) -> InFlightStep:
        """The step's batch, with the sequences advanced as if it had run (the first token each samples pending:
        a placeholder in token_ids). The run's rows (the first ones) advance in its arrays."""
        batch = build_batch(step, self.engine_config.block_size, self.batch_rows, self.run)
        fast = step.fast
        num_fast = 0 if fast is None else len(fast.slots)
        seqs, num_new_tokens = step.seqs[num_fast:], step.num_new_tokens[num_fast:]
        samples = [seq.num_computed_tokens + n == len(seq.token_ids) for seq, n in zip(seqs, num_new_tokens)]
        if num_fast and not seqs:
            batch.logits_processing = self.run.logits_processing(fast, self._run_processing)
        else:  # the run's rows sample, and read only their live fields here
            batch.logits_processing = build_logits_processing(step.seqs, [True] * num_fast + samples,
                                                              self.penalty_slots)
        constrained = [num_fast + i for i, (seq, sampled) in enumerate(zip(seqs, samples))
                       if sampled and seq.constraint]
        if num_fast and self.run.constrained.any():  # the run's rows all sample
            constrained = np.flatnonzero(self.run.constrained[fast.slots]).tolist() + constrained
        if constrained:
            batch.bitmask_rows = np.full(len(step.seqs), -1, np.int32)
            batch.bitmask_rows[constrained] = np.arange(len(constrained))
        if num_fast:
            self.run.advance(fast)
        starts, sample_index, now = [], [], time.time()
        for row, (seq, num_new, sampled) in enumerate(zip(seqs, num_new_tokens, samples), num_fast):
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            starts.append(seq.num_computed_tokens)
            seq.num_computed_tokens += num_new
            if not sampled:
                sample_index.append(-1)  # a prompt chunk: no token is sampled until the whole prompt is cached
                continue
            sample_index.append(len(seq.token_ids))
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending += 1
            seq.sample_row = row
        return InFlightStep(step, batch, starts, sample_index, fast=fast)

    def _run_processing(self, seqs: list[Sequence]):
        return build_logits_processing(seqs, [True] * len(seqs), self.penalty_slots)

    def _process(self, launched: InFlightStep, advance: list[tuple[OutputConstraint, int]]) -> list[RequestOutput]:
        """Wait for a step's output and read it (OutputProcessor.process)."""
        return self.output_processor.process(launched, launched.queued.result(), advance)

    def _process_now(self, launched: InFlightStep,
                     advance: list[tuple[OutputConstraint, int]]) -> list[RequestOutput]:
        """Read the last step submitted, its masks filled and sampling queued here if it waited for them (the
        constraints take the tokens in `advance` first)."""
        if launched.queued.sample is not None:
            work = self.structured_outputs.start(advance, *self._bitmask_rows(launched))
            self._warn_broken(self.structured_outputs.finish(work))
            advance.clear()
            launched.queued.sample()
        return self._process(launched, advance)

    @staticmethod
    def _warn_broken(broken: list[OutputConstraint]) -> None:
        for _ in broken:
            # only if other processors (allowed_token_ids, a -100 bias, bad_words) banned all it allowed
            log.warning("a sampled token broke its sequence's structured_outputs constraint: it ends there")

    def _bitmask_rows(self, launched: InFlightStep) -> tuple[np.ndarray, list[tuple[OutputConstraint, int]]]:
        """The launched step's bitmask, and the constraint whose mask goes in each of its rows (a sequence that has
        finished meanwhile gets every token: its row is dropped)."""
        bitmask, rows = launched.queued.bitmask, launched.batch.bitmask_rows
        where = np.flatnonzero(rows >= 0)
        run_pending = self.run.pending.tolist() if self.run is not None and len(where) else []
        seqs, constrained = launched.step.seqs, []
        for seq, row in zip([seqs[i] for i in where.tolist()], rows[where].tolist()):
            finished = seq.status is SequenceStatus.FINISHED
            assert finished or (seq.num_pending if seq.run_slot < 0 else run_pending[seq.run_slot]) == 1, \
                "all its tokens but this step's are read"
            if finished:
                bitmask[row] = -1
            else:
                constrained.append((seq.constraint, row))
        return bitmask, constrained
