"""What generate() returns: RequestOutput and CompletionOutput (vLLM's shapes) plus latency metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's logprob at one position, as vLLM's `Logprob`.

    rank: the token's 1-based rank among the vocabulary at that position (1 = the most likely); None for a sampled
    or prompt token outside the top `logprobs` asked (the engine ranks only the top ones). decoded_token: the
    token's text, decoded on its own with special tokens kept (vLLM's); None when the request has detokenize=False.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: {token_id: Logprob} for the sampled token and the top-`logprobs` tokens. LLM's
    # outputs hold Logprob objects; the engine's own (LLMEngine.step(), what the job layer reads) hold plain floats
    # in a FlatLogprobs (tinyvllm/logprobs.py: a list to its readers, kept as arrays until read).
    logprobs: list[dict[int, Logprob]] | Sequence[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # With a structured_outputs constraint: whether the output is complete (matches it in full); False when it ran
    # out of max_tokens or was cut by a stop string first. None without a constraint.
    structured_output_complete: bool | None = None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time(), seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @staticmethod
    def _ms(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else (end - start) * 1000.0

    @property
    def queue_ms(self) -> float | None:
        return self._ms(self.arrival_time, self.first_scheduled_time)

    @property
    def ttft_ms(self) -> float | None:
        return self._ms(self.arrival_time, self.first_token_time)

    @property
    def e2e_ms(self) -> float | None:
        return self._ms(self.arrival_time, self.finished_time)

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first."""
        if self.num_generated_tokens < 2:
            return None
        span = self._ms(self.first_token_time, self.finished_time)
        return None if span is None else span / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # One entry per prompt token: None for the first, then {token_id: Logprob} (the actual token plus the top ones;
    # plain floats in the engine's own outputs, as `CompletionOutput.logprobs`).
    prompt_logprobs: list[dict[int, Logprob] | None] | list[dict[int, float] | None] | None = None
    error: str | None = None  # set when the request failed (finish_reason "error"); the job goes on
    extra: dict = field(default_factory=dict)


def logprob_objects(entries: list[dict[int, float] | None], token_ids: list[int], k: int,
                    decoded: dict[int, str] | None) -> list[dict[int, Logprob] | None]:
    """The engine's {token_id: logprob} entries as {token_id: Logprob}. Entry i holds the top-k tokens (in the
    engine's order: most likely first) and token_ids[i], appended after them when it is not one of them;
    `decoded` maps every id to its text (None: no text)."""
    out: list[dict[int, Logprob] | None] = []
    for i, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        ids = list(entry)
        # More entries than k: the last is token i, outside the top k, with no rank known.
        ranked = len(ids) if len(ids) <= k or i >= len(token_ids) or ids[-1] != token_ids[i] else len(ids) - 1
        out.append({t: Logprob(entry[t], rank + 1 if rank < ranked else None,
                               None if decoded is None else decoded[t])
                    for rank, t in enumerate(ids)})
    return out
