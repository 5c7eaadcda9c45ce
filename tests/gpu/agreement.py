"""How far a cuda completion follows the numpy backend's (greedy, with logprobs), shared by the GPU tests."""

import numpy as np


def agreed_tokens(want, got, margin: float = 0.1, tolerance: float = 0.05) -> int:
    """Tokens of completion `got` (cuda) equal to `want`'s (numpy) before they first differ, each with a logprob
    within `tolerance`. Where they differ, numpy's choice must have won by less than `margin` (a near-tie that bf16
    may split); anything else fails the test."""
    for t, (x, y) in enumerate(zip(want.token_ids, got.token_ids)):
        if x != y:
            gap = want.logprobs[t][x].logprob - logprob_of(want.logprobs[t], y)
            assert gap < margin, f"diverged at step {t} with margin {gap}"
            return t
        assert abs(want.logprobs[t][x].logprob - got.logprobs[t][y].logprob) < tolerance
    return min(len(want.token_ids), len(got.token_ids))


def logprob_of(entry: dict, token: int) -> float:
    """A token's logprob in one position's {token_id: Logprob}; -inf when it is not there."""
    return entry[token].logprob if token in entry else -np.inf
