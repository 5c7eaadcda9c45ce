"""SamplingParams: how one request is decoded (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

# Fields a row of a job's input may override, with the type each must have.
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
    n: int = 1  # completions per request: tinyvllm returns one (send the prompt n times, with different seeds)
    detokenize: bool = True  # False: token ids only, the text stays "" (no stop strings then)
    skip_special_tokens: bool = True  # leave special tokens (e.g. <|im_end|>) out of the text
    # Kept for vLLM scripts: it changes only HF's slow tokenizers; tinyvllm's, like the fast ones, add no spaces.
    spaces_between_special_tokens: bool = True

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
            raise ValueError(f"invalid {name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 or -1 = no limit)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                bad(name, "must be an integer >= 0 or None")
        if self.n != 1:
            bad("n", "tinyvllm returns one completion per request; send the prompt n times (with different seeds)")
        for name in ("detokenize", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if self.stop and not self.detokenize:
            bad("detokenize", "stop strings need the text: pass detokenize=True or stop_token_ids")

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
