"""The sampled-token logprobs of the DecodeRun's rows, buffered per slot as arrays: a step writes every row's
in one assignment per array, and a slot's buffered positions move to its sequence's FlatLogprobs as one block when
LOGPROB_CHUNK of them have gathered or when the run writes the sequence's fields back. No dict is made per token
(tinyvllm/logprobs.py)."""

from __future__ import annotations

import numpy as np

from tinyvllm.logprobs import LogprobRows

LOGPROB_CHUNK = 128  # positions a slot buffers before they move to its sequence


class LogprobBuffer:
    """Per slot: how many positions are buffered, the request's k, and those positions' sampled token, its logprob
    and the top-k ids and logprobs (as many columns as the largest k seen)."""

    def __init__(self) -> None:
        self.count = np.zeros(0, np.int64)
        self.k = np.zeros(0, np.int64)
        self.token_ids = np.zeros((0, LOGPROB_CHUNK), np.int32)
        self.token_logprobs = np.zeros((0, LOGPROB_CHUNK), np.float32)
        self.top_ids = np.zeros((0, LOGPROB_CHUNK, 0), np.int32)
        self.top_logprobs = np.zeros((0, LOGPROB_CHUNK, 0), np.float32)

    def start(self, slot: int, k: int) -> None:
        """The slot's sequence asks for k top logprobs; nothing of it is buffered."""
        self._fit(slot + 1, k)
        self.count[slot], self.k[slot] = 0, k

    def _fit(self, slots: int, k: int) -> None:
        """At least `slots` slots and k columns of top logprobs, what is buffered kept."""
        grow_slots, grow_k = max(0, slots - len(self.count)), max(0, k - self.top_ids.shape[2])
        if not grow_slots and not grow_k:
            return
        if grow_slots:
            grow_slots = max(grow_slots, len(self.count), 8)  # doubling, as DecodeRun's slots grow
            self.count, self.k = (np.concatenate([a, np.zeros(grow_slots, np.int64)]) for a in (self.count, self.k))
            self.token_ids, self.token_logprobs = (np.concatenate([a, np.zeros((grow_slots, LOGPROB_CHUNK), a.dtype)])
                                                   for a in (self.token_ids, self.token_logprobs))
        self.top_ids, self.top_logprobs = (np.pad(a, ((0, grow_slots), (0, 0), (0, grow_k)))
                                           for a in (self.top_ids, self.top_logprobs))

    def record(self, slots: np.ndarray, rows: np.ndarray, token_ids: np.ndarray, logprobs: LogprobRows) -> np.ndarray:
        """Buffer one position for each of `slots` (distinct): its sampled token, and row rows[i] of the step's
        logprobs; return the slots whose buffers are now full."""
        at = self.count[slots]
        self.token_ids[slots, at] = token_ids
        self.token_logprobs[slots, at] = logprobs.token_logprobs[rows]
        width = min(self.top_ids.shape[2], logprobs.top_ids.shape[1])  # the step has each row's k columns at least
        if width:
            self.top_ids[slots, at, :width] = logprobs.top_ids[rows, :width]
            self.top_logprobs[slots, at, :width] = logprobs.top_logprobs[rows, :width]
        at += 1
        self.count[slots] = at
        return slots[at == LOGPROB_CHUNK]

    def take(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None:
        """The slot's buffered positions (copies: token ids, their logprobs, top ids, top logprobs, k), emptied;
        None if there are none."""
        n = int(self.count[slot])
        if not n:
            return None
        k = int(self.k[slot])
        self.count[slot] = 0
        return (self.token_ids[slot, :n].copy(), self.token_logprobs[slot, :n].copy(),
                self.top_ids[slot, :n, :k].copy(), self.top_logprobs[slot, :n, :k].copy(), k)
