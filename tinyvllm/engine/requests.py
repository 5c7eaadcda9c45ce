"""Requests in: validation (a problem of one request becomes its error output), each request's SequenceGroup and
first Sequence, and the forks of its other n - 1 completions."""

from __future__ import annotations

import hashlib
import operator
import time

import numpy as np

from tinyvllm.backends.base import Backend
from tinyvllm.backends.sampler import seed_key
from tinyvllm.config import EngineConfig
from tinyvllm.engine.request_processors import RequestProcessors, request_processors
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from tinyvllm.engine.structured_outputs import OutputConstraint, StructuredOutputManager
from tinyvllm.logprobs import FlatLogprobs
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import IncrementalDetokenizer


FORKS_LEFT = operator.attrgetter("forks_left")


def _token_ids(prompt) -> list[int]:
    """A prompt of token ids as ints: integers (numpy's too) as they are, integral floats (3.0) as their ints.
    ValueError: an id that is neither (1.5, "3"), or a prompt that is no sequence of ids."""
    if _integer_array(prompt):
        return prompt.tolist()  # a job's worker sends its rows' ids so
    if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"a prompt is text or a list of token ids, not {type(prompt).__name__}")
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        prompt = list(prompt)  # an iterator is read once
    try:
        return list(map(operator.index, prompt))  # the common case, at C speed
    except TypeError:
        pass
    ids = []
    for token in prompt:
        if isinstance(token, (float, np.floating)) and float(token).is_integer():
            ids.append(int(token))
        else:
            try:
                ids.append(operator.index(token))
            except TypeError:
                shown = repr(token) if isinstance(token, (str, bytes)) else str(token)
                raise ValueError(f"prompt token id {shown} is not an integer") from None
    return ids


