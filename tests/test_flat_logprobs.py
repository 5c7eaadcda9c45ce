"""FlatLogprobs (tinyvllm/logprobs.py) reads as the list of dicts logprob_entries makes, whatever mix of blocks and
appended dicts built it; LogprobBuffer (engine/logprob_buffer.py) gives back what it was given, across growth."""

import numpy as np
import pytest

from tinyvllm.backends.base import Logprobs
from tinyvllm.engine import logprob_buffer
from tinyvllm.engine.logprob_buffer import LogprobBuffer
from tinyvllm.logprobs import FlatLogprobs, logprob_entries


def random_rows(rng, n: int, k: int) -> tuple[np.ndarray, Logprobs]:
    top = rng.standard_normal((n, k)).astype(np.float32)
    top[rng.random((n, k)) < 0.1] = -np.inf  # forbidden by a logits processor: left out of the entry
    ids = rng.integers(0, 50, (n, k)).astype(np.int32)  # small ids: the sampled token often among them
    return rng.integers(0, 50, n).astype(np.int32), Logprobs(rng.standard_normal(n).astype(np.float32), ids, top)


@pytest.mark.parametrize("seed", range(5))
def test_blocks_and_appends_read_as_their_entries_in_order(seed):
    rng = np.random.default_rng(seed)
    flat, want = FlatLogprobs(), []
    for _ in range(8):
        k = int(rng.integers(0, 4))
        n = int(rng.integers(1, 6))
        tokens, rows = random_rows(rng, n, k + int(rng.integers(0, 2)))
        entries = logprob_entries(rows, list(range(n)), tokens.tolist(), [k] * n)
        if rng.random() < 0.5:
            flat.add_block(tokens, rows.token_logprobs, rows.top_ids, rows.top_logprobs, k)
        else:
            for entry in entries:
                flat.append(entry)
        want += entries
        assert len(flat) == len(want)
        if rng.random() < 0.3:  # a read in between settles what came before
            assert flat[-1] == want[-1]
    assert flat == want and want == flat and list(flat) == want and flat[1:3] == want[1:3]
    assert flat != want[:-1] and FlatLogprobs(want) == flat
    flat[0] = {1: -1.0}
    del flat[1]
    assert flat[0] == {1: -1.0} and len(flat) == len(want) - 1


def test_the_buffer_keeps_its_positions_when_it_grows(monkeypatch):
    """Slots and k grow while positions are buffered; take() gives each slot's positions back (k columns), and a
    slot fills at LOGPROB_CHUNK."""
    monkeypatch.setattr(logprob_buffer, "LOGPROB_CHUNK", 4)
    rng = np.random.default_rng(1)
    buf, given = LogprobBuffer(), {}
    buf.start(0, 1)
    tokens, rows = random_rows(rng, 1, 3)
    assert not len(buf.record(np.array([0]), np.array([0]), tokens, rows))
    given[0] = [(tokens[0], rows, 0)]
    buf.start(20, 3)  # more slots and more columns
    for step in range(3):
        tokens, rows = random_rows(rng, 2, 3)
        full = buf.record(np.array([20, 0]), np.array([0, 1]), tokens, rows)
        given.setdefault(20, []).append((tokens[0], rows, 0))
        given[0].append((tokens[1], rows, 1))
        assert full.tolist() == ([0] if step == 2 else [])
    for slot, k in ((0, 1), (20, 3)):
        token_ids, own, top_ids, top, got_k = buf.take(slot)
        assert got_k == k and top_ids.shape == (len(given[slot]), k)
        for i, (token, rows, row) in enumerate(given[slot]):
            assert token_ids[i] == token and own[i] == rows.token_logprobs[row]
            np.testing.assert_array_equal(top_ids[i], rows.top_ids[row, :k])
            np.testing.assert_array_equal(top[i], rows.top_logprobs[row, :k])
        assert buf.take(slot) is None
