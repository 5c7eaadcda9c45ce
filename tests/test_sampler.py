"""The numpy sampler: filters against a plain sorted implementation, and seeded draws that ignore the batch."""

import numpy as np
import pytest

from tinyvllm.backends import sampler
from tinyvllm.backends.base import SamplingBatch


def params(n, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, keys=None):
    return SamplingBatch(np.full(n, temperature, np.float32), np.full(n, top_p, np.float32),
                         np.full(n, top_k, np.int32), np.full(n, min_p, np.float32),
                         np.arange(n, dtype=np.uint32) if keys is None else keys)


def reference_keep(logits_row, temperature, top_p, top_k, min_p):
    """Which tokens survive, by sorting one row (the textbook definitions)."""
    probs = np.exp(logits_row / temperature - np.max(logits_row / temperature))
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    k = top_k if top_k > 0 else len(probs)
    kept = order[:k]
    mass = probs[kept] / probs[kept].sum()
    n = int(np.searchsorted(np.cumsum(mass), top_p - 1e-7) + 1) if top_p < 1 else len(kept)
    keep[kept[:n]] = True
    keep &= probs >= min_p * probs.max()
    return keep


@pytest.mark.parametrize("top_p,top_k,min_p", [(1.0, 5, 0.0), (0.7, 0, 0.0), (0.9, 20, 0.0), (1.0, 0, 0.05),
                                               (0.5, 10, 0.02)])
def test_filters_match_sorted_reference(top_p, top_k, min_p):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 200)).astype(np.float32) * 3
    got = np.isfinite(sampler.filtered_logits(logits, params(6, 0.8, top_p, top_k, min_p)))
    for row in range(6):
        np.testing.assert_array_equal(got[row], reference_keep(logits[row], 0.8, top_p, top_k, min_p))


def test_greedy_is_argmax():
    logits = np.random.default_rng(2).normal(size=(5, 50)).astype(np.float32)
    np.testing.assert_array_equal(sampler.sample(logits, params(5, temperature=0.0)), logits.argmax(-1))


def test_draws_follow_the_distribution():
    # 4000 rows with the same logits and different keys: frequencies match softmax within sampling error.
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)).repeat(4000, 0)
    draws = sampler.sample(logits, params(4000, keys=sampler.step_keys(np.full(4000, 7, np.uint32),
                                                                       np.arange(4000))))
    freq = np.bincount(draws, minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_top_k_one_is_greedy_whatever_the_noise():
    logits = np.random.default_rng(3).normal(size=(8, 64)).astype(np.float32)
    np.testing.assert_array_equal(sampler.sample(logits, params(8, top_k=1)), logits.argmax(-1))


def test_a_row_draws_the_same_token_whatever_its_neighbours():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(6, 100)).astype(np.float32)
    keys = sampler.step_keys(np.array([sampler.seed_key(s) for s in range(6)], np.uint32), np.full(6, 3))
    together = sampler.sample(logits, params(6, keys=keys))
    alone = [sampler.sample(logits[i:i + 1], params(1, keys=keys[i:i + 1]))[0] for i in range(6)]
    np.testing.assert_array_equal(together, alone)
    # and a different seed changes some draws
    other = sampler.step_keys(np.array([sampler.seed_key(s + 100) for s in range(6)], np.uint32), np.full(6, 3))
    many = np.repeat(logits[:1], 64, 0)
    assert len(set(sampler.sample(many, params(64, keys=np.arange(64, dtype=np.uint32) * 7919)))) > 1
    assert not np.array_equal(sampler.step_keys(keys, np.zeros(6)), sampler.step_keys(other, np.zeros(6)))


def test_gather_logprobs_top_k_sorted_and_normalised():
    logits = np.random.default_rng(5).normal(size=(3, 30)).astype(np.float32)
    lp = sampler.gather_logprobs(logits, np.array([1, 2, 3]), 4)
    full = sampler.log_softmax(logits)
    np.testing.assert_allclose(np.exp(full).sum(-1), 1, rtol=1e-5)
    np.testing.assert_allclose(lp.token_logprobs, full[[0, 1, 2], [1, 2, 3]], rtol=1e-6)
    np.testing.assert_array_equal(lp.top_ids, np.argsort(-full, -1)[:, :4])


