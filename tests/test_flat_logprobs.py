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
    # distinct ids a position, as top-k gives them; few of them: the sampled token often among them
    ids = np.array([rng.choice(50, k, replace=False) for _ in range(n)], np.int32).reshape(n, k)
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


@pytest.mark.parametrize("seed", range(8))
def test_the_writers_columns_from_blocks_are_those_of_the_dicts(seed):
    """The job writer's logprobs / top_logprobs columns made from a FlatLogprobs' arrays equal those made from its
    dicts: forbidden (-inf) top entries, the token among the top k or not, tied values, k = 0..4, a NaN (the
    dicts' path), a repeated top id (the same), blocks between appended dicts."""
    from tinyvllm.io.writer import _logprob_columns, _logprob_value, _top

    rng = np.random.default_rng(seed)
    flat, token_ids = FlatLogprobs(), []
    for part in range(6):
        k, n = int(rng.integers(0, 5)), int(rng.integers(1, 7))
        tokens, rows = random_rows(rng, n, k)
        rows.top_logprobs[:] = -np.sort(-rows.top_logprobs, 1)  # most likely first, as the kernels give them
        rows.top_logprobs[rng.random((n, k)) < 0.2] = rows.top_logprobs.flat[0] if k else 0  # ties
        if k and rng.random() < 0.5:  # the token among its top k
            rows.top_ids[0, int(rng.integers(k))] = tokens[0]
        if seed == 7 and part == 2 and k:
            rows.top_logprobs[0, 0] = np.nan
        if seed == 6 and part == 0 and k > 1:  # a repeated id (not from top-k; the dicts' path)
            rows.top_ids[0, 1] = rows.top_ids[0, 0]
        token_ids += tokens.tolist()
        if part % 3 == 1:
            for entry in logprob_entries(rows, list(range(n)), tokens.tolist(), [k] * n):
                flat.append(entry)
        else:
            flat.add_block(tokens, rows.token_logprobs, rows.top_ids, rows.top_logprobs, k)
    got = _logprob_columns(token_ids, flat)
    entries = list(FlatLogprobs(flat))  # the dicts
    want = ([_logprob_value(d.get(t)) for t, d in zip(token_ids, entries)], [_top(d) for d in entries])
    assert got == want
