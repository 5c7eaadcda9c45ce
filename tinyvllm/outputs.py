"""What generate() returns: RequestOutput and CompletionOutput (vLLM's shapes) plus latency metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: {token_id: logprob} for the sampled token and the top-`logprobs` tokens.
    logprobs: list[dict[int, float]] | None = None
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
    # One entry per prompt token: None for the first, then {token_id: logprob} (the actual token plus the top ones).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # set when the request failed (finish_reason "error"); the job goes on
    extra: dict = field(default_factory=dict)
