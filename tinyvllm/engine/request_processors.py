"""A request's logits processors (allowed_token_ids, logit_bias, bad_words, min_tokens, penalties), resolved to
token ids once, at arrival (logits_processing turns them into each step's arrays)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.sampling_params import SamplingParams


@dataclass
class RequestProcessors:
    """What a request's SamplingParams ask of the logits, resolved to token ids once, at arrival."""

    allowed_ids: np.ndarray | None  # int32, sorted
    bias_ids: np.ndarray  # int32: logit_bias and single-token bad words (-inf)
    bias_values: np.ndarray  # float32
    bad_sequences: list[tuple[int, ...]]  # bad words of several tokens: the last is banned after the others
    min_tokens_ban: np.ndarray  # int32: EOS and stop token ids, banned while fewer than min_tokens are out
    penalties: bool

    @property
    def has_biases(self) -> bool:
        return bool(len(self.bias_ids) or self.bad_sequences or len(self.min_tokens_ban))


def request_processors(params: SamplingParams, tokenizer, eos_token_ids: set[int],
                       vocab_size: int) -> RequestProcessors | None:
    """None when the request asks for no logits processing (the common case costs nothing per step).
    ValueError names a token id outside the vocabulary."""
    if not (params.logit_bias or params.bad_words or params.min_tokens > 0 or params.allowed_token_ids
            or params.has_penalties):
        return None  # what follows would find nothing to do
    bias = dict(params.logit_bias or {})
    bad_sequences = []
    for word in params.bad_words or []:
        # As vLLM: the word as it tokenizes on its own and after a space (mid-sentence).
        for ids in {tuple(tokenizer.encode(word, add_special_tokens=False)),
                    tuple(tokenizer.encode(" " + word, add_special_tokens=False))}:
            if len(ids) == 1:
                bias[ids[0]] = -np.inf
            elif ids:
                bad_sequences.append(ids)
    min_ban = (set() if params.ignore_eos else set(eos_token_ids)) | set(params.stop_token_ids)
    min_ban = sorted(min_ban) if params.min_tokens > 0 else []
    allowed = params.allowed_token_ids
    for name, ids in (("logit_bias", bias), ("allowed_token_ids", allowed or [])):
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"{name} has token id {outside[0]} outside the vocabulary (size {vocab_size})")
    if not (bias or bad_sequences or min_ban or allowed or params.has_penalties):
        return None
    return RequestProcessors(
        allowed_ids=np.unique(np.asarray(allowed, np.int32)) if allowed else None,
        bias_ids=np.asarray(list(bias), np.int32), bias_values=np.asarray(list(bias.values()), np.float32),
        bad_sequences=bad_sequences, min_tokens_ban=np.asarray(min_ban, np.int32), penalties=params.has_penalties)
