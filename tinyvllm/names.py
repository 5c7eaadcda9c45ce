"""Which known name a misspelt one was meant to be: the same name up to case, `-`/`_` and camelCase, or one a
typing slip away (a letter left out, added, changed or two swapped; two slips in a long name). A name that is a
known one with words added (`temperature_c`, `prompt_2`) is another name, not a slip.

This module imports nothing of tinyvllm: any layer can use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def normalized(name: str) -> str:
    """The name as written with any case and separators: `maxTokens`, `Max-Tokens`, `max_tokens` are `maxtokens`."""
    return "".join(c for c in name.lower() if c not in "-_ .")


def words(name: str) -> list[str]:
    """The words of a snake_case, kebab-case or camelCase name, lower-cased: `maxTokens` is max, tokens."""
    return [w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+", name)]


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The known name `name` most likely misspells, or None when it is like none of them. A short known name (4
    characters or fewer, once normalized) is matched only up to case and separators: one slip from `seed` or
    `stop` is a different word (`step`) more often than a typo."""
    key = normalized(name)
    best: tuple[int, str] | None = None
    for candidate in sorted(known):
        target = normalized(candidate)
        if target == key:
            return candidate
        slips = 0 if len(target) <= 4 else 1 if len(target) < 12 else 2
        if slips and abs(len(target) - len(key)) <= slips and not _adds_words(name, candidate):
            distance = edit_distance(key, target)
            if distance <= slips and (best is None or distance < best[0]):
                best = (distance, candidate)
    return best[1] if best is not None else None


def edit_distance(a: str, b: str) -> int:
    """Letters inserted, deleted or changed, and neighbours swapped, to make `b` of `a` (optimal string alignment)."""
    before: list[int] | None = None
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if before is not None and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        before, previous = previous, current
    return previous[-1]


def _adds_words(name: str, known: str) -> bool:
    """Whether `name` is `known` with more words after it."""
    mine, theirs = words(name), words(known)
    return len(mine) > len(theirs) and mine[:len(theirs)] == theirs
