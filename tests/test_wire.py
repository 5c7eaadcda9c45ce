"""jobs/wire.py: the values that cross the row preparation worker's pipes come back exactly (type and value), with
no pickle; anything else is refused when written."""

import datetime as dt
import math
import random
from decimal import Decimal

import pytest

from tinyvllm.jobs import wire

VALUES = [
    0, -(1 << 70), 1.5, -0.0, float("inf"), "", "naïve \ud800 text", None, True, False,
    [], [1, 2, 3], [True, 1], [1, "x", (2, 3)], (), (1, [2, (3,)]),
    {}, {"a": 1}, {wire.TAG: 2}, {wire.TAG: "tuple", "v": [1]}, {1: "x", (1, 2): b"\x00\xff"}, {"k": {2: [None]}},
    b"", b"\x00\x01\xfe", Decimal("1.2300"), Decimal("-0E-7"), Decimal("NaN"),
    dt.datetime(2020, 1, 2, 3, 4, 5, 6), dt.datetime(2020, 1, 2, tzinfo=dt.timezone(dt.timedelta(hours=-5))),
    dt.date(1999, 12, 31), dt.time(23, 59, 59, 999999), dt.timedelta(days=-1, seconds=5, microseconds=7),
    [("key", 1), ("other", None)],  # an Arrow map column's value
]


def same(a, b) -> bool:
    """Equal, with the same types all the way down (1 and True and 1.0 differ; so do a list and a tuple)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k, j) and same(a[k], b[j]) for k, j in zip(a, b))
    if isinstance(a, Decimal) and a.is_nan():
        return b.is_nan()
    return a == b and (not isinstance(a, dt.datetime) or a.utcoffset() == b.utcoffset())


@pytest.mark.parametrize("value", VALUES + [VALUES, tuple(VALUES), float("nan")], ids=repr)
def test_round_trip(value):
    data = wire.dumps(value)
    assert isinstance(data, bytes)
    assert same(wire.loads(data), value)


def test_random_nested_values_round_trip():
    rng = random.Random(7)
    leaves = [lambda: rng.randrange(-10**9, 10**9), lambda: rng.random(), lambda: rng.choice(["", "é", "x" * 50]),
              lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(5))), lambda: None,
              lambda: Decimal(rng.randrange(10**6)).scaleb(-3), lambda: dt.date(2000, 1, 1 + rng.randrange(28))]

    def make(depth):
        kind = rng.randrange(4 if depth < 4 else 1)
        if kind == 0:
            return rng.choice(leaves)()
        items = [make(depth + 1) for _ in range(rng.randrange(4))]
        if kind == 1:
            return items
        if kind == 2:
            return tuple(items)
        return {(str(i) if rng.random() < 0.7 else i): v for i, v in enumerate(items)}

    for _ in range(300):
        value = make(0)
        assert same(wire.loads(wire.dumps(value)), value)


@pytest.mark.parametrize("value", [{1, 2}, object(), [dt.timezone.utc], {"a": frozenset()}, bytearray(b"x")],
                         ids=repr)
def test_other_types_are_refused_when_written(value):
    assert not wire.supported(value)
    with pytest.raises(TypeError, match="cannot be sent"):
        wire.dumps(value)


def test_a_message_builds_nothing_but_plain_values():
    """A message naming some other type (as a pickle could) is an error, not an object."""
    with pytest.raises(ValueError, match="not a wire value"):
        wire.loads(b'{"\\u0000wire": "os.system", "v": "true"}')
