"""SamplingParams: how one request is decoded (vLLM's names and meanings)."""

from __future__ import annotations

import json as json_module
import operator
from dataclasses import asdict, dataclass, fields, replace

from tinyvllm.config import INT32_MAX, check_settings, setting, settings

SEED_MAX = 2**64 - 1  # the sampler keys on a seed's 64 bits
# Below TEMPERATURE_MIN, logits / temperature overflows float32 (vLLM's bound too); beyond TEMPERATURE_MAX every token
# is about as likely anyway, and the value must still fit a float32.
TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-2, 1e6

MAX_N = 256  # completions per prompt
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _token_id(key) -> int:
    """A logit_bias key as a token id: an integer, its decimal text (JSON's keys) or an integral float; ValueError or
    TypeError for any other (1.5 is refused, not truncated)."""
    if isinstance(key, str):
        return int(key)
    if isinstance(key, float):
        if not key.is_integer():
            raise ValueError(key)
        return int(key)
    return operator.index(key)


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


def _no_blank_words(words: list[str]) -> str | None:
    return None if all(w.strip() for w in words) else "must be a list of words, not blanks"


def _not_empty(token_ids: list[int]) -> str | None:
    return None if token_ids else "must be a non-empty list of token ids"


@dataclass
class SamplingParams:
    """Each field is declared once, with `setting()`: its type, default, bounds and help here are what checks the
    value (`validate`), the CLI's flags (the defaults of every row of a job), the job file's [sampling] keys and a
    job row's fields (every field is `per_row`). Only the checks across fields are written out, in `validate`.
    Integers end up in int32 arrays and kernel arguments (a seed in 64 bits): they are bounded here, so that no
    value gets as far as the engine and fails there for the whole batch."""

    n: int = setting(1, "completions per prompt (its prompt computed once, its KV blocks shared)", low=1, high=MAX_N,
                     per_row=True)
    # None (the Python API's; a row's null keeps the job's): up to the context, as vLLM's: the engine stops at
    # max_model_len.
    max_tokens: int | None = setting(16, "tokens to generate at most", low=1, high=INT32_MAX, per_row=True)
    temperature: float = setting(1.0, "sampling temperature; 0 = greedy", low=TEMPERATURE_MIN,
                                 high=TEMPERATURE_MAX, also=(0,), per_row=True)
    top_p: float = setting(1.0, "nucleus: keep the smallest set of tokens whose probability sums to top_p",
                           low=0, high=1, low_open=True, per_row=True)
    top_k: int = setting(0, "keep the k most likely tokens; 0 (or -1) = all", low=0, high=INT32_MAX, per_row=True)
    min_p: float = setting(0.0, "drop tokens less likely than min_p x p(most likely token)", low=0, high=1,
                           per_row=True)
    # The engine's --seed is the job's (a row without a seed gets one from it and its row number): no flag here.
    seed: int | None = setting(None, "per request: same seed -> same text, whatever else is in the batch", low=0,
                               high=SEED_MAX, flag=False, per_row=True)
    stop: str | list[str] = setting([], "stop strings, removed from the text (a row's own list "
                                    "replaces the job's)", per_row=True)
    stop_token_ids: list[int] = setting([], "token ids that end the output", low=0,
                                        high=INT32_MAX, per_row=True)
    ignore_eos: bool = setting(False, "generate past EOS, up to max_tokens", per_row=True)
    min_tokens: int = setting(0, "EOS and stop_token_ids cannot end the output before this many tokens", low=0,
                              high=INT32_MAX, per_row=True)
    include_stop_str_in_output: bool = setting(False, "keep the stop string in the text", per_row=True)
    # Logits processors, with vLLM's meanings.
    presence_penalty: float = setting(0.0, "subtracted from the logit of every token the output holds", low=-2,
                                      high=2, per_row=True)
    frequency_penalty: float = setting(0.0, "subtracted per occurrence of a token in the output", low=-2,
                                       high=2, per_row=True)
    repetition_penalty: float = setting(1.0, "tokens of the prompt and output: logit / p where positive, x p where "
                                        "not", low=0, high=100, low_open=True, per_row=True)
    logit_bias: dict[int, float] | None = setting(None, "{token id: bias} added to the logits, e.g. "
                                                  "'{\"42\": -100}'", low=-100, high=100, per_row=True)
    allowed_token_ids: list[int] | None = setting(None, "generate only these token ids", low=0,
                                                  high=INT32_MAX, check=_not_empty, per_row=True)
    bad_words: list[str] | None = setting(None, "words never generated, as each tokenizes with and without a "
                                          "leading space", check=_no_blank_words, per_row=True)
    # The job's --logprobs (and a job file's top-level `logprobs`) sets it for every row: no flag of its own.
    logprobs: int | None = setting(None, "top logprobs returned per generated token", low=0, high=INT32_MAX,
                                   flag=False, per_row=True)
    prompt_logprobs: int | None = setting(None, "top logprobs returned per prompt token (besides its own)", low=0,
                                          high=INT32_MAX, per_row=True)
    # tinyvllm's: the tokens before the index may come from the prefix cache (a few-shot context shared by an item's
    # choices).
    prompt_logprobs_start: int = setting(0, "prompt logprobs only from this prompt token on (the earlier entries "
                                         "None)", low=0, high=INT32_MAX, per_row=True)
    truncate_prompt_tokens: int | None = setting(None, "keep only the prompt's last N tokens (after its chat "
                                                 "template); -1: as many as fit with max_tokens (with max_tokens "
                                                 "unset: one token to generate)", low=-1, high=INT32_MAX,
                                                 per_row=True)
    detokenize: bool = setting(True, "false: token ids only, the text stays empty (no stop strings then)",
                               flag="--detokenize/--no-detokenize", per_row=True)
    skip_special_tokens: bool = setting(True, "leave special tokens (e.g. <|im_end|>) out of the text",
                                        flag="--skip-special-tokens/--keep-special-tokens", per_row=True)
    # Kept for vLLM scripts: it changes only HF's slow tokenizers; tinyvllm's, like the fast ones, add no spaces.
    spaces_between_special_tokens: bool = setting(True, "no effect (vLLM's; tinyvllm's tokenizers add no spaces)",
                                                  flag=False, per_row=True)
    # Its logprobs are those of the distribution with the tokens it forbids removed.
    structured_outputs: StructuredOutputsParams | None = setting(
        None, "a constraint every output must match, vLLM's fields: '{\"json\": {schema}}', regex, choice, "
        "grammar, json_object (pip install 'tinyvllm[structured]')", own_type=True, per_row=True)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple) or self.stop is None:
            self.stop = list(self.stop or [])
        if isinstance(self.stop_token_ids, tuple) or self.stop_token_ids is None:
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:  # JSON gives string keys ({"50256": -100}), as OpenAI's API does
            try:
                self.logit_bias = {_token_id(t): v for t, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"invalid logit_bias={self.logit_bias!r:.40}: must map token ids to numbers") \
                    from None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field: each against its declaration, then across fields."""
        check_settings(self)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"invalid min_tokens={self.min_tokens}: must be <= max_tokens ({self.max_tokens})")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("invalid truncate_prompt_tokens=0: must be >= 1, or -1 (the length limit)")
        if self.stop and not self.detokenize:
            raise ValueError("invalid detokenize=False: stop strings need the text: pass detokenize=True or "
                             "stop_token_ids")

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



# Fields a row of a job's input may override (every field: each means something for one request).
OVERRIDABLE_FIELDS = tuple(s.name for s in settings(SamplingParams) if s.meta["per_row"])
