"""SamplingParams: how one request is decoded (vLLM's names and meanings)."""

from __future__ import annotations

import math
import json as json_module
from dataclasses import asdict, dataclass, field, fields, replace

from tinyvllm.config import INT32_MAX

SEED_MAX = 2**64 - 1  # the sampler keys on a seed's 64 bits
# Below TEMPERATURE_MIN, logits / temperature overflows float32 (vLLM's bound too); beyond TEMPERATURE_MAX every token
# is about as likely anyway, and the value must still fit a float32.
TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-2, 1e6

# Fields a row of a job's input may override (validate() checks their values): every field, each means something for
# one request.
OVERRIDABLE_FIELDS = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                      "ignore_eos", "min_tokens", "include_stop_str_in_output", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
                      "logprobs", "prompt_logprobs", "prompt_logprobs_start", "detokenize", "skip_special_tokens",
                      "spaces_between_special_tokens", "structured_outputs")
MAX_N = 256  # completions per prompt
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's StructuredOutputsParams): exactly one of json (a JSON schema, as an object
    or its text), regex, choice (the output is one of these strings), grammar (Lark in llguidance's dialect, or
    GBNF) and json_object (any JSON object). Enforced token by token by llguidance (pip install
    'tinyvllm[structured]')."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens (compact output)
    disable_additional_properties: bool = False  # JSON: objects take only the properties the schema names
    whitespace_pattern: str | None = None  # JSON: the regex whitespace between tokens must match
    # vLLM falls back between grammar libraries; tinyvllm has one, so there is never a fallback to disable.
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of " + ", ".join(STRUCTURED_KINDS)
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema: an object or its text")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false")

    @classmethod
    def from_value(cls, value: object) -> StructuredOutputsParams:
        """From an instance, a dict of its fields, or that dict's JSON text (a Parquet string column)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json_module.loads(value)
            except ValueError:
                raise ValueError("structured_outputs must be an object (or its JSON text)") from None
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object with one of " + ", ".join(STRUCTURED_KINDS))
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The constraint as canonical text: equal constraints share one compiled grammar."""
        return json_module.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


@dataclass
class SamplingParams:
    n: int = 1  # completions of the prompt (its prompt computed once, its KV blocks shared)
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability sums to top_p
    top_k: int = 0  # 0 (or -1) = all tokens
    min_p: float = 0.0  # drop tokens less likely than min_p * p(most likely token)
    seed: int | None = None  # per request: same seed -> same text, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings, removed from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    include_stop_str_in_output: bool = False
    # Logits processors, with vLLM's meanings: presence/frequency penalties count output tokens only, the repetition
    # penalty the prompt's and output's (logit / p where positive, * p where not); logit_bias {token id: bias} is
    # added; allowed_token_ids keeps only those; bad_words are never generated (each word as it tokenizes with and
    # without a leading space).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None  # number of top logprobs returned per generated token
    prompt_logprobs: int | None = None  # number of top logprobs returned per prompt token (besides its own)
    # tinyvllm's: prompt logprobs only for the prompt tokens from this index on (the entries before it are None), so
    # the tokens before it may come from the prefix cache (a few-shot context shared by an item's choices).
    prompt_logprobs_start: int = 0
    detokenize: bool = True  # False: token ids only, the text stays "" (no stop strings then)
    skip_special_tokens: bool = True  # leave special tokens (e.g. <|im_end|>) out of the text
    # Kept for vLLM scripts: it changes only HF's slow tokenizers; tinyvllm's, like the fast ones, add no spaces.
    spaces_between_special_tokens: bool = True
    # The output must match this constraint (JSON schema, regex, choice, grammar); its logprobs are those of the
    # distribution with the tokens it forbids removed.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:  # JSON gives string keys ({"50256": -100}), as OpenAI's API does
            try:
                self.logit_bias = {int(t): v for t, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"invalid logit_bias={self.logit_bias!r}: must map token ids to numbers") from None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"invalid {name}={getattr(self, name)!r:.40}: {why}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
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
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            bad("repetition_penalty", "must be a number in (0, 100]")
        if self.logit_bias is not None and not all(
                t >= 0 and _is_number(v) and -100 <= v <= 100 for t, v in self.logit_bias.items()):
            bad("logit_bias", "must map token ids to biases in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            bad("bad_words", "must be a list of non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= INT32_MAX):
                bad(name, f"must be an integer in [0, {INT32_MAX}] or None (at most the vocabulary's size)")
        if not _is_int(self.prompt_logprobs_start) or not 0 <= self.prompt_logprobs_start <= INT32_MAX:
            bad("prompt_logprobs_start", f"must be an integer in [0, {INT32_MAX}]")
        for name in ("detokenize", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if self.stop and not self.detokenize:
            bad("detokenize", "stop strings need the text: pass detokenize=True or stop_token_ids")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

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
