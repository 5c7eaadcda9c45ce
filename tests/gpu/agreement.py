"""How far a cuda completion follows the numpy backend's (greedy, with logprobs), shared by the GPU tests."""

import numpy as np


def agreed_tokens(want, got, margin: float = 0.1, tolerance: float = 0.05) -> int:
    """Tokens of completion `got` (cuda) equal to `want`'s (numpy) before they first differ, each with a logprob
    within `tolerance`. Where they differ, numpy's choice must have won by less than `margin` (a near-tie that bf16
    may split); anything else fails the test."""
    for t, (x, y) in enumerate(zip(want.token_ids, got.token_ids)):
        if x != y:
            gap = want.logprobs[t][x] - want.logprobs[t].get(y, -np.inf)
            assert gap < margin, f"diverged at step {t} with margin {gap}"
            return t
        assert abs(want.logprobs[t][x] - got.logprobs[t][y]) < tolerance
    return min(len(want.token_ids), len(got.token_ids))
