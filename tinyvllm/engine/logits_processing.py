"""Per-request logits processors (allowed_token_ids, logit_bias, bad_words, min_tokens, penalties) turned into the
flat arrays of one step's LogitsProcessing, and the token-count slots the penalties use on the backend."""

from __future__ import annotations

import numpy as np

from tinyvllm.backends.base import LogitsProcessing
from tinyvllm.engine.request_processors import RequestProcessors
from tinyvllm.engine.sequence import PENDING_TOKEN, Sequence


class PenaltySlots:
    """The backend's token-count table has one slot per possible running sequence (max_num_seqs): a sequence with
    penalties holds one while it runs; a new holder's slot is initialised within the step it first runs in."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots - 1, -1, -1))

    def release(self, seq: Sequence) -> None:
        if seq.penalty_slot >= 0:
            self.free.append(seq.penalty_slot)
            seq.penalty_slot = -1


def build_logits_processing(seqs: list[Sequence], samples: list[bool], slots: PenaltySlots) -> LogitsProcessing | None:
    """The step's LogitsProcessing (None if no sequence needs one). samples[i]: row i samples a token kept.
    Runs on the host for every step: rows with penalties alone cost a few list appends."""
    if all(seq.processors is None for seq in seqs):
        return None
    n = len(seqs)
    allowed_counts, bias_counts = np.zeros(n, np.int64), np.zeros(n, np.int64)
    allowed, bias_ids, bias_values, bias_cond, slot_inits = [], [], [], [], []
    rows, penalty_slots, count_slots, presence, frequency, repetition = [], [], [], [], [], []
    for i, (seq, sampled) in enumerate(zip(seqs, samples)):
        proc = seq.processors
        if proc is None:
            continue
        if proc.penalties:
            if seq.penalty_slot < 0:
                seq.penalty_slot = slots.free.pop()
                assert PENDING_TOKEN not in seq.output_token_ids, "a sequence gets its slot with every token known"
                slot_inits.append((seq.penalty_slot, np.asarray(seq.prompt_token_ids, np.int32),
                                   np.asarray(seq.output_token_ids, np.int32)))
            params = seq.params
            rows.append(i)
            penalty_slots.append(seq.penalty_slot)
            count_slots.append(seq.penalty_slot if sampled else -1)
            presence.append(params.presence_penalty)
            frequency.append(params.frequency_penalty)
            repetition.append(params.repetition_penalty)
        if proc.allowed_ids is not None:
            allowed.append(proc.allowed_ids)
            allowed_counts[i] = len(proc.allowed_ids)
        if proc.has_biases:
            ids, values, cond = _row_biases(seq, proc)
            bias_ids.append(ids), bias_values.append(values), bias_cond.append(cond)
            bias_counts[i] = len(ids)

    def per_row(values: list, fill, dtype) -> np.ndarray:
        out = np.full(n, fill, dtype)
        out[rows] = values
        return out

    def flat(parts: list, dtype) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    return LogitsProcessing(per_row(penalty_slots, -1, np.int32), per_row(count_slots, -1, np.int32),
                            per_row(presence, 0, np.float32), per_row(frequency, 0, np.float32),
                            per_row(repetition, 1, np.float32), np.r_[0, np.cumsum(allowed_counts)].astype(np.int32),
                            flat(allowed, np.int32), np.r_[0, np.cumsum(bias_counts)].astype(np.int32),
                            flat(bias_ids, np.int32), flat(bias_values, np.float32), flat(bias_cond, np.int32),
                            slot_inits)


def _row_biases(seq: Sequence, proc: RequestProcessors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's bias entries this step (ids, values, conditions): logit_bias and single-token bans always,
    min_tokens' bans while too few tokens are out, a bad word's last token after the rest of it."""
    ids, values, cond = [proc.bias_ids], [proc.bias_values], [np.full(len(proc.bias_ids), -1)]
    produced = seq.num_output_tokens  # the token sampled now is output number `produced`
    if produced < seq.params.min_tokens and len(proc.min_tokens_ban):
        ban = proc.min_tokens_ban
        ids.append(ban), values.append(np.full(len(ban), -np.inf)), cond.append(np.full(len(ban), -1))
    output = seq.output_token_ids
    for words in proc.bad_sequences:
        # The tokens before the banned one must end the output; the last of them is the row's last input token
        # (maybe still being sampled: the backend checks that one).
        k = len(words) - 1
        if produced >= k and output[produced - k: produced - 1] == list(words[: k - 1]):
            ids.append([words[-1]]), values.append([-np.inf]), cond.append([words[-2]])
    return (np.concatenate(ids).astype(np.int32), np.concatenate(values).astype(np.float32),
            np.concatenate(cond).astype(np.int32))
