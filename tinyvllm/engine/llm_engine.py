"""The step loop: requests in, scheduled steps through the backend, finished RequestOutputs out."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tinyvllm.backends.base import Backend, Batch, Logprobs, QueuedStep
from tinyvllm.backends.sampler import seed_key
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.logits_processing import PenaltySlots, build_logits_processing, request_processors
from tinyvllm.engine.model_inputs import BatchRows, build_batch
from tinyvllm.engine.scheduler import ScheduledStep, Scheduler
from tinyvllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from tinyvllm.engine.structured_outputs import OutputConstraint, StructuredOutputManager
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import IncrementalDetokenizer, decode_continuations

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModelConfig:
    """What vLLM's `llm_engine.model_config` tells callers (lm-eval reads max_model_len): the model as served."""

    model: str
    max_model_len: int  # the longest sequence served, prompt + output (max_model_len, capped by the KV cache)


@dataclass
class SequenceGroup:
    """A request's n sequences: the first, and those forked from it once its prompt is computed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seed: int  # the first sequence's; the others' derive from it and their index
    arrival_time: float
    completions: list[CompletionOutput | None]
    seqs: list[Sequence]

    @property
    def done(self) -> bool:
        return all(c is not None for c in self.completions)


@dataclass
class InFlightStep:
    """A step submitted to the backend, with what is needed to read its output."""

    step: ScheduledStep
    batch: Batch
    starts: list[int]  # per row: the sequence's computed tokens before this step
    sample_index: list[int]  # per row: where in token_ids the sampled token goes (-1: a prompt chunk, none)
    queued: QueuedStep | None = None  # once submitted


class LLMEngine:
    def __init__(self, model, backend: Backend, engine_config: EngineConfig) -> None:
        assert engine_config.max_model_len is not None, "resolve it first: EngineConfig.for_model"
        self.config = model.config
        self.tokenizer = model.tokenizer
        self.backend = backend
        self.engine_config = engine_config
        self.num_kv_blocks = backend.init_kv_cache()
        self.block_manager = BlockManager(engine_config, self.num_kv_blocks)
        self.scheduler = Scheduler(engine_config, self.block_manager)
        # A sequence can never outgrow the whole cache: that keeps a lone sequence always schedulable.
        self.max_seq_len = min(engine_config.max_model_len, self.num_kv_blocks * engine_config.block_size)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)
        self.model_config = ServedModelConfig(model.source, self.max_seq_len)
        self.rng = np.random.default_rng(engine_config.seed)  # seeds for requests that bring none
        self.penalty_slots = PenaltySlots(engine_config.max_num_seqs)
        self.batch_rows = BatchRows()
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        self._arrivals = 0
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
        metrics = RequestMetrics(arrival_time=time.time())
        text = prompt if isinstance(prompt, str) else None
        try:
            token_ids = self._prompt_token_ids(prompt, prompt_is_templated)
        except ValueError as exc:
            return self._reject(request_id, text, [], metrics, str(exc) or type(exc).__name__)
        most, cap = self.backend.max_logprobs, self.engine_config.max_logprobs
        wanted = max(params.logprobs or 0, params.prompt_logprobs or 0)
        if cap is not None and cap >= 0 and wanted > cap:
            return self._reject(request_id, text, token_ids, metrics,
                                f"{wanted} logprobs asked; max_logprobs is {cap}")
        if most is not None and wanted > most:
            return self._reject(request_id, text, token_ids, metrics, f"{wanted} logprobs asked; the "
                                f"{self.backend.name} backend returns at most {most} per token")
        if wanted > self.config.vocab_size:
            return self._reject(request_id, text, token_ids, metrics,
                                f"{wanted} logprobs asked; the vocabulary has {self.config.vocab_size} tokens")
        if len(token_ids) >= self.max_seq_len:
            cache_tokens = self.num_kv_blocks * self.engine_config.block_size
            return self._reject(request_id, text, token_ids, metrics,
                                f"prompt has {len(token_ids)} tokens; the limit is {self.max_seq_len - 1} "
                                f"(max_model_len {self.engine_config.max_model_len}, KV cache {cache_tokens} tokens, "
                                "one token left to generate)")
        try:
            processors = request_processors(params, self.tokenizer, self.eos_token_ids, self.config.vocab_size)
            # compiled (once per distinct constraint) and checked here
            constraint = (None if params.structured_outputs is None
                          else self.structured_outputs.constraint(params.structured_outputs))
        except ValueError as exc:
            return self._reject(request_id, text, token_ids, metrics, str(exc))
        seed = params.seed if params.seed is not None else int(self.rng.integers(1 << 63))
        group = SequenceGroup(request_id, text, token_ids, seed, metrics.arrival_time, [None] * params.n, [])
        seq = self._new_sequence(group, 0, params, processors, metrics, constraint)
        seq.forks_left = params.n - 1
        self.scheduler.add(seq)
        return None

    def _new_sequence(self, group: SequenceGroup, index: int, params: SamplingParams, processors,
                      metrics: RequestMetrics, constraint: OutputConstraint | None = None) -> Sequence:
        """Completion `index` of the group's request. Its seed: the request's for the first, one derived from it
        (seeded requests stay reproducible) or drawn afresh for the others. Its structured-output constraint
        starts afresh (`constraint`, or a new one)."""
        seed = group.seed if index == 0 else (_derived_seed(params.seed, index) if params.seed is not None
                                               else int(self.rng.integers(1 << 63)))
        seq = Sequence(group.request_id, self._arrivals, group.prompt, group.prompt_token_ids, params, seed,
                       seed_key(seed), metrics)
        self._arrivals += 1
        seq.index, seq.group, seq.processors = index, group, processors
        if params.structured_outputs is not None:
            seq.constraint = constraint or self.structured_outputs.constraint(params.structured_outputs)
        seq.max_len = min(self.max_seq_len, seq.num_prompt_tokens + params.max_tokens)
        # Text is only needed token by token to find stop strings; otherwise it is decoded once, at the end.
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids,
                                                     params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None and index == 0:
            seq.prompt_logprobs = [None]  # the first token has no prefix to be predicted from
        group.seqs.append(seq)
        return seq

    def _fork(self) -> None:
        """Start the next completions of n > 1 requests whose first sequence has its prompt computed: they share its
        prompt's KV blocks (the last partial one copied) and compute only the last prompt token themselves."""
        for parent in list(self.scheduler.running):
            while parent.forks_left and parent.num_computed_tokens >= parent.num_prompt_tokens:
                group = parent.group
                child = self._new_sequence(group, len(group.seqs), parent.params, parent.processors,
                                           RequestMetrics(arrival_time=group.arrival_time))
                if not self.scheduler.fork(parent, child):
                    group.seqs.pop()  # no room this step: try again next step
                    break
                parent.forks_left -= 1

    def _prompt_token_ids(self, prompt: str | list[int], templated: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            token_ids = self.tokenizer.encode_prompt(prompt, templated=templated)
        else:
            token_ids = [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size})")
        if not token_ids:
            raise ValueError("empty prompt")
        return token_ids

    def _reject(self, request_id: str, prompt: str | None, token_ids: list[int], metrics: RequestMetrics,
                error: str) -> str:
        metrics.finished_time = time.time()
        completion = CompletionOutput(0, "", [], finish_reason="error")
        self._rejected.append(RequestOutput(request_id, prompt, token_ids, [completion], True, metrics, error=error))
        return error

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Drop these requests, wherever they are: no output comes back for them."""
        ids = set(request_ids)
        self._rejected = [out for out in self._rejected if out.request_id not in ids]
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request_id in ids:
                self.scheduler.finish(seq)  # a step in flight skips it, as it skips one that stopped
                self.penalty_slots.release(seq)
                self.batch_rows.release(seq)
                seq.forks_left = 0

    def has_unfinished_requests(self) -> bool:
        return (bool(self._rejected) or self.scheduler.has_unfinished() or self._in_flight is not None
                or self._unread is not None)

    # ---- one step --------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One turn of the loop, while the GPU runs the last step's forward: read the tokens of the step before it,
        fill the last step's token masks (constrained rows: their last tokens are known now), schedule and prepare
        the next step, then queue the last step's sampling (if it waited for masks) and the next step back to
        back. Return the requests that finished.

        Running one step ahead hides the host's work (scheduling, input preparation, output processing, masks)
        behind the GPU's. Its cost: a sequence that stops on a sampled token (EOS, stop string) has already been
        given one more step, whose token is dropped; one that reaches its length limit is not (the scheduler knows
        that limit).
        """
        finished, self._rejected = self._rejected, []
        advance: list[tuple[OutputConstraint, int]] = []
        if self._unread is not None:
            finished += self._process(self._unread, advance)
        last = self._in_flight
        deferred = last is not None and last.queued.sample is not None
        # The constraints take their new tokens, then the last step's masks are filled, on a worker thread (the
        # library releases the GIL) while this one schedules and prepares the next step.
        background = (self.structured_outputs.start(advance, *(self._bitmask_rows(last) if deferred else ()))
                      if advance or deferred else None)
        self._fork()
        step = self.scheduler.schedule()
        for seq in step.preempted:
            self.penalty_slots.release(seq)  # its counts are rebuilt when it runs again
        following = self._prepare(step) if step.seqs else None
        if background is not None:
            for _ in self.structured_outputs.finish(background):
                # only if other processors (allowed_token_ids, a -100 bias, bad_words) banned all it allowed
                log.warning("a sampled token broke its sequence's structured_outputs constraint: it ends there")
        if deferred:
            last.queued.sample()
        if following is not None:
            following.queued = self.backend.submit(following.batch)
            self.num_steps += 1
        self._unread, self._in_flight = last, following
        return finished

    def _prepare(self, step: ScheduledStep) -> InFlightStep:
        """The step's batch, with the sequences advanced as if it had run (its sampled tokens pending)."""
        batch = build_batch(step, self.engine_config.block_size, self.batch_rows)
        samples = [seq.num_computed_tokens + n == len(seq.token_ids) for seq, n in zip(step.seqs, step.num_new_tokens)]
        batch.logits_processing = build_logits_processing(step.seqs, samples, self.penalty_slots)
        constrained = [i for i, (seq, sampled) in enumerate(zip(step.seqs, samples)) if sampled and seq.constraint]
        if constrained:
            batch.bitmask_rows = np.full(len(step.seqs), -1, np.int32)
            batch.bitmask_rows[constrained] = np.arange(len(constrained))
        starts, sample_index, now = [], [], time.time()
        for row, (seq, num_new, sampled) in enumerate(zip(step.seqs, step.num_new_tokens, samples)):
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
        return InFlightStep(step, batch, starts, sample_index)

    def _bitmask_rows(self, launched: InFlightStep) -> tuple[np.ndarray, list[tuple[OutputConstraint, int]]]:
        """The launched step's bitmask, and the constraint whose mask goes in each of its rows (a sequence that has
        finished meanwhile gets every token: its row is dropped)."""
        bitmask, rows = launched.queued.bitmask, launched.batch.bitmask_rows
        constrained = []
        for seq, row in zip(launched.step.seqs, rows):
            if row >= 0:
                assert seq.is_finished or seq.num_pending == 1, "all its tokens but this step's are read"
                if seq.is_finished:
                    bitmask[row] = -1
                else:
                    constrained.append((seq.constraint, int(row)))
        return bitmask, constrained

    def _process(self, launched: InFlightStep, advance: list[tuple[OutputConstraint, int]]) -> list[RequestOutput]:
        """Read a step's tokens into its sequences; finish those that stop. The constrained sequences that go on
        leave their tokens in `advance`, for their constraints to take."""
        result = launched.queued.result()
        now = time.time()
        ended: list[Sequence] = []
        step, batch = launched.step, launched.batch
        sampled = result.sampled_token_ids.tolist()
        prompt_logprobs = result.prompt_logprobs
        block_size, finished, check_stop = self.engine_config.block_size, SequenceStatus.FINISHED, self._check_stop
        for i, (seq, start, index) in enumerate(zip(step.seqs, launched.starts, launched.sample_index)):
            if seq.status is finished:
                continue  # it stopped at the previous step: this step's work for it is dropped
            if index >= 0 and seq.constraint is not None and seq.constraint.done:
                # Complete with the token before (it has taken every token up to this one): this one, EOS or
                # whatever its mask allowed once nothing more could follow, is dropped.
                seq.finish_reason = "stop"
                self._end(seq, index, now, ended)
                continue
            if prompt_logprobs and i in prompt_logprobs:
                entries = _logprob_dicts(prompt_logprobs[i], batch.prompt_logprob_targets[i],
                                         seq.params.prompt_logprobs)
                # Entry p + 1 comes from position p; a recompute after preemption repeats what is already known; the
                # positions a prefix-cache hit skipped have none.
                seq.prompt_logprobs.extend([None] * (start + 1 - len(seq.prompt_logprobs)))
                seq.prompt_logprobs.extend(entries[len(seq.prompt_logprobs) - start - 1:])
            if index >= 0:
                token = sampled[i]
                seq.token_ids[index] = token
                seq.num_pending -= 1
            if seq.num_computed_tokens // block_size > seq.num_hashed_blocks:  # a block may have filled up
                self.block_manager.commit_full_blocks(seq)
            if index < 0:
                continue  # a prompt chunk: nothing sampled
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            if seq.logprobs is not None:
                entry = _logprob_dicts(result.logprobs, [token], seq.params.logprobs, row=i)[0]
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry[token]
            if check_stop(seq, token, index + 1):
                if seq.constraint is not None:
                    self.structured_outputs.take(seq.constraint, token)  # for `complete`
                self._end(seq, index + 1, now, ended)
            elif seq.constraint is not None:
                advance.append((seq.constraint, token))
        self._detokenize(ended)
        return [output for seq in ended if (output := self._finish(seq)) is not None]

    def _end(self, seq: Sequence, length: int, now: float, ended: list[Sequence]) -> None:
        """Stop the sequence at `length` tokens (dropping the next step's pending token, if it was queued); it joins
        `ended`, whose texts and outputs are made together once the step is read."""
        del seq.token_ids[length:]
        seq.num_pending = 0
        seq.metrics.finished_time = now
        seq.metrics.num_generated_tokens = seq.num_output_tokens
        self.scheduler.finish(seq)
        self.penalty_slots.release(seq)
        self.batch_rows.release(seq)
        ended.append(seq)

    def _check_stop(self, seq: Sequence, token: int, length: int) -> bool:
        """Decide whether the sequence, `length` tokens long with this token, is done; set its finish and stop
        reasons. Up to min_tokens output tokens, only the length limit ends it (as vLLM: EOS and stop tokens are
        banned from sampling then, stop strings not looked for). A complete structured output ends at the next
        token read (_process)."""
        params = seq.params
        stops_allowed = length - seq.num_prompt_tokens > params.min_tokens
        if stops_allowed and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return True
        if stops_allowed and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
            return True
        if seq.detokenizer is not None and self._stop_string_hit(seq, token, stops_allowed):
            return True
        if length >= seq.max_len:
            seq.finish_reason = "length"
            return True
        return False

    @staticmethod
    def _stop_string_hit(seq: Sequence, token: int, look: bool) -> bool:
        """Append the token's text; if `look` and a stop string now appears, cut the text before it (or after it,
        with include_stop_str_in_output) and finish."""
        before = len(seq.text)
        seq.text += seq.detokenizer.add(token)
        if len(seq.text) == before or not look:
            return False
        search_from = max(0, before - max(len(s) for s in seq.params.stop) + 1)
        hits = [(pos, s) for s in seq.params.stop if (pos := seq.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        seq.text = seq.text[:pos + len(stop) if seq.params.include_stop_str_in_output else pos]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

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
        if seq.forks_left:
            # It ended before all could fork (no room yet): a running sibling holds the same prompt KV and forks the
            # rest; with none left, they start from scratch.
            heir = next((s for s in group.seqs if s.status is SequenceStatus.RUNNING), None)
            if heir is not None:
                heir.forks_left, seq.forks_left = seq.forks_left, 0
            while seq.forks_left:
                self.scheduler.add(self._new_sequence(group, len(group.seqs), seq.params, seq.processors,
                                                      RequestMetrics(arrival_time=group.arrival_time)))
                seq.forks_left -= 1
        if not group.done:
            return None
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


def _logprob_dicts(logprobs: Logprobs, token_ids, k: int, row: int | None = None) -> list[dict[int, float]]:
    """{token: logprob} per position: the actual token's and the top-k (k of this request, the batch may have more)
    that a logits processor or constraint left possible (fewer than k when it forbade the rest)."""
    rows = range(len(token_ids)) if row is None else [row]
    out = []
    for r, token in zip(rows, token_ids):
        entry = {int(t): float(lp) for t, lp in zip(logprobs.top_ids[r, :k], logprobs.top_logprobs[r, :k])
                 if lp > -np.inf}
        entry[int(token)] = float(logprobs.token_logprobs[r])
        out.append(entry)
    return out


def _derived_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a seeded request with n > 1: distinct per index, the same every run."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()) >> 1
