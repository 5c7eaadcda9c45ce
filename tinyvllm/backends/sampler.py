"""Sampling, the numpy reference (twin of cuda/sampling.cu).

Sampling is Gumbel-max over the filtered, temperature-scaled logits: token = argmax(logits / T + g), where the
noise g of each (request, output index, token) comes from a counter-based hash. So a seeded request draws the same
tokens whatever else is in its batch, on either backend, after preemption and recompute too.
"""

from __future__ import annotations

import numpy as np

from tinyvllm.backends.base import LogitsProcessing, Logprobs, SamplingBatch

_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def mix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer: a bijective avalanche mix of uint32 values."""
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * _M1
        x = x ^ (x >> np.uint32(13))
        x = x * _M2
        x = x ^ (x >> np.uint32(16))
    return x


def seed_key(seed: int) -> int:
    """A request's 32-bit sampling key, from its 64-bit seed (computed once, at arrival):
    mix32(lo ^ mix32(hi ^ 0x9E3779B9)) of its low and high 32 bits, on Python ints (a tenth of numpy's time on one
    value; the same bits)."""
    return _mix32_int((seed & 0xFFFFFFFF) ^ _mix32_int(((seed >> 32) & 0xFFFFFFFF) ^ 0x9E3779B9))


def _mix32_int(x: int) -> int:
    """mix32 of one value in [0, 2^32)."""
    x ^= x >> 16
    x = x * 0x85EBCA6B & 0xFFFFFFFF
    x ^= x >> 13
    x = x * 0xC2B2AE35 & 0xFFFFFFFF
    return x ^ x >> 16


def step_keys(seed_keys: np.ndarray, output_indices: np.ndarray) -> np.ndarray:
    """The noise key of each request's next draw: hash of its seed key and the index of the token being drawn.
    mix32(seed_keys ^ mix32(output_indices + 0x632BE5AB)), in place on one array (the engine's every step)."""
    x = np.array(output_indices, dtype=np.uint32, ndmin=1)  # arrays wrap on overflow without a warning
    x += np.uint32(0x632BE5AB)
    _mix32_in_place(x)
    x ^= np.asarray(seed_keys, dtype=np.uint32)
    return _mix32_in_place(x).reshape(np.shape(output_indices))


def _mix32_in_place(x: np.ndarray) -> np.ndarray:
    """mix32 of a uint32 array, overwriting it."""
    x ^= x >> np.uint32(16)
    x *= _M1
    x ^= x >> np.uint32(13)
    x *= _M2
    x ^= x >> np.uint32(16)
    return x


def gumbel_noise(keys: np.ndarray, vocab_size: int) -> np.ndarray:
    """Gumbel(0, 1) noise [S, V] from per-row keys: u from the 23 high bits of mix32(key ^ mix32(token)).

    (bits + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1): with 24 bits the top value would round to
    1.0 and give infinite noise."""
    token_hash = mix32(np.arange(vocab_size, dtype=np.uint32))
    bits = mix32(keys.astype(np.uint32)[:, None] ^ token_hash[None, :]) >> np.uint32(9)
    u = (bits.astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 23))
    return -np.log(-np.log(u))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def filtered_logits(logits: np.ndarray, params: SamplingBatch) -> np.ndarray:
    """Temperature-scaled logits with the tokens removed by top-k, top-p and min-p set to -inf."""
    temperature = np.where(params.temperature > 0, params.temperature, 1.0).astype(np.float32)
    scaled = logits / temperature[:, None]
    probs = np.exp(log_softmax(scaled))
    keep = np.ones_like(scaled, dtype=bool)

    # top-k: keep tokens whose probability is at least the k-th largest (ties at the boundary stay in).
    top_k = params.top_k
    if np.any(top_k > 0):
        order = -np.sort(-probs, axis=-1)
        k_index = np.clip(np.where(top_k > 0, top_k, probs.shape[1]), 1, probs.shape[1]) - 1
        kth = order[np.arange(len(probs)), k_index]
        keep &= probs >= kth[:, None]
    # top-p: the smallest set of most likely tokens whose mass reaches top_p (among the top-k survivors).
    if np.any(params.top_p < 1):
        keep &= probs >= top_p_threshold(np.where(keep, probs, 0.0).astype(np.float32), params.top_p)[:, None]
    # min-p: drop tokens less likely than min_p times the most likely one.
    if np.any(params.min_p > 0):
        keep &= probs >= (params.min_p[:, None] * probs.max(axis=-1, keepdims=True))
    return np.where(keep, scaled, -np.inf)


# Top-p weighs a token by its probability in fixed point, q * 2^31 rounded to the nearest integer, as
# cuda/sampling.cu does: integer sums are exact in any order, so a row's threshold does not depend on how the GPU's
# histogram atomics interleave.
MASS_SCALE = 2.0 ** 31


