"""Streaming readers: every input record becomes a Row, valid or not; a bad row never stops the job.

Formats (by extension): JSONL (.jsonl/.ndjson/.json, one object per line, blank lines skipped) and Parquet
(.parquet/.pq, read by record batches). A record has `prompt` (text or token ids) or `messages` (chat), an
optional `id` (default: its 0-based record number; only ids given must be unique) and optional sampling
overrides. A file whose first object has `custom_id` is an OpenAI batch file: `custom_id` is the id and `body` holds
the request.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq

from tinyvllm.errors import JobError
from tinyvllm.sampling_params import OVERRIDABLE_FIELDS, SamplingParams

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
INT_FIELDS = ("max_tokens", "top_k", "seed")
PARQUET_BATCH_ROWS = 1024


@dataclass
class Row:
    index: int  # 0-based record number: the output's `row`, the key that resume skips by
    id: str
    prompt: str | list[int] | None = None  # text, or token ids
    messages: list[dict] | None = None  # chat: [{role, content}], rendered later with the model's template
    overrides: dict = field(default_factory=dict)  # SamplingParams fields, already validated
    error: str | None = None  # set: the row is bad and becomes an error row with this reason


class BadRow(ValueError):
    pass


def read_rows(path: str | Path) -> Iterator[Row]:
    """Rows of a JSONL or Parquet file, in file order. Raises JobError now if the file itself is unusable."""
    return _rows(_records(Path(path)))


def count_rows(path: str | Path) -> int:
    """Number of records (for a progress bar): Parquet from its footer, JSONL by a quick scan of non-blank lines."""
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _records(path: Path) -> Iterator[tuple[int, str, object, str | None]]:
    """(index, where, parsed object, problem) per record; checks the file eagerly."""
    if not path.is_file():
        raise JobError(f"input not found: {path}" if not path.exists() else f"input is not a file: {path}")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        try:
            open(path, "rb").close()
        except OSError as e:
            raise JobError(f"cannot read input {path}: {e.strerror}") from None
        return _jsonl_records(path)
    if suffix in PARQUET_SUFFIXES:
        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a corrupt or foreign file
            raise JobError(f"cannot read Parquet input {path}: {e}") from None
        return _parquet_records(parquet)
    raise JobError(f"unsupported input format {suffix or '(no extension)'!r}: use .jsonl or .parquet ({path})")


def _jsonl_records(path: Path) -> Iterator[tuple[int, str, object, str | None]]:
    index = 0
    with open(path, "rb") as f:  # bytes, so one line of invalid UTF-8 is one bad row, not a crashed job
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark (Windows editors)
                raw = raw[3:]
            if not raw.strip():
                continue
            obj, problem = None, None
            try:
                obj = json.loads(raw.decode("utf-8").rstrip("\r\n"))
                if b"\\u" in raw:  # a "\ud800" escape parses to a lone surrogate that cannot be written out
                    json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except UnicodeDecodeError as e:
                problem = f"invalid UTF-8 (byte {raw[e.start]:#04x} at byte offset {e.start})"
            except UnicodeEncodeError:
                problem = "string escape is not valid Unicode (unpaired surrogate)"
            except json.JSONDecodeError as e:
                problem = f"malformed JSON: {e.msg} (column {e.colno})"
            except ValueError:  # Python's int() refuses literals over sys.get_int_max_str_digits() digits
                problem = f"malformed JSON: an integer with more than {sys.get_int_max_str_digits()} digits"
            except RecursionError:
                problem = "malformed JSON: nested too deeply"
            yield index, f"line {lineno}", obj, problem
            index += 1


def _parquet_records(parquet: pq.ParquetFile) -> Iterator[tuple[int, str, object, str | None]]:
    index = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for obj in batch.to_pylist():
            # pandas writes a missing number in a float column as NaN: treat it as absent, like null.
            obj = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in obj.items()}
            yield index, f"row {index}", obj, None
            index += 1


def _rows(records: Iterator[tuple[int, str, object, str | None]]) -> Iterator[Row]:
    seen: set[str] = set()
    openai: bool | None = None  # decided by the first object of the file
    for index, where, obj, problem in records:
        if problem is None and not isinstance(obj, dict):
            problem = f"not a JSON object (got {type(obj).__name__})"
        if problem is not None:
            yield Row(index, str(index), error=f"{where}: {problem}")
            continue
        if openai is None:
            openai = "custom_id" in obj
        try:
            row_id = _row_id(obj, openai)
        except BadRow as e:
            yield Row(index, str(index), error=f"{where}: {e}")
            continue
        # Ids given must be unique; a row without one is known by its row number, which no given id can clash with
        # (the output's `row` column tells them apart).
        if row_id is None:
            row_id = str(index)
        elif row_id in seen:
            yield Row(index, row_id, error=f"{where}: duplicate id {row_id!r} (an earlier row has it)")
            continue
        else:
            seen.add(row_id)
        try:
            prompt, messages, overrides = _parse_openai(obj) if openai else _parse_plain(obj)
        except BadRow as e:
            yield Row(index, row_id, error=f"{where}: {e}")
            continue
        yield Row(index, row_id, prompt, messages, overrides)


def _row_id(obj: dict, openai: bool) -> str | None:
    """The id the row gives, or None."""
    key = "custom_id" if openai else "id"
    value = obj.get(key)
    if value is None:
        if openai:
            raise BadRow("missing custom_id")
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise BadRow(f"{key} must be a non-empty string or an integer, got {value!r:.80}")
    return str(value)


def parse_request(obj: dict) -> tuple[str | list[int] | None, list[dict] | None, dict]:
    """(prompt, messages, sampling overrides) of one row object, plain or OpenAI batch (it has `custom_id`).
    BadRow says what is wrong with it."""
    return _parse_openai(obj) if "custom_id" in obj else _parse_plain(obj)


def _parse_plain(obj: dict) -> tuple[str | list[int] | None, list[dict] | None, dict]:
    overrides = {k: obj[k] for k in OVERRIDABLE_FIELDS if obj.get(k) is not None}
    return (*_prompt_or_messages(obj.get("prompt"), obj.get("messages")), _checked_overrides(overrides))


def _parse_openai(obj: dict) -> tuple[str | list[int] | None, list[dict] | None, dict]:
    if obj.get("method", "POST") != "POST":
        raise BadRow(f"unsupported method {obj.get('method')!r:.40} (only POST)")
    if obj.get("url") not in OPENAI_URLS:
        raise BadRow(f"unsupported url {obj.get('url')!r:.80} (expected one of {', '.join(OPENAI_URLS)})")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadRow("body must be a JSON object")
    if body.get("n") not in (None, 1):
        raise BadRow(f"n={body['n']!r:.20} is not supported (one completion per request)")
    overrides = {k: body[k] for k in OVERRIDABLE_FIELDS if body.get(k) is not None}
    if body.get("max_completion_tokens") is not None:  # the newer name wins, as in OpenAI's API
        overrides["max_tokens"] = body["max_completion_tokens"]
    return (*_prompt_or_messages(body.get("prompt"), body.get("messages")), _checked_overrides(overrides))


def _prompt_or_messages(prompt: object, messages: object) -> tuple[str | list[int] | None, list[dict] | None]:
    if prompt is not None and messages is not None:
        raise BadRow("has both prompt and messages (give one)")
    if prompt is None and messages is None:
        raise BadRow("missing prompt or messages")
    if messages is not None:
        return None, _checked_messages(messages)
    if isinstance(prompt, str):
        if not prompt:
            raise BadRow("prompt is empty")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) < 0:
            raise BadRow("prompt token ids must be >= 0")
        return prompt, None
    if isinstance(prompt, list) and not prompt:
        raise BadRow("prompt is empty")
    raise BadRow(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def _checked_messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRow("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRow(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise BadRow(f"messages[{i}].role must be a non-empty string")
        if isinstance(content, list):  # OpenAI content parts: only text parts make sense here
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRow(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRow(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


def _checked_overrides(overrides: dict) -> dict:
    for name in INT_FIELDS:  # 32.0 is 32 (JSON writers and pandas make floats of ints); 32.5 stays invalid
        value = overrides.get(name)
        if isinstance(value, float) and value.is_integer():
            overrides[name] = int(value)
    stop = overrides.get("stop")
    if isinstance(stop, str):
        overrides["stop"] = [stop]
    elif stop is not None and not isinstance(stop, list):
        raise BadRow(f"invalid stop={stop!r:.80}: must be a string or a list of strings")
    try:
        SamplingParams().with_overrides(overrides)  # the one place that knows what is valid
    except (ValueError, TypeError) as e:
        raise BadRow(str(e)) from None
    return overrides
