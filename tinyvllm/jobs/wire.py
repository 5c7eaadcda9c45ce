"""Plain values as bytes and back, exactly, without pickle: what crosses the pipes between a job and its row
preparation worker (jobs/prepare.py).

JSON carries str, int, float (nan and infinities too), bool, None, lists and dicts with str keys as they are; a
value JSON has no form for, or would change (a tuple would come back a list, an int key a str), is written as a
one-key-and-value object {TAG: kind, "v": its form} and revived when read: tuples, dicts with other keys, bytes,
Decimal, date, time, datetime and timedelta (what the Arrow columns of a Parquet input hold as Python values). Any
other type raises TypeError when written: nothing is guessed, and reading builds no object but these. Decoding a
prepared row (sent as a list: a tuple would be revived) takes ~7.7 us on the engine's thread, three times what
unpickling it would: the price of building nothing but plain values.

Strings go through as UTF-8 with surrogatepass, so text holding a lone surrogate (JSON input may) arrives as sent.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from decimal import Decimal

TAG = "\x00wire"  # the key of a revived value's object; a dict with this key is written in the pair form
_PLAIN = (str, int, float, bool, type(None))


def dumps(value) -> bytes:
    return json.dumps(_tagged(value), ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def loads(data: bytes):
    return json.loads(data.decode("utf-8", "surrogatepass"), object_hook=_revive)


def supported(value) -> bool:
    """Whether dumps takes `value`."""
    try:
        _tagged(value)
    except TypeError:
        return False
    return True


def _tagged(value):
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is list:
        if all(type(v) is int for v in value):  # token ids: most of what crosses
            return value
        return [_tagged(v) for v in value]
    if kind is dict:
        if all(type(k) is str for k in value) and TAG not in value:
            return {k: _tagged(v) for k, v in value.items()}
        return {TAG: "dict", "v": [[_tagged(k), _tagged(v)] for k, v in value.items()]}
    if kind is tuple:
        return {TAG: "tuple", "v": [_tagged(v) for v in value]}
    if kind in _FORMS:
        name, form, _ = _FORMS[kind]
        return {TAG: name, "v": form(value)}
    raise TypeError(f"a {kind.__name__} value cannot be sent to or from the row preparation worker")


# type -> (its tag, its JSON form, the value from that form)
_FORMS = {
    bytes: ("bytes", lambda v: base64.b64encode(v).decode("ascii"), base64.b64decode),
    Decimal: ("decimal", str, Decimal),
    dt.datetime: ("datetime", dt.datetime.isoformat, dt.datetime.fromisoformat),
    dt.date: ("date", dt.date.isoformat, dt.date.fromisoformat),
    dt.time: ("time", dt.time.isoformat, dt.time.fromisoformat),
    dt.timedelta: ("timedelta", lambda v: [v.days, v.seconds, v.microseconds], lambda f: dt.timedelta(*f)),
}
_REVIVE = {name: back for name, _, back in _FORMS.values()}
_REVIVE["tuple"] = tuple
_REVIVE["dict"] = lambda pairs: {k: v for k, v in pairs}


def _revive(obj: dict):
    if TAG in obj and len(obj) == 2 and "v" in obj:
        revive = _REVIVE.get(obj[TAG])
        if revive is None:
            raise ValueError(f"not a wire value: {obj[TAG]!r}")
        return revive(obj["v"])
    return obj
