"""SamplingParams: how one request is decoded (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from tinyvllm.config import INT32_MAX

SEED_MAX = 2**64 - 1  # the sampler keys on a seed's 64 bits
# Below TEMPERATURE_MIN, logits / temperature overflows float32 (vLLM's bound too); beyond TEMPERATURE_MAX every token
# is about as likely anyway, and the value must still fit a float32.
TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-2, 1e6

# Fields a row of a job's input may override.
OVERRIDABLE_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability sums to top_p
    top_k: int = 0  # 0 (or -1) = all tokens
    min_p: float = 0.0  # drop tokens less likely than min_p * p(most likely token)
    seed: int | None = None  # per request: same seed -> same text, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings, removed from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs returned per generated token
    prompt_logprobs: int | None = None  # number of top logprobs returned per prompt token (besides its own)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"invalid {name}={getattr(self, name)!r:.40}: {why}")

        # Integers end up in int32 arrays and kernel arguments (a seed in 64 bits): bounded here, so that no value
        # gets as far as the engine and fails there for the whole batch.
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            bad("max_tokens", f"must be an integer in [1, {INT32_MAX}]")
        if not _is_number(self.temperature) or not (
                self.temperature == 0 or TEMPERATURE_MIN <= self.temperature <= TEMPERATURE_MAX):
            bad("temperature", f"must be 0 (greedy) or in [{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}]")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            bad("top_k", f"must be an integer in [0, {INT32_MAX}] (0 or -1 = no limit)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= SEED_MAX):
            bad("seed", "must be an integer in [0, 2**64 - 1] or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= INT32_MAX):
                bad(name, f"must be an integer in [0, {INT32_MAX}] or None (at most the vocabulary's size)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_overrides(self, overrides: dict) -> "SamplingParams":
        """A copy with the given fields replaced (a job row's overrides); unknown keys raise ValueError."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        return replace(self, **overrides)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)