def top_p_threshold(masked: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Per row of probabilities (float32, 0 where top-k removed a token): the probability of the last token, most
    likely first, needed for the weights to reach ceil(top_p x their total); 0 where top_p is 1."""
    weights = np.rint(masked.astype(np.float64) * MASS_SCALE).astype(np.int64)
    order = np.argsort(-masked, axis=-1, kind="stable")
    reached = np.cumsum(np.take_along_axis(weights, order, axis=-1), axis=-1)
    target = np.ceil(top_p.astype(np.float64) * reached[:, -1])
    last = (reached < target[:, None]).sum(axis=-1)  # the weights reach the target at this position
    at = np.minimum(last, masked.shape[1] - 1)[:, None]
    threshold = np.take_along_axis(np.take_along_axis(masked, order, axis=-1), at, axis=-1)[:, 0]
    return np.where(top_p < 1, threshold, 0.0).astype(np.float32)


def sample(logits: np.ndarray, params: SamplingBatch) -> np.ndarray:
    """One token id per row of logits [S, V] (float32)."""
    greedy_ids = logits.argmax(axis=-1)
    if params.all_greedy:
        return greedy_ids.astype(np.int32)
    random_rows = np.flatnonzero(params.temperature > 0)
    sub = SamplingBatch(params.temperature[random_rows], params.top_p[random_rows], params.top_k[random_rows],
                        params.min_p[random_rows], params.noise_keys[random_rows])
    scores = filtered_logits(logits[random_rows], sub) + gumbel_noise(sub.noise_keys, logits.shape[1])
    greedy_ids[random_rows] = scores.argmax(axis=-1)
    return greedy_ids.astype(np.int32)


def gather_logprobs(logits: np.ndarray, token_ids: np.ndarray, k: int) -> Logprobs:
    """Logprobs (of the raw model distribution) of `token_ids` [N] and the top-k tokens at each of N rows."""
    logp = log_softmax(logits)
    rows = np.arange(len(token_ids))
    if k > 0:
        top_ids = top_logprob_ids(logits, k)
        top_lp = np.take_along_axis(logp, top_ids, axis=-1)
    else:
        top_ids, top_lp = np.zeros((len(rows), 0), np.int32), np.zeros((len(rows), 0), np.float32)
    return Logprobs(logp[rows, token_ids].astype(np.float32), top_ids.astype(np.int32), top_lp.astype(np.float32))


def top_logprob_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Per row, the ids of the k largest logits by descending logit, then ascending id; of the tokens tied at the
    k-th largest, those of the smallest ids. One answer whatever the batch, on either backend (cuda/sampling.cu's
    logprobs picks the same)."""
    kth = -np.partition(-logits, k - 1, axis=-1)[:, k - 1:k]
    above, tied = logits > kth, logits == kth
    taken = above | (tied & (np.cumsum(tied, axis=-1) <= k - above.sum(axis=-1, keepdims=True)))
    ids = np.argsort(~taken, axis=-1, kind="stable")[:, :k]  # the k taken, ascending
    order = np.argsort(-np.take_along_axis(logits, ids, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(ids, order, axis=-1)


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray, bitmask_rows: np.ndarray) -> None:
    """Set to -inf, in place, the logits [S, V] of the tokens that row i's bitmask row (bitmask[bitmask_rows[i]],
    int32 words, bit t % 32 of word t // 32 allowing token t) forbids; rows with bitmask_rows[i] < 0 are left alone.
    Twin of cuda/structured_outputs.cu."""
    rows = np.flatnonzero(bitmask_rows >= 0)
    vocab = logits.shape[1]
    allowed = np.unpackbits(bitmask[bitmask_rows[rows]].view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    logits[rows] = np.where(allowed.astype(bool), logits[rows], -np.inf)


class TokenCounts:
    """The token-count table of LogitsProcessing's penalties: per slot, output counts and a prompt mask [V].
    The twin of the cuda backend's table (cuda/logits_processors.cu); allocated on first use."""

    def __init__(self, num_slots: int, vocab_size: int) -> None:
        self.num_slots, self.vocab_size = num_slots, vocab_size
        self.counts = np.zeros((0, vocab_size), np.int32)
        self.prompt_mask = np.zeros((0, vocab_size), bool)

    def init_slots(self, slot_inits: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        if slot_inits and not len(self.counts):
            self.counts = np.zeros((self.num_slots, self.vocab_size), np.int32)
            self.prompt_mask = np.zeros((self.num_slots, self.vocab_size), bool)
        for slot, prompt, output in slot_inits:
            self.counts[slot] = 0
            np.add.at(self.counts[slot], output, 1)
            self.prompt_mask[slot] = False
            self.prompt_mask[slot, prompt] = True

    def count(self, proc: LogitsProcessing, sampled: np.ndarray) -> None:
        rows = np.flatnonzero(proc.count_slots >= 0)
        np.add.at(self.counts, (proc.count_slots[rows], sampled[rows]), 1)


def apply_logits_processing(logits: np.ndarray, proc: LogitsProcessing, last_tokens: np.ndarray,
                            table: TokenCounts) -> None:
    """Apply the step's logits processors to logits [S, V] float32 in place (see LogitsProcessing for the order and
    meanings). last_tokens [S]: each row's last input token."""
    for i in range(len(logits)):
        x = logits[i]
        a, b = proc.allowed_ptr[i], proc.allowed_ptr[i + 1]
        if b > a:
            banned = np.ones(len(x), bool)
            banned[proc.allowed_ids[a:b]] = False
            x[banned] = -np.inf
        for j in range(proc.bias_ptr[i], proc.bias_ptr[i + 1]):
            if proc.bias_cond[j] < 0 or proc.bias_cond[j] == last_tokens[i]:
                x[proc.bias_ids[j]] += proc.bias_values[j]
        slot = proc.penalty_slots[i]
        if slot >= 0:
            counts = table.counts[slot].astype(np.float32)
            x -= proc.frequency[i] * counts + proc.presence[i] * (counts > 0).astype(np.float32)
            seen = (counts > 0) | table.prompt_mask[slot]
            x[seen] = np.where(x[seen] > 0, x[seen] / proc.repetition[i], x[seen] * proc.repetition[i])
