"""Prompt types, as vLLM names them: a plain dict with the text or the token ids of one prompt."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