def test_gumbel_noise_is_finite_for_every_hash():
    # the extreme hash values map to u strictly inside (0, 1)
    keys = np.array([0, 0xFFFFFFFF, 12345], np.uint32)
    noise = sampler.gumbel_noise(keys, 1 << 16)
    assert np.all(np.isfinite(noise))
    top = (np.float32((1 << 23) - 1) + np.float32(0.5)) * np.float32(1.0 / (1 << 23))
    assert top < 1 and np.isfinite(-np.log(-np.log(top)))


def test_seed_key_is_mix32_of_the_seeds_halves():
    """seed_key (Python ints) gives numpy mix32's bits: mix32(lo ^ mix32(hi ^ 0x9E3779B9)), over random 64-bit
    seeds and the edges."""
    rng = np.random.default_rng(3)
    seeds = [0, 1, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, (1 << 64) - 1, *rng.integers(0, 1 << 63, 500).tolist()]
    for seed in seeds:
        lo, hi = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32 & 0xFFFFFFFF)
        assert sampler.seed_key(seed) == int(sampler.mix32(lo ^ sampler.mix32(hi ^ np.uint32(0x9E3779B9))))


def exact_top_p_keep(row, top_p):
    """Which tokens top-p keeps, by a loop over Python integers: weights q * 2^31 rounded, most likely first, until
    they reach ceil(top_p x their total); ties with the last token needed stay in."""
    weights = [int(np.rint(float(q) * sampler.MASS_SCALE)) for q in row]
    target = int(np.ceil(float(top_p) * sum(weights)))
    reached = 0
    for i in sorted(range(len(row)), key=lambda i: -row[i]):
        reached += weights[i]
        if reached >= target:
            return row >= row[i]
    return row >= 0


def test_top_p_sums_its_weights_exactly():
    # 0.5, 0.25, 0.25 - 2^-13, then 4096 distinct tokens in [2^-26, 2^-25): summed in float32 in descending order,
    # the running total stops growing at 1 - 2^-13 (each tiny token is less than half a unit of it), so a float
    # cumsum never reaches top_p = 1 - 2^-14 of the total and keeps every token; the fixed-point weights reach it
    # partway through the tiny ones.
    tiny = (2.0 ** -26 * (1 + np.arange(4096)[::-1] / 4096)).astype(np.float32)
    row = np.concatenate([np.array([0.5, 0.25, 0.25 - 2 ** -13], np.float32), tiny])
    top_p = np.float32(1 - 2 ** -14)
    threshold = sampler.top_p_threshold(row[None], np.array([top_p]))[0]
    keep = row >= threshold
    np.testing.assert_array_equal(keep, exact_top_p_keep(row, top_p))
    assert 3 < keep.sum() < len(row)
    order = np.sort(row)[::-1]
    assert np.cumsum(order, dtype=np.float32)[-1] < top_p  # the float32 sum that would keep every token


def test_top_p_threshold_matches_exact_integer_loop():
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((40, 500)) * rng.uniform(0.3, 4, (40, 1))).astype(np.float32)
    logits[::5, :50] = 2.0  # ties at the top
    probs = np.exp(sampler.log_softmax(logits))
    top_p = rng.uniform(0.05, 0.99, 40).astype(np.float32)
    threshold = sampler.top_p_threshold(probs, top_p)
    for row in range(40):
        np.testing.assert_array_equal(probs[row] >= threshold[row], exact_top_p_keep(probs[row], top_p[row]))
    assert (sampler.top_p_threshold(probs, np.ones(40, np.float32)) == 0).all()


def test_top_logprob_ids_take_the_smallest_ids_of_a_tie():
    # row 0: 9.0 once, then 5.0 at ids 3, 7, 11, 20 (k = 3 takes 3 and 7); row 1: no ties; row 2: all equal
    logits = np.zeros((3, 24), np.float32)
    logits[0, [3, 7, 11, 20]] = 5.0
    logits[0, 15] = 9.0
    logits[1] = np.random.default_rng(9).permutation(24).astype(np.float32)
    ids = sampler.top_logprob_ids(logits, 3)
    np.testing.assert_array_equal(ids[0], [15, 3, 7])
    np.testing.assert_array_equal(ids[1], np.argsort(-logits[1])[:3])
    np.testing.assert_array_equal(ids[2], [0, 1, 2])
    # the same row among others, anywhere: the same ids
    many = np.repeat(logits[:1], 5, 0)
    many[1:4, 0] = np.float32([1.0, 2.0, 3.0])  # other rows differ below the top
    assert (sampler.top_logprob_ids(many, 3) == ids[0]).all()
    lp = sampler.gather_logprobs(logits, np.zeros(3, np.int64), 3)
    np.testing.assert_array_equal(lp.top_ids, ids)
