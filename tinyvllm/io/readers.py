"""Streaming readers: every input record becomes a Row, valid or not; a bad row never stops the job.

Formats (by extension): JSONL (.jsonl/.ndjson/.json, one object per line, blank lines skipped) and Parquet
(.parquet/.pq, read by record batches). A record has `prompt` (text or token ids) or `messages` (chat), an
optional `id` (default: its 0-based record number; only ids given must be unique) and optional request fields
(sampling overrides, chat-template options). A file whose first object has `custom_id` is an OpenAI batch file:
`custom_id` is the id and `body` holds the request.

Nothing is silently ignored: every request field is applied or refused (the row becomes an error row naming it;
with allow_unknown_fields the field is dropped and listed in the row's `ignored_fields`). A plain row's other
fields, and an OpenAI line's keys beside custom_id/method/url/body, are data: the job carries them to its output
(input_columns() gives their Arrow types). A plain row's field that misspells a request field (`max_token`,
`temprature`, `topK`, another API's `stop_sequences`) is not data: its row is an error row saying which field was
meant (with allow_unknown_fields it is carried as data).

InputOptions map other columns to `prompt` and `messages` and read only the first rows; a Parquet input whose
schema has no prompt or messages column is refused at once (JobUsageError), before any row runs.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from tinyvllm.config import INT32_MAX, settings
from tinyvllm.errors import JobError, JobUsageError
from tinyvllm.names import nearest
from tinyvllm.sampling_params import OVERRIDABLE_FIELDS, SamplingParams

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
OPENAI_LINE_FIELDS = ("custom_id", "method", "url", "body")
# From SamplingParams' declarations: integer fields (a float that is an integer is taken: JSON writers and pandas
# make floats of ints), and the list fields a single string may stand for (`stop`).
INT_FIELDS = tuple(s.name for s in settings(SamplingParams) if s.kind is int and s.container is None)
ONE_OR_LIST_FIELDS = tuple(s.name for s in settings(SamplingParams) if s.one_or_list)
# vLLM's LLM.chat options, per row (a job sets their defaults).
CHAT_FIELDS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
# OpenAI's names for SamplingParams fields: max_completion_tokens is max_tokens; chat's `logprobs: true` with
# `top_logprobs: k` is logprobs=k (completions' integer `logprobs` is vLLM's already).
OPENAI_ALIASES = ("max_completion_tokens", "top_logprobs")
# Other names of structured_outputs: OpenAI's response_format, and the guided_* fields of vLLM's OpenAI server.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}
STRUCTURED_ALIASES = ("response_format", *GUIDED_FIELDS)
# Fields of an OpenAI request body that mean nothing for an offline generation: accepted and ignored.
IGNORED_FIELDS = ("model", "user", "metadata", "store")
# Request fields of OpenAI's and vLLM's APIs that tinyvllm cannot honour: a row giving one is refused (in a plain
# row too, where other unknown fields are data columns).
UNSUPPORTED_FIELDS = {
    "stream": "outputs are written once complete; only stream: false",
    "stream_options": "outputs are not streamed",
    "guided_decoding_backend": "one structured-outputs library: llguidance",
    "structural_tag": "no structural tags: use structured_outputs (json, regex, choice or grammar)",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "functions": "tool calling is not supported",
    "function_call": "tool calling is not supported",
    "best_of": "no beam or best-of search",
    "use_beam_search": "no beam or best-of search",
    "length_penalty": "no beam or best-of search",
    "echo": "the prompt is in the output's `prompt` column",
    "suffix": "no fill-in-the-middle",
    "chat_template": "one template per job: --chat-template",
    "logits_processors": "custom logits processors are not supported",
    "modalities": "text only",
    "audio": "text only",
    "prediction": "no predicted outputs",
    "reasoning_effort": "no reasoning controls",
    "service_tier": "no service tiers",
}
# Keys a plain row's request reads: never carried to the output as data.
REQUEST_FIELDS = frozenset(("id", "prompt", "messages", *OVERRIDABLE_FIELDS, *OPENAI_ALIASES, *STRUCTURED_ALIASES,
                            *CHAT_FIELDS, *UNSUPPORTED_FIELDS))
# Other APIs' names for request fields (Anthropic's, TGI's and Gemini's stop_sequences, Hugging Face generate's
# max_new_tokens and num_return_sequences, OpenAI Responses' and Gemini's max_output_tokens): a row giving one is
# told the field meant, as for a misspelling.
OTHER_API_NAMES = {"stop_sequences": "stop", "max_new_tokens": "max_tokens", "max_output_tokens": "max_tokens",
                   "num_return_sequences": "n"}
# The request fields a misspelt key is checked against: those that do something (a misspelt refused field would be
# refused anyway), but `id`, whose absence changes no result (an `ID` column stays data).
MEANT_FIELDS = frozenset(REQUEST_FIELDS - set(UNSUPPORTED_FIELDS) - {"id"})
MESSAGE_FIELDS = ("role", "content", "name")  # `name` reaches the template, as in OpenAI's API
JSON_TEXT = {b"tinyvllm.json_text": b"1"}  # metadata of a carried JSONL column whose values have no common type
PARQUET_BATCH_ROWS = 1024


@dataclass
class Row:
    index: int  # 0-based record number: the output's `row`, the key that resume skips by
    id: str
    prompt: str | list[int] | None = None  # text, or token ids
    messages: list[dict] | None = None  # chat: [{role, content}], rendered later with the chat template
    overrides: dict = field(default_factory=dict)  # SamplingParams fields, already validated
    chat_options: dict = field(default_factory=dict)  # CHAT_FIELDS given, checked
    ignored_fields: list[str] = field(default_factory=list)  # unsupported fields dropped (allow_unknown_fields)
    columns: dict = field(default_factory=dict)  # the input's other columns, carried to the output
    error: str | None = None  # set: the row is bad and becomes an error row with this reason


@dataclass
class Request:
    """What a row asks for (parse_request's result)."""

    prompt: str | list[int] | None
    messages: list[dict] | None
    overrides: dict
    chat_options: dict
    ignored_fields: list[str]


class BadRow(ValueError):
    pass


@dataclass(frozen=True)
class InputOptions:
    """How a job reads its input: the columns of plain rows that hold the prompt and the messages (instead of
    `prompt` and `messages`), and how many records to read."""

    prompt_column: str | None = None  # None: `prompt`
    messages_column: str | None = None  # None: `messages`
    limit: int | None = None  # read only the first `limit` records; None: all

    def renames(self) -> dict[str, tuple[str, str]]:
        """{column: (the request field it holds, the option that says so)} for the columns mapped."""
        return {column: (target, flag) for column, target, flag in (
            (self.prompt_column, "prompt", "--prompt-column"), (self.messages_column, "messages", "--messages-column"))
                if column is not None and column != target}

    def identity(self) -> dict:
        """The options given, for a job's identity: a job over the first 10 rows is not the job over them all."""
        return {k: v for k, v in asdict(self).items() if v is not None}


NO_OPTIONS = InputOptions()


def read_rows(path: str | Path, columns: pa.Schema | None = None, allow_unknown_fields: bool = False,
              options: InputOptions = NO_OPTIONS) -> Iterator[Row]:
    """Rows of a JSONL or Parquet file, in file order, carrying the input `columns` (from input_columns()).
    Raises JobError now if the file itself is unusable."""
    return _rows(_records(Path(path), options), columns or pa.schema([]), allow_unknown_fields)


def count_rows(path: str | Path, options: InputOptions = NO_OPTIONS) -> int:
    """Number of records (for a progress bar): Parquet from its footer, JSONL by a quick scan of non-blank lines."""
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        count = pq.ParquetFile(path).metadata.num_rows
        return count if options.limit is None else min(count, options.limit)
    count = 0
    with open(path, "rb") as f:
        for line in f:
            if options.limit is not None and count >= options.limit:
                break
            count += bool(line.strip())
    return count


def input_columns(path: str | Path, keep: list[str] | None = None, drop: bool = False,
                  options: InputOptions = NO_OPTIONS) -> pa.Schema:
    """The input's columns a job carries to its output: those no request reads (all, `keep` only, or none when
    `drop`), with their Arrow types: a Parquet file's own; a JSONL key's from its values over the records read
    (null where a row lacks it; ints and floats make float64; values with no common type are carried as JSON text).
    JobError: a `keep` column the input does not have."""
    path = Path(path)
    records = _records(path, options)  # checks the file
    if drop:
        return pa.schema([])
    if path.suffix.lower() in PARQUET_SUFFIXES:
        schema = pq.read_schema(path)
        data = _data_fields(_renamed_names(schema.names, options), "custom_id" in schema.names)
        fields = [schema.field(name).remove_metadata() for name in data]
    else:
        fields = _jsonl_fields(records)
    if keep is not None:
        present = {f.name for f in fields}
        missing = [name for name in keep if name not in present]
        if missing:
            raise JobError(f"--keep-columns: the input {path} has no data column {missing[0]!r} (columns: "
                           f"{', '.join(sorted(present)) or 'none'}; request fields are not carried)")
        fields = [f for f in fields if f.name in keep]
    return pa.schema(fields)


def _data_fields(names, openai: bool) -> list[str]:
    """Of a record's keys, those that are data (carried), not request fields."""
    request = OPENAI_LINE_FIELDS if openai else REQUEST_FIELDS
    return [name for name in names if name not in request]


def _jsonl_fields(records: Iterator[tuple[int, str, object, str | None]]) -> list[pa.Field]:
    types: dict[str, pa.DataType | None] = {}  # None: no common type (carried as JSON text)
    openai = None
    for _, _, obj, problem in records:
        if problem is not None or not isinstance(obj, dict):
            continue
        if openai is None:
            openai = "custom_id" in obj
        if openai and "custom_id" not in obj:  # a plain row in a batch file: an error row, its keys not data
            continue
        for name in _data_fields(obj, openai):
            if name in types and types[name] is None:
                continue
            kind = _json_type(obj[name])
            types[name] = kind if name not in types or kind is None else _common_type(types[name], kind)
    return [pa.field(name, kind) if kind is not None else pa.field(name, pa.string(), metadata=JSON_TEXT)
            for name, kind in types.items()]


def _json_type(value: object) -> pa.DataType | None:
    for kind, arrow in ((type(None), pa.null()), (bool, pa.bool_()), (str, pa.string()), (float, pa.float64())):
        if isinstance(value, kind):
            return arrow
    if isinstance(value, int):
        return pa.int64() if -(2**63) <= value < 2**63 else None
    try:
        return pa.array([value]).type
    except (pa.ArrowException, OverflowError):  # a list of mixed types, an integer beyond 64 bits
        return None


def _common_type(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    if a == b:
        return a
    try:
        return pa.unify_schemas([pa.schema([("x", a)]), pa.schema([("x", b)])],
                                promote_options="permissive").field("x").type
    except (pa.ArrowException, ValueError):
        return None


def _records(path: Path, options: InputOptions = NO_OPTIONS) -> Iterator[tuple[int, str, object, str | None]]:
    """(index, where, parsed object, problem) per record, `options` applied; checks the file eagerly."""
    try:
        is_file = path.is_file()
    except OSError as e:  # a name over the file system's limit (ENAMETOOLONG), a folder that cannot be searched
        raise JobError(f"cannot read input {path}: {e.strerror}") from None
    if not is_file:
        raise JobError(f"input not found: {path}" if not path.exists() else f"input is not a file: {path}")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        try:
            open(path, "rb").close()
        except OSError as e:
            raise JobError(f"cannot read input {path}: {e.strerror}") from None
        return _selected(_jsonl_records(path), options)
    if suffix in PARQUET_SUFFIXES:
        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a corrupt or foreign file
            raise JobError(f"cannot read Parquet input {path}: {e}") from None
        _check_parquet_columns(path, parquet.schema_arrow.names, options)
        return _selected(_parquet_records(parquet), options)
    raise JobError(f"unsupported input format {suffix or '(no extension)'!r}: use .jsonl or .parquet ({path})")


def _selected(records: Iterator[tuple[int, str, object, str | None]],
              options: InputOptions) -> Iterator[tuple[int, str, object, str | None]]:
    """The first `options.limit` records, their mapped columns renamed to the request fields they hold."""
    renames = options.renames()
    try:
        for record in records:
            index, where, obj, problem = record
            if options.limit is not None and index >= options.limit:
                return
            if renames and problem is None and isinstance(obj, dict):
                obj, problem = _renamed(obj, renames)
            yield index, where, obj, problem
    finally:
        records.close()  # the file, now


def _renamed(obj: dict, renames: dict[str, tuple[str, str]]) -> tuple[dict, str | None]:
    """A plain record with its mapped columns under the names of the request fields they hold, or why not."""
    if "custom_id" in obj:  # an OpenAI batch line: its request is its body
        return obj, None
    out = dict(obj)
    for column, (target, flag) in renames.items():
        if out.get(column) is None:
            out.pop(column, None)
            continue
        if out.get(target) is not None:
            return obj, f"has both {column!r} ({flag}) and {target!r}: give one"
        out[target] = out.pop(column)
    if out.get("prompt") is None and out.get("messages") is None:
        names = [f"{column!r} ({flag})" for column, (_, flag) in renames.items()]
        names += [target for target in ("prompt", "messages") if target not in {t for t, _ in renames.values()}]
        return obj, f"missing {' or '.join(names)}"
    return out, None


def _renamed_names(names: list[str], options: InputOptions) -> list[str]:
    renames = options.renames()
    return [renames[name][0] if name in renames else name for name in names]


def _check_parquet_columns(path: Path, names: list[str], options: InputOptions) -> None:
    """JobUsageError unless the schema has the columns the rows' requests need: one line, before any row runs."""
    if "custom_id" in names:  # OpenAI batch rows: the request is in `body`
        return
    listing = ", ".join(names[:30]) + (f", ... ({len(names)} in all)" if len(names) > 30 else "") or "none"
    for column, (target, flag) in options.renames().items():
        if column not in names:
            raise JobUsageError(f"{flag} {column}: the input {path} has no column {column!r} (columns: {listing})")
        if target in names:
            raise JobUsageError(f"{flag} {column}: the input {path} has a {target!r} column too: leave the option "
                                f"out, or rename one of them")
    if not {"prompt", "messages"} & set(_renamed_names(names, options)):
        meant = [(name, misspelt_request_field(name)) for name in names]
        hints = [f"--{target}-column {name}" for name, target in meant if target in ("prompt", "messages")]
        raise JobUsageError(f"the input {path} has no prompt or messages column (columns: {listing}): name the one "
                            f"to use with {' or '.join(hints) or '--prompt-column NAME or --messages-column NAME'}")


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


def missing_as_none(obj: dict) -> dict:
    """A tabular row's request fields with NaN as None: pandas writes a missing number in a float column as NaN,
    and a missing request field is absent, like null (data columns keep theirs)."""
    return {k: (None if k in REQUEST_FIELDS and isinstance(v, float) and math.isnan(v) else v) for k, v in obj.items()}


def _parquet_records(parquet: pq.ParquetFile) -> Iterator[tuple[int, str, object, str | None]]:
    index = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for obj in batch.to_pylist():
            yield index, f"row {index}", missing_as_none(obj), None
            index += 1


def _rows(records: Iterator[tuple[int, str, object, str | None]], columns: pa.Schema,
          allow_unknown: bool) -> Iterator[Row]:
    seen: set[str] = set()
    openai: bool | None = None  # decided by the first object of the file
    for index, where, obj, problem in records:
        if problem is None and not isinstance(obj, dict):
            problem = f"not a JSON object (got {type(obj).__name__})"
        if problem is not None:
            yield Row(index, str(index), error=f"{where}: {problem}")
            continue
        carried = _carried(obj, columns)
        if openai is None:
            openai = "custom_id" in obj
        try:
            row_id = _row_id(obj, openai)
        except BadRow as e:
            yield Row(index, str(index), columns=carried, error=f"{where}: {e}")
            continue
        # Ids given must be unique; a row without one is known by its row number, which no given id can clash with
        # (the output's `row` column tells them apart).
        if row_id is None:
            row_id = str(index)
        elif row_id in seen:
            yield Row(index, row_id, columns=carried, error=f"{where}: duplicate id {row_id!r} (an earlier row has it)")
            continue
        else:
            seen.add(row_id)
        try:
            request = _parse_openai(obj, allow_unknown) if openai else _parse_plain(obj, allow_unknown)
        except BadRow as e:
            yield Row(index, row_id, columns=carried, error=f"{where}: {e}")
            continue
        yield Row(index, row_id, request.prompt, request.messages, request.overrides, request.chat_options,
                  request.ignored_fields, carried)


def _carried(obj: dict, columns: pa.Schema) -> dict:
    """The row's values of the carried columns (null where it lacks one), as parsed."""
    out = {}
    for f in columns:
        value = obj.get(f.name)
        if f.metadata == JSON_TEXT and value is not None:
            value = json.dumps(value, ensure_ascii=False)
        out[f.name] = value
    return out


def _row_id(obj: dict, openai: bool) -> str | None:
    """The id the row gives, or None."""
    key = "custom_id" if openai else "id"
    value = obj.get(key)
    if value is None:
        if openai and ("prompt" in obj or "messages" in obj):
            raise BadRow("a plain row in an OpenAI batch file (its first line has custom_id): every line needs "
                         "custom_id, method, url and body")
        if openai:
            raise BadRow("missing custom_id")
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise BadRow(f"{key} must be a non-empty string or an integer, got {value!r:.80}")
    return str(value)


def parse_request(obj: dict, allow_unknown_fields: bool = False) -> Request:
    """What one row object asks for, plain or OpenAI batch (it has `custom_id`). BadRow says what is wrong."""
    return _parse_openai(obj, allow_unknown_fields) if "custom_id" in obj else _parse_plain(obj, allow_unknown_fields)


def _parse_plain(obj: dict, allow_unknown: bool) -> Request:
    _check_misspelt(obj, allow_unknown)
    fields = {k: v for k, v in obj.items() if k in REQUEST_FIELDS and k != "id" and v is not None}
    return _request(fields, allow_unknown, chat=None)


def _check_misspelt(obj: dict, allow_unknown: bool) -> None:
    """BadRow for a plain row's key that misspells a request field, naming the field meant: such a key is not data.
    A near miss of prompt or messages counts only in a row without either (`prompts` beside `prompt` is data); with
    allow_unknown only there (the row cannot run), the others are carried as data."""
    has_prompt = obj.get("prompt") is not None or obj.get("messages") is not None
    misspelt = {}
    for name, value in obj.items():
        meant = misspelt_request_field(name) if value is not None else None
        if meant is not None and not (has_prompt if meant in ("prompt", "messages") else allow_unknown):
            misspelt[name] = meant
    if misspelt:
        names = ", ".join(f"{name!r} (did you mean {meant!r}?)" for name, meant in misspelt.items())
        data = [name for name, meant in misspelt.items() if meant not in ("prompt", "messages")]
        kept = "it as a data column" if len(data) == 1 else "them as data columns"
        keep = f"; --allow-unknown-fields keeps {kept}" if data else ""
        raise BadRow(f"unknown field{'s' * (len(misspelt) > 1)} {names}{keep}")


@lru_cache(maxsize=4096)
def misspelt_request_field(name: str) -> str | None:
    """The request field a key that is none means (`max_token`: max_tokens), or None: it is like none of them."""
    if name in REQUEST_FIELDS:
        return None
    return OTHER_API_NAMES.get(nearest(name, OTHER_API_NAMES) or "") or nearest(name, MEANT_FIELDS)


def _parse_openai(obj: dict, allow_unknown: bool) -> Request:
    if obj.get("method", "POST") != "POST":
        raise BadRow(f"unsupported method {obj.get('method')!r:.40} (only POST)")
    url = obj.get("url")
    if url not in OPENAI_URLS:
        raise BadRow(f"unsupported url {url!r:.80} (expected one of {', '.join(OPENAI_URLS)})")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadRow("body must be a JSON object")
    fields = {k: v for k, v in body.items() if v is not None and k not in IGNORED_FIELDS}
    return _request(fields, allow_unknown, chat=url == "/v1/chat/completions")


def _request(fields: dict, allow_unknown: bool, chat: bool | None) -> Request:
    """A Request from a row's request fields (null ones left out). `chat`: an OpenAI body for the chat endpoint
    (True) or the completions one (False), where every other field is refused; None: a plain row."""
    ignored: list[str] = []

    def refuse(name: str) -> None:
        if not allow_unknown:
            why = UNSUPPORTED_FIELDS.get(name)
            meant = misspelt_request_field(name) if why is None else None
            why = why or (f"did you mean {meant!r}?" if meant is not None else None)
            raise BadRow(f"unsupported field {name!r}" + (f" ({why})" if why else ""))
        if name not in ignored:
            ignored.append(name)

    if fields.get("stream") is False:
        del fields["stream"]
    overrides = {k: fields.pop(k) for k in OVERRIDABLE_FIELDS if k in fields}
    if "max_completion_tokens" in fields:  # the newer name wins, as in OpenAI's API
        overrides["max_tokens"] = fields.pop("max_completion_tokens")
    top_logprobs = fields.pop("top_logprobs", None)
    if overrides.get("logprobs") is True:
        overrides["logprobs"] = top_logprobs if top_logprobs is not None else 0  # 0: the sampled token's only
    elif overrides.get("logprobs") is False:
        del overrides["logprobs"]
        if top_logprobs is not None:
            raise BadRow("top_logprobs needs logprobs: true")
    elif top_logprobs is not None:
        raise BadRow("top_logprobs needs logprobs: true")
    structured = _structured_outputs(overrides.pop("structured_outputs", None),
                                     {k: fields.pop(k) for k in STRUCTURED_ALIASES if k in fields})
    if structured is not None:
        overrides["structured_outputs"] = structured
    chat_options = _checked_chat_options({k: fields.pop(k) for k in CHAT_FIELDS if k in fields})
    prompt, messages = fields.pop("prompt", None), fields.pop("messages", None)
    for name in sorted(fields):
        refuse(name)
    if chat is True and prompt is not None:
        raise BadRow("/v1/chat/completions takes messages, not prompt")
    if chat is False and messages is not None:
        raise BadRow("/v1/completions takes prompt, not messages")
    prompt, messages = _prompt_or_messages(prompt, messages, refuse)
    return Request(prompt, messages, _checked_overrides(overrides), chat_options, ignored)


def _structured_outputs(given: object, aliases: dict) -> object:
    """The row's structured_outputs, from that field or one of its other names (at most one way)."""
    ways = (["structured_outputs"] if given is not None else []) + (["response_format"] if "response_format" in
                                                                   aliases else [])
    guided = {GUIDED_FIELDS[k]: v for k, v in aliases.items() if k in GUIDED_FIELDS}
    if guided:
        ways.append("guided_*")
    if len(ways) > 1:
        raise BadRow(f"give one of {' and '.join(ways)}: both constrain the output")
    if "response_format" in aliases:
        return _response_format(aliases["response_format"])
    return guided or given


def _response_format(fmt: object) -> dict | None:
    """OpenAI's response_format as structured_outputs (None: plain text)."""
    if isinstance(fmt, str):  # a Parquet string column holds it as JSON text
        try:
            fmt = json.loads(fmt)
        except ValueError:
            raise BadRow("response_format must be an object (or its JSON text)") from None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRow("response_format of type json_schema needs json_schema.schema")
        unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
        if unknown:
            raise BadRow(f"unsupported response_format.json_schema field(s): {', '.join(unknown)}")
        return {"json": spec["schema"]}  # strict or not, the schema is enforced
    raise BadRow(f"unsupported response_format {fmt!r:.60}: its type must be text, json_object or json_schema")


def _checked_chat_options(options: dict) -> dict:
    kwargs = options.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRow(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in options and not isinstance(options[name], bool):
            raise BadRow(f"invalid {name}={options[name]!r:.40}: must be true or false")
    return options


def _is_token_id(value: object) -> bool:
    """A JSON integer (true and false are not ids)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_or_messages(prompt: object, messages: object,
                        refuse) -> tuple[str | list[int] | None, list[dict] | None]:
    if prompt is not None and messages is not None:
        raise BadRow("has both prompt and messages (give one)")
    if prompt is None and messages is None:
        raise BadRow("missing prompt or messages")
    if messages is not None:
        return None, _checked_messages(messages, refuse)
    if isinstance(prompt, str):
        if not prompt:
            raise BadRow("prompt is empty")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(map(_is_token_id, prompt)):
        if min(prompt) < 0:
            raise BadRow("prompt token ids must be >= 0")
        return prompt, None
    if isinstance(prompt, list) and not prompt:
        raise BadRow("prompt is empty")
    if isinstance(prompt, list) and all(isinstance(t, str) for t in prompt):
        raise BadRow("prompt is a list of texts (several prompts in one request, as OpenAI's /v1/completions "
                     "allows): give each prompt a row of its own")
    if isinstance(prompt, list):
        bad = next(t for t in prompt if not _is_token_id(t))
        raise BadRow(f"prompt token ids must be integers, got {json.dumps(bad, default=repr)[:40]}")
    raise BadRow(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def _checked_messages(messages: object, refuse) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRow("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRow(f"messages[{i}] must be an object with role and content")
        for name in sorted(set(m) - set(MESSAGE_FIELDS)):
            if m[name] is not None:
                refuse(f"messages[].{name}")
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
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRow(f"messages[{i}].name must be a string")
        out.append({"role": role, "content": content} if name is None else {"role": role, "content": content,
                                                                            "name": name})
    return out


def _checked_overrides(overrides: dict) -> dict:
    if not overrides:  # nothing to check (the check makes two SamplingParams: most of a plain row's parsing)
        return overrides
    for name in INT_FIELDS:  # 32.0 is 32; 32.5 stays invalid
        value = overrides.get(name)
        if isinstance(value, float) and value.is_integer():
            overrides[name] = int(value)
    for name in ONE_OR_LIST_FIELDS:
        if isinstance(overrides.get(name), str):
            overrides[name] = [overrides[name]]
    try:
        # The one place that knows what is valid. The job's max_tokens is not known here: min_tokens is checked
        # against it once the row's SamplingParams are made (prepare_request).
        SamplingParams(max_tokens=INT32_MAX).with_overrides(overrides)
    except (ValueError, TypeError) as e:
        raise BadRow(str(e)) from None
    return overrides
