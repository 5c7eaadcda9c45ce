"""A request's state as it moves through the engine: its n sequences (SequenceGroup), each a Sequence."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tinyvllm.outputs import CompletionOutput, RequestMetrics
from tinyvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tinyvllm.engine.request_processors import RequestProcessors
    from tinyvllm.engine.structured_outputs import OutputConstraint
    from tinyvllm.logprobs import FlatLogprobs
    from tinyvllm.tokenizer import IncrementalDetokenizer


PENDING_TOKEN = -1  # stands in for a token that a step still in flight on the backend is sampling


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One completion of a request. Slotted, so a field not declared here fails loudly; equal only to itself."""

    request_id: str
    arrival_index: int  # order of arrival; preemption picks the latest
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or one drawn for it at arrival
    sampling_key: int  # 32-bit hash of the seed; with the output index it keys each draw's noise
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)  # prompt then output
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    # leading blocks given back because no later query's window reaches them (a model whose every layer slides);
    # their block-table entries hold FREED_BLOCK (block_manager)
    num_freed_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes of the leading full blocks so far
    num_preemptions: int = 0
    # The engine queues step N+1 before it reads step N's tokens: the first token each step in flight is sampling
    # sits at the end of token_ids as PENDING_TOKEN (num_pending of them; the step's further accepted tokens are
    # appended when it is read), and sample_row says which row of the last such step's batch samples it.
    num_pending: int = 0
    sample_row: int = -1
    max_len: int = 1 << 62  # prompt + max_tokens, capped by the model and cache: reaching it finishes the sequence
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    logprobs: FlatLogprobs | None = None  # one {token_id: logprob} per output token
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    detokenizer: IncrementalDetokenizer | None = None  # text token by token, only to find stop strings
    processors: RequestProcessors | None = None  # None: no logits processing
    constraint: OutputConstraint | None = None  # its structured output's state, or None
    penalty_slot: int = -1  # its slot in the backend's token-count table while it runs with penalties
    table_row: int = -1  # its row in the engine's BatchRows (model_inputs), once it has run
    run_slot: int = -1  # its slot in the engine's DecodeRun (persistent_batch) while attached, else -1
    index: int = 0  # which of its request's n completions this is
    forks_left: int = 0  # completions still to fork from this one (the first of n) once its prompt is computed
    group: SequenceGroup | None = None  # its request's n sequences
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class SequenceGroup:
    """A request's n sequences: the first, and those forked from it once its prompt is computed (engine/requests)."""

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
