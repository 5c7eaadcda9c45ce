"""Sampled-token logprobs as the engine keeps them: {token_id: logprob} entries, one per generated token, and
FlatLogprobs, the list of them that a completion holds.

The engine reads the decoding rows' logprobs a whole step at a time (engine/persistent_batch.py buffers them per
row as arrays); building a dict per token there cost more than the rest of a step's output processing. So a
completion's entries are kept as blocks of those arrays and become dicts when something reads them (vLLM keeps
its own FlatLogprobs for the same reason: millions of small dicts). To a reader FlatLogprobs is a list of dicts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, MutableSequence
from typing import Protocol

import numpy as np


class LogprobRows(Protocol):
    """Logprobs at some positions (backends.base.Logprobs): the chosen token's, and the top-k tokens' ids and
    logprobs (most likely first)."""

    token_logprobs: np.ndarray  # float32 [N]
    top_ids: np.ndarray  # int32 [N, k]
    top_logprobs: np.ndarray  # float32 [N, k]


class LogprobBlock:
    """n positions' arrays: as LogprobRows, with the tokens sampled there and the request's k."""

    __slots__ = ("token_logprobs", "top_ids", "top_logprobs", "token_ids", "k")

    def __init__(self, token_ids: np.ndarray, token_logprobs: np.ndarray, top_ids: np.ndarray,
                 top_logprobs: np.ndarray, k: int) -> None:
        self.token_ids, self.token_logprobs, self.top_ids, self.top_logprobs, self.k = (
            token_ids, token_logprobs, top_ids, top_logprobs, k)

    def entries(self) -> list[dict[int, float]]:
        n = len(self.token_ids)
        return logprob_entries(self, list(range(n)), self.token_ids.tolist(), [self.k] * n)


class FlatLogprobs(MutableSequence):
    """A completion's logprob entries: a list of {token_id: logprob} to its readers, held as the dicts made so far
    followed by what was added since, blocks of arrays (add_block) and dicts appended one by one, in order; the
    blocks become dicts when something reads the list."""

    def __init__(self, entries: Iterable[dict[int, float]] = ()) -> None:
        self._entries: list[dict[int, float]] = list(entries)
        self._added: list[LogprobBlock | list[dict[int, float]]] = []
        self._num_added = 0

    def add_block(self, token_ids: np.ndarray, token_logprobs: np.ndarray, top_ids: np.ndarray,
                  top_logprobs: np.ndarray, k: int) -> None:
        """Append n entries from arrays (the caller's copies, not to be changed after): the sampled tokens [n],
        their logprobs [n], the top ids and logprobs [n, >= k], as logprob_entries reads them with this k."""
        self._added.append(LogprobBlock(token_ids, token_logprobs, top_ids, top_logprobs, k))
        self._num_added += len(token_ids)

    def append(self, value: dict[int, float]) -> None:
        if not self._added:
            self._entries.append(value)
            return
        if not isinstance(self._added[-1], list):
            self._added.append([])
        self._added[-1].append(value)
        self._num_added += 1

    def _settled(self) -> list[dict[int, float]]:
        """The entries, every block made into dicts."""
        if self._added:
            for part in self._added:
                self._entries += part if isinstance(part, list) else part.entries()
            self._added, self._num_added = [], 0
        return self._entries

    def parts(self) -> Iterator[list[dict[int, float]] | LogprobBlock]:
        """The entries in order as they are held, lists of dicts and blocks of arrays, none made into dicts: for a
        reader that takes the arrays as they come (the job writer's columns)."""
        if self._entries:
            yield self._entries
        yield from self._added

    def __len__(self) -> int:
        return len(self._entries) + self._num_added

    def __getitem__(self, index):
        return self._settled()[index]

    def __setitem__(self, index, value) -> None:
        self._settled()[index] = value

    def __delitem__(self, index) -> None:
        del self._settled()[index]

    def insert(self, index: int, value: dict[int, float]) -> None:
        self._settled().insert(index, value)

    def __iter__(self) -> Iterator[dict[int, float]]:
        return iter(self._settled())

    def __eq__(self, other) -> bool:
        if isinstance(other, FlatLogprobs):
            other = other._settled()
        return self._settled() == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # mutable, as a list

    def __repr__(self) -> str:
        return f"FlatLogprobs({self._settled()!r})"


def logprob_dicts(logprobs: LogprobRows, token_ids, k: int, first_row: int = 0) -> list[dict[int, float]]:
    """{token: logprob} per token, from rows first_row.. of `logprobs`: the actual token's and the top-k (k of this
    request, the batch may have more) that a logits processor or constraint left possible (fewer than k when it
    forbade the rest)."""
    n = len(token_ids)
    return logprob_entries(logprobs, list(range(first_row, first_row + n)), np.asarray(token_ids).tolist(), [k] * n)


def logprob_entries(logprobs: LogprobRows, rows: list[int], token_ids: list[int],
                    ks: list[int]) -> list[dict[int, float]]:
    """{token: logprob} of one token at each of `rows` (ks[i] top logprobs for row i; see logprob_dicts), from one
    copy of the arrays (take: about a quarter of fancy indexing's time on a few hundred rows)."""
    if not rows:
        return []
    k, where = max(ks), np.asarray(rows)
    top_ids = logprobs.top_ids.take(where, 0)[:, :k]
    top_array = logprobs.top_logprobs.take(where, 0)[:, :k]
    own = logprobs.token_logprobs.take(where).tolist()
    if min(ks) == k and (top_array > -np.inf).all():  # each row's k entries, none forbidden (nor NaN)
        return _full_entries(k, top_ids, top_array, token_ids, own)
    out = []
    for ids, values, n, token, lp in zip(top_ids.tolist(), top_array.tolist(), ks, token_ids, own):
        pairs = zip(ids, values) if n == k else zip(ids[:n], values[:n])
        entry = {t: v for t, v in pairs if v > -math.inf}
        entry[token] = lp
        out.append(entry)
    return out


def _full_entries(k: int, top_ids: np.ndarray, top: np.ndarray, token_ids: list[int],
                  own: list[float]) -> list[dict[int, float]]:
    """The entries of rows with all k top logprobs ([rows, k] arrays), the token's last (dict literals from the
    columns for the usual small k: no list per row)."""
    if k == 0:
        return [{token: lp} for token, lp in zip(token_ids, own)]
    if k == 1:
        return [{t: v, token: lp}
                for t, v, token, lp in zip(top_ids[:, 0].tolist(), top[:, 0].tolist(), token_ids, own)]
    if k == 2:
        (t0, t1), (v0, v1) = top_ids.T.tolist(), top.T.tolist()
        return [{a: x, b: y, token: lp} for a, b, x, y, token, lp in zip(t0, t1, v0, v1, token_ids, own)]
    out = []
    for ids, values, token, lp in zip(top_ids.tolist(), top.tolist(), token_ids, own):
        entry = dict(zip(ids, values))
        entry[token] = lp
        out.append(entry)
    return out