class RequestAdmission:
    """Checks each request, turns an accepted one into its SequenceGroup and first Sequence, and starts the group's
    other completions: forked from the first once its prompt is computed, or, when it ended before all could fork,
    handed to a running sibling or started afresh."""

    def __init__(self, engine_config: EngineConfig, vocab_size: int, tokenizer, eos_token_ids: set[int],
                 backend: Backend, max_seq_len: int, num_kv_blocks: int,
                 structured_outputs: StructuredOutputManager, scheduler: Scheduler) -> None:
        self.engine_config, self.vocab_size, self.tokenizer = engine_config, vocab_size, tokenizer
        self.eos_token_ids = eos_token_ids
        self.backend = backend  # its name and max_logprobs, read at each request
        self.max_seq_len, self.num_kv_blocks = max_seq_len, num_kv_blocks
        self.structured_outputs, self.scheduler = structured_outputs, scheduler
        self.rng = np.random.default_rng(engine_config.seed)  # seeds for requests that bring none
        self.num_arrivals = 0
        self.may_fork = False  # some sequence may have completions left to fork (set where forks_left grows)

    def admit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
              templated: bool = False) -> Sequence | RequestOutput:
        """The request's first sequence (not yet queued), or its error output."""
        metrics = RequestMetrics(arrival_time=time.time())
        text = prompt if isinstance(prompt, str) else None
        try:
            token_ids = self._prompt_token_ids(prompt, templated)
            if params.truncate_prompt_tokens is not None:  # the last tokens; -1: as many as leave max_tokens room
                keep = params.truncate_prompt_tokens
                token_ids = token_ids[-(max(1, self.max_seq_len - (params.max_tokens or 1)) if keep == -1 else keep):]
        except ValueError as exc:
            return _rejected(request_id, text, [], metrics, str(exc) or type(exc).__name__)
        try:
            self._check(params, token_ids)
            processors = request_processors(params, self.tokenizer, self.eos_token_ids, self.vocab_size)
            # compiled (once per distinct constraint) and checked here
            constraint = (None if params.structured_outputs is None
                          else self.structured_outputs.constraint(params.structured_outputs))
        except ValueError as exc:
            return _rejected(request_id, text, token_ids, metrics, str(exc))
        seed = params.seed if params.seed is not None else int(self.rng.integers(1 << 63))
        group = SequenceGroup(request_id, text, token_ids, seed, metrics.arrival_time, [None] * params.n, [])
        seq = self.new_sequence(group, 0, params, processors, metrics, constraint)
        seq.forks_left = params.n - 1
        self.may_fork |= seq.forks_left > 0
        return seq

    def _check(self, params: SamplingParams, token_ids: list[int]) -> None:
        """ValueError: what the backend, the vocabulary or the length limit cannot serve."""
        most, cap = self.backend.max_logprobs, self.engine_config.max_logprobs
        wanted = max(params.logprobs or 0, params.prompt_logprobs or 0)
        if cap is not None and cap >= 0 and wanted > cap:
            raise ValueError(f"{wanted} logprobs asked; max_logprobs is {cap}")
        if most is not None and wanted > most:
            raise ValueError(f"{wanted} logprobs asked; the {self.backend.name} backend returns at most {most} per "
                             "token")
        if wanted > self.vocab_size:
            raise ValueError(f"{wanted} logprobs asked; the vocabulary has {self.vocab_size} tokens")
        if len(token_ids) >= self.max_seq_len:
            cache_tokens = self.num_kv_blocks * self.engine_config.block_size
            raise ValueError(f"prompt has {len(token_ids)} tokens; the limit is {self.max_seq_len - 1} "
                             f"(max_model_len {self.engine_config.max_model_len}, KV cache {cache_tokens} tokens, "
                             "one token left to generate)")

    def _prompt_token_ids(self, prompt: str | list[int], templated: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            token_ids = self.tokenizer.encode_prompt(prompt, templated=templated)
        else:
            token_ids = _token_ids(prompt)
            if _any_outside(prompt, token_ids, self.vocab_size):
                bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
                raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {self.vocab_size})")
        if not token_ids:
            raise ValueError("empty prompt")
        return token_ids

    def new_sequence(self, group: SequenceGroup, index: int, params: SamplingParams,
                     processors: RequestProcessors | None, metrics: RequestMetrics,
                     constraint: OutputConstraint | None = None) -> Sequence:
        """Completion `index` of the group's request. Its seed: the request's for the first, one derived from it
        (seeded requests stay reproducible) or drawn afresh for the others. Its structured-output constraint
        starts afresh (`constraint`, or a new one)."""
        seed = group.seed if index == 0 else (_derived_seed(params.seed, index) if params.seed is not None
                                               else int(self.rng.integers(1 << 63)))
        seq = Sequence(group.request_id, self.num_arrivals, group.prompt, group.prompt_token_ids, params, seed,
                       seed_key(seed), metrics, index=index, group=group, processors=processors)
        self.num_arrivals += 1
        if params.structured_outputs is not None:
            seq.constraint = constraint or self.structured_outputs.constraint(params.structured_outputs)
        seq.max_len = (self.max_seq_len if params.max_tokens is None  # None: up to the context
                       else min(self.max_seq_len, seq.num_prompt_tokens + params.max_tokens))
        # Text is only needed token by token to find stop strings; otherwise it is decoded once, at the end.
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids,
                                                     params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = FlatLogprobs(), 0.0
        if params.prompt_logprobs is not None and index == 0:
            seq.prompt_logprobs = [None]  # the first token has no prefix to be predicted from
        group.seqs.append(seq)
        return seq

    def fork_ready(self) -> None:
        """Start the next completions of n > 1 requests whose first sequence has its prompt computed: they share its
        prompt's KV blocks (the last partial one copied) and compute only the last prompt token themselves."""
        if not self.may_fork:
            return
        parents = list(filter(FORKS_LEFT, self.scheduler.running))
        if not parents and not any(map(FORKS_LEFT, self.scheduler.waiting)):
            self.may_fork = False
        for parent in parents:
            while parent.forks_left and parent.num_computed_tokens >= parent.num_prompt_tokens:
                group = parent.group
                child = self.new_sequence(group, len(group.seqs), parent.params, parent.processors,
                                          RequestMetrics(arrival_time=group.arrival_time))
                if not self.scheduler.fork(parent, child):
                    group.seqs.pop()  # no room this step: try again next step
                    break
                parent.forks_left -= 1

    def pass_on_forks(self, seq: Sequence) -> None:
        """A finished sequence with completions still to fork: a running sibling holds the same prompt KV and forks
        the rest; with none left, they start from scratch."""
        group = seq.group
        heir = next((s for s in group.seqs if s.status is SequenceStatus.RUNNING), None)
        if heir is not None:
            heir.forks_left, seq.forks_left = seq.forks_left, 0
            self.may_fork |= heir.forks_left > 0
        while seq.forks_left:
            self.scheduler.add(self.new_sequence(group, len(group.seqs), seq.params, seq.processors,
                                                 RequestMetrics(arrival_time=group.arrival_time)))
            seq.forks_left -= 1


def _integer_array(prompt) -> bool:
    return isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype.kind in "iu"


def _any_outside(prompt, token_ids: list[int], vocab_size: int) -> bool:
    """Whether an id is outside [0, vocab_size); an integer array's found in one reduction (read as unsigned, a
    negative id is beyond any vocabulary)."""
    if not token_ids:
        return False
    if _integer_array(prompt):
        return int(prompt.view(f"u{prompt.itemsize}").max()) >= vocab_size
    return min(token_ids) < 0 or max(token_ids) >= vocab_size


def _rejected(request_id: str, prompt: str | None, token_ids: list[int], metrics: RequestMetrics,
              error: str) -> RequestOutput:
    metrics.finished_time = time.time()
    completion = CompletionOutput(0, "", [], finish_reason="error")
    return RequestOutput(request_id, prompt, token_ids, [completion], True, metrics, error=error)


def _derived_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a seeded request with n > 1: distinct per index, the same every run."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()) >> 1
