"""The interface between the engine and a backend.

The engine prepares a `Batch` (flat numpy arrays: token ids, positions, slot mapping, block tables, sampling
parameters); a backend runs the model over its paged KV cache and returns a `SamplerOutput` (each sequence's
accepted token ids, one or more, and the logprobs asked for). Backends never see requests or the scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np



@dataclass
class SamplingBatch:
    """Per-sequence sampling parameters, one entry per sequence of the batch."""

    temperature: np.ndarray  # float32 [S]; 0 = greedy
    top_p: np.ndarray  # float32 [S]; 1 = off
    top_k: np.ndarray  # int32 [S]; 0 = off
    min_p: np.ndarray  # float32 [S]; 0 = off
    noise_keys: np.ndarray  # uint32 [S]: hash of (request seed, output index); drives the sampling noise (greedy: 0)
    num_logprobs: int = -1  # top logprobs wanted per sampled token (max over the batch); -1 = none, 0 = its own only
    # int32: the rows that want logprobs when only some do (None: every row or none); a backend may leave the other
    # rows of SamplerOutput.logprobs unset (the cuda backend computes these rows alone)
    logprob_rows: np.ndarray | None = None

    @property
    def all_greedy(self) -> bool:
        return bool(np.all(self.temperature == 0))


@dataclass
class LogitsProcessing:
    """Logits processors of one step (vLLM's allowed_token_ids, logit_bias, bad_words, min_tokens and penalties),
    applied to each row's logits before sampling and before logprobs are taken, in this order:

    1. allowed: row i keeps only allowed_ids[allowed_ptr[i]:allowed_ptr[i+1]] (sorted); an empty range keeps all.
    2. bias: logit += bias_values[j] for j in bias_ptr[i]:bias_ptr[i+1] at token bias_ids[j] (-inf bans it), where
       bias_cond[j] is -1 or equals the row's last input token (the token just fed: a bad word's prefix ends there).
    3. penalties, for rows with penalty_slots[i] >= 0, from the backend's token-count table (slot, token): output
       counts c and a prompt mask: logit -= frequency * c + presence * (c > 0); where c > 0 or the token is in the
       prompt, logit /= repetition if positive, else *= repetition.
    After sampling, the backend adds each sampled token to count_slots[i]'s counts (count_slots[i] = -1: a row that
    samples nothing kept, e.g. a prompt chunk). slot_inits, applied before the step, set a slot's prompt mask to the
    given prompt tokens and its counts to the given output tokens (a sequence that just got the slot).
    The token counts live on the backend so that a token sampled by the step in flight is counted without the host.
    """

    penalty_slots: np.ndarray  # int32 [S]
    count_slots: np.ndarray  # int32 [S]
    presence: np.ndarray  # float32 [S]
    frequency: np.ndarray  # float32 [S]
    repetition: np.ndarray  # float32 [S]
    allowed_ptr: np.ndarray  # int32 [S + 1]
    allowed_ids: np.ndarray  # int32 [A]
    bias_ptr: np.ndarray  # int32 [S + 1]
    bias_ids: np.ndarray  # int32 [B]
    bias_values: np.ndarray  # float32 [B]
    bias_cond: np.ndarray  # int32 [B]
    slot_inits: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)  # (slot, prompt, output)


@dataclass
class Batch:
    """One engine step: the new tokens of S sequences, packed back to back (T tokens in all).

    A sequence's new tokens are the last query_len of its context: a whole prompt, a chunk of one (chunked
    prefill, or after a prefix-cache hit), or the one token sampled last step (decode).

    Sampling: the logits of rows `logits_indices` are sampled, at least one per sequence (today exactly one: its
    last new token; a prompt chunk's is sampled and dropped by the engine). A backend returns for sequence i
    between 1 and 1 + num_lookahead_slots[i] tokens (SamplerOutput.num_sampled). The engine reserved the KV slots
    and the length for them; the KV a step writes covers its query tokens and every accepted token but the last,
    which is the next step's input, as a single sampled token is.
    """

    max_query_len: int  # the most new tokens of any sequence; 1: every sequence decodes one token (graph path)
    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]; position of each token in its sequence
    slot_mapping: np.ndarray  # int32 [T]; cache slot (block * block_size + offset) each token's K/V goes to
    query_start_loc: np.ndarray  # int32 [S + 1]; sequence i's new tokens are token_ids[qsl[i]:qsl[i+1]]
    context_lens: np.ndarray  # int32 [S]; tokens in the cache for sequence i once this step has written its own
    block_tables: np.ndarray  # int32 [S, max_blocks]; padded with 0
    sampling: SamplingBatch
    # Prompt logprobs: {sequence index: the prompt tokens that its first len(targets) new positions predict}.
    prompt_logprob_targets: dict[int, np.ndarray] = field(default_factory=dict)
    num_prompt_logprobs: int = 0  # top logprobs wanted per prompt position (max over the batch)
    # int32 [T] or None: where >= 0, token i is the id sampled in that row by the step submitted just before this
    # one (token_ids[i] is then a placeholder): the engine queues a step before it has read the previous one's.
    token_sources: np.ndarray | None = None
    logits_processing: LogitsProcessing | None = None  # None: no row of the step has a logits processor
    # int32 [P, 2]: (source, destination) KV blocks to copy before the step (a forked sequence's last partial block).
    block_copies: np.ndarray | None = None
    # int32 [S] or None: where >= 0, row i samples under a structured-output constraint whose token bitmask is row
    # bitmask_rows[i] of QueuedStep.bitmask, filled once the step's forward is queued (see Backend.submit).
    bitmask_rows: np.ndarray | None = None
    # int32 [R], R >= S: the token rows whose logits are sampled, in sequence order (None: each sequence's last).
    logits_indices: np.ndarray | None = None
    # int32 [S] or None (none anywhere): tokens beyond one that row i may return this step (a decode that accepts a
    # run of tokens: speculative or jump decoding).
    num_lookahead_slots: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def sampled_rows(self) -> np.ndarray:
        """The token rows whose logits are sampled (logits_indices, or each sequence's last new token)."""
        return self.query_start_loc[1:] - 1 if self.logits_indices is None else self.logits_indices


@dataclass
class Logprobs:
    """Logprobs at some positions: the chosen token's and the top-k tokens'."""

    token_logprobs: np.ndarray  # float32 [N]
    top_ids: np.ndarray  # int32 [N, k]
    top_logprobs: np.ndarray  # float32 [N, k]


PLACEHOLDER_TOKEN_ID = -1  # pads SamplerOutput.sampled_token_ids past a row's accepted tokens


@dataclass
class SamplerOutput:
    """A step's tokens, ragged: row i accepted sampled_token_ids[i, :num_sampled[i]] (at least one), padded with
    PLACEHOLDER_TOKEN_ID to K, the most any row accepted (K = 1 when every row has one token)."""

    sampled_token_ids: np.ndarray  # int32 [S, K]
    num_sampled: np.ndarray  # int32 [S], each 1..K
    # Of the accepted tokens, when sampling.num_logprobs >= 0: one row per accepted token, row i's num_sampled[i]
    # rows after those of rows 0..i-1 (so row i itself when every row has one token).
    logprobs: Logprobs | None = None
    # For each key of batch.prompt_logprob_targets: the logprobs of those targets (and the top tokens) per position.
    prompt_logprobs: dict[int, Logprobs] = field(default_factory=dict)

    @classmethod
    def one_each(cls, token_ids: np.ndarray, logprobs: Logprobs | None = None,
                 prompt_logprobs: dict[int, Logprobs] | None = None) -> SamplerOutput:
        """The output of a step that sampled one token per row: token_ids int32 [S]."""
        return cls(token_ids.reshape(-1, 1), np.ones(len(token_ids), np.int32), logprobs, prompt_logprobs or {})

    @property
    def last_token_ids(self) -> np.ndarray:
        """int32 [S]: each row's last accepted token (the next step's input)."""
        if self.sampled_token_ids.shape[1] == 1:
            return self.sampled_token_ids[:, 0]
        return self.sampled_token_ids[np.arange(len(self.num_sampled)), self.num_sampled - 1]


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask."""
    return (vocab_size + 31) // 32


@dataclass
class QueuedStep:
    """A step submitted to a backend. result() waits for its output.

    A step with bitmask rows has queued only its forward: the caller fills `bitmask` (int32 [C, ceil(V / 32)]; bit
    t % 32 of word t // 32 of row c allows token t for the rows whose bitmask_rows is c) while the forward runs, then
    calls sample(), before submitting the next step.

    done(), where the backend can tell, says without waiting whether the device has finished what is queued of the
    step (None: it cannot tell; the caller assumes it has)."""

    result: Callable[[], SamplerOutput]
    bitmask: np.ndarray | None = None
    sample: Callable[[], None] | None = None
    done: Callable[[], bool] | None = None


class Backend(ABC):
    name: str
    vocab_size: int
    max_logprobs: int | None = None  # most top logprobs per token it can return (None: no limit)
    # Tokens beyond one that it may return for a decoding sequence: the engine reserves that many more KV slots and
    # sets Batch.num_lookahead_slots (0: one token per sequence, the pipeline's fast path).
    num_lookahead_slots: int = 0
    _last_sampled = np.zeros(0, np.int32)  # the default submit(): each row's last token of the previous step

    @abstractmethod
    def init_kv_cache(self) -> int:
        """Allocate the paged KV cache as the EngineConfig given at construction says; return its number of
        blocks."""

    @abstractmethod
    def execute(self, batch: Batch, bitmask: np.ndarray | None = None) -> SamplerOutput:
        """Run the model over the batch (writing its K/V into the cache) and sample each sequence's tokens: one,
        or up to 1 + batch.num_lookahead_slots[i] (rows with bitmask_rows >= 0 among the tokens their bitmask row
        allows)."""

    def submit(self, batch: Batch) -> QueuedStep:
        """Start a step (see QueuedStep). Steps run in submission order, so the host can prepare the next one while
        this one runs. This default runs the step at once, or at sample() when it has bitmask rows."""
        if batch.token_sources is not None:
            rows = batch.token_sources >= 0
            batch.token_ids[rows] = self._last_sampled[batch.token_sources[rows]]
        outputs = []

        def run(bitmask: np.ndarray | None = None) -> None:
            outputs.append(self.execute(batch, bitmask))
            self._last_sampled = outputs[0].last_token_ids

        if batch.bitmask_rows is None:
            run()
            return QueuedStep(lambda: outputs[0])
        bitmask = np.full((int(batch.bitmask_rows.max()) + 1, bitmask_words(self.vocab_size)), -1, np.int32)
        return QueuedStep(lambda: outputs[0], bitmask, lambda: run(bitmask))

    def finish_startup(self) -> None:
        """Block until the start-up work this backend left to the background is done (a benchmark's timed steady
        state begins after it). Nothing here."""

    def describe(self) -> dict:
        """Facts worth logging and storing in job metadata."""
        return {"backend": self.name}

    def close(self) -> None:
        """Give back what the backend holds (device memory, the KV cache) now rather than at garbage collection;
        idempotent, and no step may follow. Nothing here."""


def missing_cuda_kernels(model_config, max_model_len: int | None) -> str | None:
    """What this model (a ModelConfig) needs that the cuda backend has no kernels for, as one line (None: nothing)."""
    missing = model_config.ops_beyond_llama(max_model_len)
    if not missing:
        return None
    return (f"the cuda backend has no kernels yet for this {model_config.architecture} model's "
            f"{'; '.join(missing)}: run it with --backend numpy")


def check_cuda_kernels(model_config, max_model_len: int | None) -> None:
    """ValueError naming what this model needs that the cuda backend has no kernels for."""
    missing = missing_cuda_kernels(model_config, max_model_len)
    if missing:
        raise ValueError(missing)
