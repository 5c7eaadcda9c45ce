"""Crash-safe output: finished rows are committed in small Parquet pieces under `<output>.parts/` (each written
to a temp name, fsynced, renamed), then merged in input order into one Parquet file renamed into place, with a
JSON summary next to it. A kill at any moment loses at most the rows not yet committed.

Every file is first written under a temp name inside `<output>.parts/` that no other write can have (a random
token), created exclusively and never through a link, and locked while it is written: a temp file is removed only
by its writer or, once unlocked, by a later run (its writer is dead). Pieces carry the run's id in their names, so
two runs never produce the same piece. finalize() writes the output only when every input row is in a piece; a row
committed twice (a piece copied, two runs) is kept once.

Each piece's key-value metadata records the job's identity (the one `manifest.json` holds, so that a lost manifest
is rebuilt from the pieces: jobs/resume.py) and a checksum of its rows, checked when a later run resumes: a piece
whose rows were changed after they were committed is set aside and its rows computed again."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tinyvllm.config import INT32_MAX, Setting, settings
from tinyvllm.errors import JobError
from tinyvllm.logprobs import FlatLogprobs, LogprobBlock
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.sampling_params import SamplingParams

PIECE_ROWS = 256  # rows per piece at most ...
PIECE_SECONDS = 2.0  # ... and a finished row waits at most this long to be committed
FINAL_BATCH_ROWS = 1024
LATENCIES = ("queue_ms", "ttft_ms", "tpot_ms", "e2e_ms")
_TOP = pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float64())]))
# Output formats by the output's extension: Parquet, or the OpenAI Batch API's output JSONL.
OUTPUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "openai"}
OPENAI_LINE_KEYS = ("custom_id", "response")  # an OpenAI output line's keys besides `id` and `error`
JOB_KEY, CHECKSUM_KEY = b"tinyvllm.job", b"tinyvllm.rows_sha256"  # a piece's (and the output's) metadata keys


def _arrow_type(s: Setting) -> pa.DataType:
    """A SamplingParams setting's column type, from its declaration: an integer as the narrowest of int32, int64 and
    uint64 its bounds fit; a {token id: value} dict as a map; a class of its own (structured_outputs) as its JSON
    text."""
    if s.kind is None:
        return pa.string()
    high = s.meta["high"]
    scalar = {bool: pa.bool_(), float: pa.float64(), str: pa.string(),
              int: pa.int32() if high is not None and high <= INT32_MAX else
              pa.int64() if high is None or high < 2**63 else pa.uint64()}[s.kind]
    if s.container is list:
        return pa.list_(scalar)
    return pa.map_(pa.int32(), scalar) if s.container is dict else scalar


# The `sampling` column: every SamplingParams field a row may set, as the row ran with it. One type for every job,
# so that the pieces of any run of a job concatenate.
SAMPLING_FIELDS = tuple(s for s in settings(SamplingParams) if s.meta["per_row"])
SAMPLING_TYPE = pa.struct([(s.name, _arrow_type(s)) for s in SAMPLING_FIELDS])
_SAMPLING_NAMES = SAMPLING_TYPE.names


def sampling_record(params: SamplingParams, max_tokens: int | None = None) -> dict:
    """The `sampling` value of a row that ran with `params`; `max_tokens`: the limit the engine applied where
    params.max_tokens is None (up to the context)."""
    values = vars(params)  # once per row: a dict lookup per field, not getattr
    rec = {name: values[name] for name in _SAMPLING_NAMES}
    if rec["structured_outputs"] is not None:
        rec["structured_outputs"] = rec["structured_outputs"].key()
    if rec["max_tokens"] is None:
        rec["max_tokens"] = max_tokens
    return rec


def output_schema(token_ids: bool = False, columns: pa.Schema | None = None) -> pa.Schema:
    """The output's columns: the results (logprob and n > 1 columns always, null where a row did not ask),
    completion_token_ids if `token_ids`, then the input's carried `columns`."""
    cols = [("row", pa.int64()), ("id", pa.string()), ("prompt", pa.string()), ("completion", pa.string()),
            ("finish_reason", pa.string()), ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()),
            ("error", pa.string())]
    cols += [(name, pa.float64()) for name in LATENCIES]
    cols += [("finished_at", pa.float64()),  # unix seconds, for throughput over time
             ("chat", pa.bool_()),  # the prompt is a chat rendered with the template
             ("ignored_fields", pa.list_(pa.string())),  # unsupported fields dropped (--allow-unknown-fields)
             # with a structured_outputs constraint: the output matches it in full (false: max_tokens or a stop
             # string ended it first); null without one
             ("structured_output_complete", pa.bool_()),
             ("sampling", SAMPLING_TYPE)]  # the row's SamplingParams (sampling_record); null on error rows
    if token_ids:
        cols += [("completion_token_ids", pa.list_(pa.int32()))]
    # The first completion's logprobs: the sampled token's per position, and the top ones (sampled included) at each;
    # the prompt's: each prompt token's (null for the first) and the top ones.
    cols += [("cumulative_logprob", pa.float64()), ("logprobs", pa.list_(pa.float64())),
             ("top_logprobs", pa.list_(_TOP)), ("prompt_logprobs", pa.list_(pa.float64())),
             ("prompt_top_logprobs", pa.list_(_TOP))]
    # n > 1: each completion's text, token count, finish reason and cumulative logprob (the first is `completion`).
    cols += [("completions", pa.list_(pa.string())), ("completions_tokens", pa.list_(pa.int32())),
             ("completions_finish_reasons", pa.list_(pa.string())),
             ("completions_cumulative_logprobs", pa.list_(pa.float64()))]
    return pa.schema(cols + list(columns or []))


def schema_digest() -> str:
    """A digest of every result column (names and types): part of a job's identity, so that pieces or an output
    written with other columns (another tinyvllm version's) are never taken for this job's."""
    return hashlib.sha256(str(output_schema(token_ids=True)).encode()).hexdigest()[:16]


def output_format(output: Path) -> str:
    """"parquet" or "openai" (the OpenAI Batch API's output JSONL), by the output's extension; JobError else."""
    fmt = OUTPUT_FORMATS.get(output.suffix.lower())
    if fmt is None:
        raise JobError(f"unsupported output format {output.suffix or '(no extension)'!r}: use .parquet, or .jsonl "
                       f"for the OpenAI Batch API's output format ({output})")
    return fmt


class RowSet:
    """A set of row numbers as one byte per row up to the largest (rows are numbered densely from 0): a resumed
    job of 10^8 rows holds 100 MB here, not the ~6 GB of a Python set of ints."""

    def __init__(self) -> None:
        self._rows = np.zeros(0, bool)
        self._count = 0

    def update(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            return
        if rows.max() >= len(self._rows):
            grown = np.zeros(max(int(rows.max()) + 1, 2 * len(self._rows)), bool)
            grown[: len(self._rows)] = self._rows
            self._rows = grown
        self._count += len(np.unique(rows[~self._rows[rows]]))
        self._rows[rows] = True

    def __contains__(self, row: int) -> bool:
        return 0 <= row < len(self._rows) and bool(self._rows[row])

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        return (int(row) for row in np.flatnonzero(self._rows))

    def to_bytes(self) -> bytes:
        """The set as one bit per row (from_bytes reads it back): what a job's row preparation worker skips."""
        return np.packbits(self._rows).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> RowSet:
        rows = cls()
        rows._rows = np.unpackbits(np.frombuffer(data, np.uint8)).astype(bool)
        rows._count = int(rows._rows.sum())
        return rows


def output_record(index: int, row_id: str, prompt: str | list[int] | None,
                  out: RequestOutput | None = None, error: str | None = None, *, extras: dict | None = None,
                  sampling: dict | None = None) -> dict:
    """One output row: from the engine's RequestOutput, or from a row that failed before reaching it. `extras`:
    further columns (the row's carried input columns, `chat`, `ignored_fields`); `sampling`: the row's
    sampling_record(), kept unless the row failed."""
    comps = out.outputs if out is not None else []
    comp = comps[0] if comps else None
    if error is None and out is not None:
        error = out.error or (None if comp else "engine returned no completion")
    ok = error is None
    metrics = out.metrics if out is not None else None
    rec = {
        "row": index, "id": row_id, "prompt": prompt if isinstance(prompt, str) else None,
        "completion": comp.text if ok else None,
        "finish_reason": comp.finish_reason if ok else "error",
        "prompt_tokens": len(out.prompt_token_ids) if out is not None and out.prompt_token_ids else None,
        "completion_tokens": sum(len(c.token_ids) for c in comps) if ok else 0,  # all n, as OpenAI's usage
        "error": error, "finished_at": time.time(),
        "completion_token_ids": comp.token_ids if ok else None,
        "structured_output_complete": comp.structured_output_complete if ok else None,
        "sampling": sampling if ok else None,
    }
    rec.update({name: getattr(metrics, name) if metrics else None for name in LATENCIES})
    if ok and comp.logprobs is not None:
        rec["cumulative_logprob"] = comp.cumulative_logprob
        rec["logprobs"], rec["top_logprobs"] = _logprob_columns(comp.token_ids, comp.logprobs)
    if ok and out.prompt_logprobs is not None:
        rec["prompt_logprobs"] = [_logprob_value(d.get(t)) if d is not None else None
                                  for t, d in zip(out.prompt_token_ids, out.prompt_logprobs)]
        rec["prompt_top_logprobs"] = [_top(d) if d is not None else None for d in out.prompt_logprobs]
    if ok and len(comps) > 1:
        rec["completions"] = [c.text for c in comps]
        rec["completions_tokens"] = [len(c.token_ids) for c in comps]
        rec["completions_finish_reasons"] = [c.finish_reason for c in comps]
        rec["completions_cumulative_logprobs"] = [c.cumulative_logprob for c in comps]
    rec.update(extras or {})
    return rec


def _logprob_columns(token_ids: list[int], entries) -> tuple[list, list]:
    """A completion's `logprobs` (each token's own) and `top_logprobs` (_top of each entry) columns; the blocks of
    the engine's FlatLogprobs straight from their arrays (_block_columns), without a dict per token."""
    parts = entries.parts() if isinstance(entries, FlatLogprobs) else [entries]
    values, tops, start = [], [], 0
    for part in parts:
        columns = _block_columns(part) if isinstance(part, LogprobBlock) else None
        if columns is None:
            part = part.entries() if isinstance(part, LogprobBlock) else part
            columns = ([_logprob_value(d.get(t)) for t, d in zip(token_ids[start:], part)], [_top(d) for d in part])
        values += columns[0]
        tops += columns[1]
        start += len(columns[1])
    return values, tops


def _block_columns(block: LogprobBlock) -> tuple[list, list] | None:
    """_logprob_columns of a block's positions from its arrays: the entries its dicts would hold (the top k not
    forbidden, the token's own value in place of its top one, the token last if not among them), most likely first,
    ties in that order (a stable sort, as _top's); None where a value is NaN or the token's is infinite (_top's
    order of those is Python's sort's) or a position repeats a top id (its dict keeps one), for the dicts' path."""
    own, tokens = block.token_logprobs, block.token_ids
    ids, top = block.top_ids[:, :block.k], block.top_logprobs[:, :block.k]
    if (np.isnan(top).any() or not np.isfinite(own).all()
            or (block.k > 1 and (np.diff(np.sort(ids, 1), axis=1) == 0).any())):
        return None
    kept = top > -np.inf
    in_top = kept & (ids == tokens[:, None])
    present = np.concatenate([kept, ~in_top.any(1, keepdims=True)], 1)
    all_ids = np.concatenate([ids, tokens[:, None]], 1)
    all_values = np.concatenate([np.where(in_top, own[:, None], top), own[:, None]], 1)
    order = np.argsort(np.where(present, -all_values, np.inf), axis=1, kind="stable")
    sorted_ids = np.take_along_axis(all_ids, order, 1).tolist()
    sorted_values = np.take_along_axis(all_values, order, 1).tolist()
    tops = [[{"token_id": t, "logprob": v} for t, v in zip(row_ids[:n], row_values[:n])]
            for row_ids, row_values, n in zip(sorted_ids, sorted_values, present.sum(1).tolist())]
    return own.tolist(), tops


def _logprob_value(entry: Logprob | float | None) -> float | None:
    """A logprob entry's value: the engine's outputs hold floats, LLM's hold vLLM's Logprob objects."""
    return entry.logprob if isinstance(entry, Logprob) else entry


def _top(logprobs: dict[int, Logprob] | dict[int, float]) -> list[dict]:
    values = {t: _logprob_value(p) for t, p in logprobs.items()}
    return [{"token_id": t, "logprob": p} for t, p in sorted(values.items(), key=lambda kv: -kv[1])]


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def lock_path(output: Path) -> Path:
    """The file a run locks for its whole life (jobs/guard.py): inside the parts folder, with the job's rows."""
    return parts_dir(output) / "lock"


def sibling(output: Path, suffix: str) -> Path:
    """A file next to the output: out.parquet (or out.jsonl) -> out<suffix>."""
    name = next((output.name[: -len(ext)] for ext in (".parquet", ".jsonl") if output.name.endswith(ext)),
                output.name)
    return output.with_name(name + suffix)


def summary_path(output: Path) -> Path:
    return sibling(output, ".summary.json")


class PartsWriter:
    """Buffers finished rows and commits them as pieces; finalize() assembles the output file.

    A commit (the rows to an Arrow table, the piece written and fsynced) runs on a thread of its own, one at a time,
    so the caller's thread goes on running the engine; flush() returns once every commit is durable, and an error
    of one is raised by the next maybe_flush(), flush() or finalize(). `committed` counts only durable rows.

    `num_rows` is the input's row count: a piece holding other rows is set aside, and finalize() refuses to write an
    output without every row 0..num_rows-1. `guard()` runs before every commit and raises if this run may no longer
    write (it lost its lock)."""

    def __init__(self, output: Path, schema: pa.Schema, run_started: float, num_rows: int,
                 piece_rows: int = PIECE_ROWS, piece_seconds: float = PIECE_SECONDS,
                 guard: Callable[[], None] = lambda: None, job: dict | None = None):
        self.output, self.parts, self.num_rows, self.job = output, parts_dir(output), num_rows, job
        self.schema = schema.with_metadata({"tinyvllm.run_started": json.dumps(run_started)})
        self.piece_rows, self.piece_seconds, self._guard = piece_rows, piece_seconds, guard
        self.run_id = secrets.token_hex(6)
        try:
            self.parts.mkdir(parents=True, exist_ok=True)
            remove_dead_temps(self.parts)
            self.damaged = self._set_aside_damaged()
        except OSError as e:
            raise JobError(f"cannot write output pieces in {self.parts}: {e.strerror}") from None
        self._seq = 0
        self._buffer: list[dict] = []
        self._oldest = 0.0
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="tinyvllm-commit")
        self._commit: Future | None = None  # the commit in flight
        self.committed = 0  # rows committed by this run
        self.summary_extra: dict = {}  # what the summary adds about this run (retried_rows)

    def pieces(self) -> list[Path]:
        return sorted(self.parts.glob("piece-*.parquet"))

    def committed_rows(self) -> RowSet:
        """Row numbers already committed by earlier runs (what a resumed run skips)."""
        done = RowSet()
        for piece in self.pieces():
            done.update(_read_piece(piece, ["row"]).column("row").to_numpy())
        return done

    def _set_aside_damaged(self) -> list[str]:
        """Rename the pieces this job cannot use to `*.damaged` (their rows count as not done, so they are computed
        again); return what is wrong with each."""
        damaged = []
        for piece in self.pieces():
            problem = self._piece_problem(piece)
            if problem is None:
                continue
            try:
                os.replace(piece, piece.with_name(piece.name + ".damaged"))
            except FileNotFoundError:  # not damaged but gone (see _read_piece)
                continue
            damaged.append(f"{piece.name}: {problem}")
        return damaged

    def _piece_problem(self, piece: Path) -> str | None:
        try:
            table = pq.ParquetFile(piece).read()
            float(json.loads(table.schema.metadata[b"tinyvllm.run_started"]))
        except Exception as e:  # pyarrow raises several types for a damaged file; a foreign one lacks our metadata
            return f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
        if not table.schema.equals(self.schema, check_metadata=False):
            return "its columns are not this job's"
        rows = table.column("row")
        if not len(rows) or rows.null_count:
            return "no row numbers"
        rows = rows.to_numpy()
        if np.any(np.diff(rows) <= 0):
            return "its rows are not in increasing order"
        if rows[0] < 0 or rows[-1] >= self.num_rows:
            return f"it holds rows outside the input's 0..{self.num_rows - 1}"
        digest = table.schema.metadata.get(CHECKSUM_KEY)
        if digest is not None and digest.decode() != rows_sha256(table):
            return "its rows were changed after they were committed (their checksum does not match)"
        return None

    def drop_error_rows(self) -> int:
        """Take the error rows out of the committed pieces (each such piece replaced by one without them, or removed
        if they are all it holds), so that this run computes them again; return how many there were."""
        dropped = 0
        for piece in self.pieces():
            table = _read_piece(piece)
            errors = table.num_rows - table.column("error").null_count
            if errors == table.num_rows:
                self._guard()
                piece.unlink()
            elif errors:
                self._guard()
                self._write_piece(piece, table.filter(pc.is_null(table.column("error"))))
            dropped += errors
        return dropped

    def adopt_output(self, output: Path) -> int:
        """Commit the rows of a finished Parquet output of this job as pieces again, but for its error rows (this
        run computes them again); return how many error rows it had. The pieces keep the wall time the output
        took, which the summary adds to this run's."""
        source = pq.ParquetFile(output)
        counts = json.loads((source.schema_arrow.metadata or {}).get(b"tinyvllm.counts", b"{}"))
        last = pc.max(source.read(columns=["finished_at"]).column(0)).as_py() or 0.0
        metadata = {"tinyvllm.run_started": json.dumps(last - counts.get("wall_time_s", 0.0))}
        errors = 0
        for batch in source.iter_batches(batch_size=self.piece_rows):
            table = _conform(pa.Table.from_batches([batch]), self.schema)
            kept = table.filter(pc.is_null(table.column("error")))
            errors += table.num_rows - kept.num_rows
            if kept.num_rows:
                self._guard()
                self._write_piece(self._next_piece(), kept.replace_schema_metadata(metadata))
        return errors

    def add(self, record: dict) -> None:
        if not self._buffer:
            self._oldest = time.monotonic()
        self._buffer.append(record)
        self.maybe_flush()

    def maybe_flush(self) -> None:
        if self._buffer and (len(self._buffer) >= self.piece_rows
                             or time.monotonic() - self._oldest >= self.piece_seconds):
            self._start_commit()

    def flush(self) -> None:
        """Commit the rows buffered; return once every commit is durable."""
        self._start_commit()
        self._wait()

    def _start_commit(self) -> None:
        self._wait()  # one commit at a time: its error is raised here, before more rows are handed over
        if not self._buffer:
            return
        records, self._buffer = self._buffer, []  # if the commit fails these rows are not done: a resume redoes them
        self._guard()  # here: the rows were all read before it passes
        self._commit = self._committer.submit(self._commit_piece, records, self._seq)
        self._seq += 1

    def _wait(self) -> None:
        commit, self._commit = self._commit, None
        if commit is not None:
            commit.result()

    def _commit_piece(self, records: list[dict], seq: int) -> None:
        records.sort(key=lambda r: r["row"])  # sorted pieces let finalize() merge instead of sort
        self._write_piece(self.parts / f"piece-{self.run_id}-{seq:06d}.parquet", records_table(records, self.schema))
        self.committed += len(records)

    def _next_piece(self) -> Path:
        self._seq += 1
        return self.parts / f"piece-{self.run_id}-{self._seq - 1:06d}.parquet"

    def _write_piece(self, path: Path, table: pa.Table) -> None:
        """Write a piece: `table` (its metadata names the run that computed its rows) with the job's identity and
        the checksum of its rows as a reader of the file gets them back."""
        plain = pa.BufferOutputStream()
        pq.write_table(table, plain)
        metadata = {**table.schema.metadata, CHECKSUM_KEY: rows_sha256(pq.ParquetFile(pa.BufferReader(
            plain.getvalue())).read()).encode()}
        if self.job is not None:
            metadata[JOB_KEY] = json.dumps(self.job).encode()
        table = table.replace_schema_metadata(metadata)
        self._write(path, lambda f: pq.write_table(table, f))

    def discard(self) -> int:
        """Remove the pieces this run committed (the next run computes their rows again); return their row count."""
        self._wait()
        for piece in self.parts.glob(f"piece-{self.run_id}-*.parquet"):
            piece.unlink()
        return self.committed

    def finalize(self, metadata: dict, engine_stats: dict | None = None,
                 token_names: Callable[[], Callable[[int], TokenName]] = lambda: id_name) -> dict:
        """Merge the pieces into the output (input order), write the summary, drop the pieces; return the summary.

        `metadata` becomes the file's `tinyvllm.*` key-value metadata (values JSON-encoded), counts added;
        `engine_stats` (prefix-cache hit rate, preemptions) goes into both; `summary_extra` into the summary.
        `token_names()`: how the OpenAI output names logprobs' tokens, made once a row has logprobs."""
        self.flush()
        pieces = self.pieces()
        small = [_read_piece(piece, ["row", *SUMMARY_COLUMNS]) for piece in pieces]  # serves the check, the summary
        rows = [table.column("row").to_numpy() for table in small]  # and the merge's order
        self._check_every_row(pieces, rows)
        summary = {**_summarize_pieces(small, self.output), **self.summary_extra}
        if engine_stats:
            summary["engine_stats"] = metadata["engine_stats"] = engine_stats
        metadata = {**metadata, "counts": {k: summary[k] for k in
                                           ("rows", "error_rows", "finish_reasons", "prompt_tokens", "output_tokens",
                                            "wall_time_s")}}
        kv = {f"tinyvllm.{k}": json.dumps(v, default=str) for k, v in metadata.items()}
        schema = self.schema.with_metadata(kv)

        def write_parquet(f: BinaryIO) -> None:
            with pq.ParquetWriter(f, schema) as w:
                for table in _merged(pieces, self.schema, rows):
                    w.write_table(table)

        def write_openai(f: BinaryIO) -> None:
            model, token = str(metadata.get("model", "")), openai_token(metadata)
            data = [name for name in self.schema.names if name not in output_schema(True).names]
            names = None
            for table in _merged(pieces, self.schema, rows):
                for rec in table.to_pylist():
                    if names is None and rec["logprobs"] is not None:
                        names = token_names()
                    line = openai_line(rec, model, token, data, names or id_name)
                    f.write(json.dumps(line, ensure_ascii=False, default=str).encode() + b"\n")

        if output_format(self.output) == "openai":  # no key-value metadata in JSONL: the summary holds it
            summary["metadata"] = json.loads(json.dumps(metadata, default=str))
        self._guard()  # a run that lost its lock never replaces the output
        self._write(self.output, write_openai if output_format(self.output) == "openai" else write_parquet)
        self._write(summary_path(self.output), lambda f: f.write(json.dumps(summary, indent=2).encode() + b"\n"))
        self._guard()  # nor removes pieces that a run which took its lock is reading
        clear_parts(self.parts)
        return summary

    def _check_every_row(self, pieces: list[Path], piece_rows: list[np.ndarray]) -> None:
        """Every input row is in some piece (one in several is kept once by the merge): else the job is not done.
        piece_rows: each piece's row numbers."""
        seen = np.zeros(self.num_rows, bool)
        for piece, rows in zip(pieces, piece_rows):
            if len(rows) and (rows.min() < 0 or rows.max() >= self.num_rows):
                raise JobError(f"{piece} holds rows outside the input's 0..{self.num_rows - 1}, so it is not from "
                               "this job: remove it, or pass --overwrite to start over")
            seen[rows] = True
        missing = self.num_rows - int(np.count_nonzero(seen))
        if missing:
            raise JobError(f"not complete: {missing} of {self.num_rows} rows have no result (the first is row "
                           f"{int(np.argmin(seen))}); run the same command again to compute them")

    def _write(self, path: Path, write: Callable[[BinaryIO], None]) -> None:
        try:
            atomic_write(path, write, self.parts)
        except OSError as e:
            raise JobError(f"cannot write {path}: {e.strerror or e}; rows committed before are kept in {self.parts}: "
                           "fix that (disk space, permissions) and run the same command again to resume") from None


def rows_sha256(table: pa.Table) -> str:
    """A checksum of a table's rows: its columns in Arrow's IPC stream form, without the schema's metadata."""
    table = table.replace_schema_metadata(None).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as stream:
        stream.write_table(table)
    return hashlib.sha256(sink.getvalue()).hexdigest()


def atomic_write(path: Path, write: Callable[[BinaryIO], None], temp_dir: Path) -> None:
    """write() the file's bytes to a new temp file in temp_dir, fsync it, rename it to `path`.

    The temp name is random and opened with O_EXCL | O_NOFOLLOW: never an existing file, never through a link. It
    is flock()ed while written, so that remove_dead_temps() of another run leaves it alone. On failure it is
    removed; the rename replaces a link at `path` itself, never what the link points to."""
    tmp = temp_dir / f"{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(fd, "wb", closefd=False) as f:
            write(f)
        os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def remove_dead_temps(folder: Path) -> None:
    """Remove the temp files in `folder` whose writer is gone: those nobody holds a lock on (see atomic_write)."""
    for tmp in folder.glob("*.tmp"):
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError:  # a link planted here (ELOOP): removing the link itself is safe
            tmp.unlink(missing_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            tmp.unlink(missing_ok=True)
        except BlockingIOError:  # being written by a live run
            pass
        finally:
            os.close(fd)


def clear_parts(parts: Path) -> None:
    """Remove what `<output>.parts/` holds but the lock and the temp files of live writers; the folder too once
    empty."""
    remove_dead_temps(parts)
    for entry in parts.iterdir():
        if entry.name == "lock" or entry.name.endswith(".tmp"):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)
    try:
        parts.rmdir()
    except OSError:  # not empty: the lock (its holder removes it) or a live writer's temp file
        pass


def output_rows_problem(output: Path, num_rows: int) -> str | None:
    """What is wrong with a finished output's rows (they must be 0..num_rows-1, in order), or None. Parquet: its
    `row` column; OpenAI JSONL: the row number each line's id ends in."""
    expected = 0
    for rows in _output_rows(output):
        wrong = np.flatnonzero(rows != np.arange(expected, expected + len(rows)))
        if len(wrong):
            at = int(wrong[0])
            return f"row {rows[at]} where row {expected + at} belongs (a row repeated or missing)"
        expected += len(rows)
    if expected != num_rows:
        return f"it has {expected} rows for the input's {num_rows}"
    return None


def openai_token(metadata: dict) -> str:
    """A token of the job (the same in every run of it) that makes an OpenAI output's ids unique."""
    return hashlib.sha256(json.dumps(metadata.get("job"), sort_keys=True, default=str).encode()).hexdigest()[:12]


TokenName = tuple[str, "list[int] | None"]  # a logprobs token's text and bytes in the OpenAI output


def id_name(token_id: int) -> TokenName:
    """A token named by its id, without bytes (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}", None


def openai_line(rec: dict, model: str, token: str, data_columns: list[str],
                names: Callable[[int], TokenName] = id_name) -> dict:
    """One line of the OpenAI Batch API's output file for an output record: `response` with a chat.completion or
    text_completion body, or `error`; the carried input columns beside them. The id ends in the row number.
    `names`: each logprobs token's (text, bytes)."""
    line: dict = {"id": f"batch_req_{token}_{rec['row']}", "custom_id": rec["id"]}
    if rec["error"] is not None:
        line.update(response=None, error={"code": "invalid_request", "message": rec["error"]})
    else:
        line.update(response={"status_code": 200, "request_id": f"req_{token}_{rec['row']}",
                              "body": _openai_body(rec, model, f"{token}-{rec['row']}", names)}, error=None)
    line.update((name, rec[name]) for name in data_columns)
    return line


def _openai_body(rec: dict, model: str, suffix: str, names: Callable[[int], TokenName]) -> dict:
    chat = bool(rec["chat"])
    texts = rec["completions"] or [rec["completion"]]
    reasons = rec["completions_finish_reasons"] or [rec["finish_reason"]]
    choices = []
    for i, (text, reason) in enumerate(zip(texts, reasons)):
        choice = {"index": i, **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
        choice["logprobs"] = _openai_logprobs(rec, chat, names) if i == 0 and rec["logprobs"] is not None else None
        choice["finish_reason"] = reason
        if i == 0:
            choice["token_ids"] = rec["completion_token_ids"]  # vLLM's return_token_ids
        choices.append(choice)
    prompt_tokens = rec["prompt_tokens"] or 0
    body = {"id": ("chatcmpl-" if chat else "cmpl-") + suffix,
            "object": "chat.completion" if chat else "text_completion", "created": int(rec["finished_at"]),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": rec["completion_tokens"],
                      "total_tokens": prompt_tokens + rec["completion_tokens"]},
            "metrics": {name: rec[name] for name in LATENCIES}}
    if rec["prompt_logprobs"] is not None:
        body["prompt_logprobs"] = rec["prompt_logprobs"]
    return body


def _openai_logprobs(rec: dict, chat: bool, names: Callable[[int], TokenName]) -> dict:
    """The first choice's logprobs in OpenAI's shape, each token named by `names`: its text and bytes (TokenNames),
    or "token_id:N" and no bytes (vLLM's return_tokens_as_token_ids: id_name). A position's top tokens come in rank
    order, the sampled one after them where it is not among them: a chat's `top_logprobs` holds the first N (the
    row's `top_logprobs`), a completion's all (OpenAI's legacy API: "up to logprobs + 1")."""
    ids, own, tops = rec["completion_token_ids"], rec["logprobs"], rec["top_logprobs"]
    if chat:
        num_top = rec["sampling"]["logprobs"] or 0

        def entry(token_id: int, logprob: float) -> dict:
            text, data = names(token_id)
            return {"token": text, "logprob": logprob, "bytes": data}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(e["token_id"], e["logprob"])
                                                              for e in top[:num_top]]}
                            for t, lp, top in zip(ids, own, tops)]}
    return {"tokens": [names(t)[0] for t in ids], "token_logprobs": own,
            "top_logprobs": [{names(e["token_id"])[0]: e["logprob"] for e in top} for top in tops],
            "text_offset": None}


def _output_rows(output: Path) -> Iterator[np.ndarray]:
    if output_format(output) == "parquet":
        for batch in pq.ParquetFile(output).iter_batches(columns=["row"], batch_size=1 << 16):
            yield batch.column(0).to_numpy(zero_copy_only=False)
        return
    with open(output, "rb") as f:
        for line in f:
            yield np.array([int(json.loads(line)["id"].rsplit("_", 1)[1])])


def _read_piece(piece: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        with pq.ParquetFile(piece) as f:  # lighter than read_table's dataset machinery (finalize reads a piece twice)
            return f.read(columns=columns)
    except FileNotFoundError:  # only another run removes pieces: one that lost its lock while it finished
        raise JobError(f"{piece} vanished while this run read it: another run is finishing this output; run the same "
                       "command again once it is done") from None


def _merged(pieces: list[Path], schema: pa.Schema, rows: list[np.ndarray]) -> Iterator[pa.Table]:
    """All rows of the (each sorted) pieces in row order, each once (a row in several pieces: the first piece's), as
    tables of up to FINAL_BATCH_ROWS rows cut from the pieces (no row goes through Python). The order is worked out
    from the pieces' row numbers alone (rows: each piece's); a piece is read when its first row is taken and dropped
    after its last, so only the pieces that overlap the current rows are held."""
    if not rows:
        return
    piece_of = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
    index_in = np.concatenate([np.arange(len(r)) for r in rows])
    all_rows = np.concatenate(rows)
    order = np.lexsort((piece_of, all_rows))  # by row, then by piece: a repeated row's first piece comes first
    order = order[np.r_[True, all_rows[order][1:] != all_rows[order][:-1]]]
    piece_of, index_in = piece_of[order], index_in[order]
    last_use = np.zeros(len(rows), np.int64)
    last_use[piece_of] = np.arange(len(order))  # the last assignment wins: each piece's last position
    loaded: dict[int, pa.Table] = {}
    for start in range(0, len(order), FINAL_BATCH_ROWS):
        p, i = piece_of[start:start + FINAL_BATCH_ROWS], index_in[start:start + FINAL_BATCH_ROWS]
        cuts = np.flatnonzero((np.diff(p) != 0) | (np.diff(i) != 1)) + 1  # runs of consecutive rows of one piece
        slices = []
        for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(p)]):
            piece = int(p[a])
            if piece not in loaded:
                loaded[piece] = _conform(_read_piece(pieces[piece]), schema)
            slices.append(loaded[piece].slice(int(i[a]), int(b - a)))
        yield pa.concat_tables(slices)
        for piece in [piece for piece in loaded if last_use[piece] < start + FINAL_BATCH_ROWS]:
            del loaded[piece]


def records_table(records: list[dict], schema: pa.Schema) -> pa.Table:
    """The records as a table of `schema` (a key a record lacks is null), as pa.Table.from_pylist makes it but
    column by column: pyarrow converts a list of row dicts row by row, ~10x slower for the output's ~30 columns,
    holding the GIL the engine's thread needs all the while."""
    return pa.Table.from_arrays([pa.array([r.get(f.name) for r in records], f.type) for f in schema], schema=schema)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A piece's table with the output's schema: as it is when written with it (every piece of this job's runs is),
    else converted row by row as the schema says."""
    if not table.schema.equals(schema, check_metadata=False):
        return pa.Table.from_pylist(table.to_pylist(), schema=schema)
    return table.replace_schema_metadata(None)


SUMMARY_COLUMNS = ["finish_reason", "prompt_tokens", "completion_tokens", "finished_at", "ignored_fields",
                   "structured_output_complete", *LATENCIES]


def summarize(table: pa.Table, wall_time_s: float, output: Path) -> dict:
    """The job's figures: rows, errors, tokens, throughput, latency percentiles of the rows that did not fail."""
    wall_time_s = round(wall_time_s, 3)  # as stored, so a summary recomputed from the file is the same
    reasons = {c["values"]: c["counts"] for c in pc.value_counts(table.column("finish_reason")).to_pylist()}
    ok = pc.not_equal(table.column("finish_reason"), "error")
    out_tokens = int(pc.sum(table.column("completion_tokens")).as_py() or 0)
    latency = {}
    for name in LATENCIES:
        values = table.column(name).filter(ok).drop_null().to_numpy()
        latency[name[:-3]] = {f"p{q}": (round(float(np.percentile(values, q)), 3) if len(values) else None)
                              for q in (50, 90, 99)}
    return {
        "output": str(output), "rows": table.num_rows, "error_rows": reasons.get("error", 0),
        "finish_reasons": dict(sorted((str(k), v) for k, v in reasons.items())),
        "prompt_tokens": int(pc.sum(table.column("prompt_tokens")).as_py() or 0), "output_tokens": out_tokens,
        "wall_time_s": wall_time_s,
        "output_tok_per_s": round(out_tokens / wall_time_s, 2) if wall_time_s > 0 else None,
        "latency_ms": latency,
        # rows whose structured output ran out of max_tokens (or met a stop string) before it was complete
        "structured_output_incomplete": int(pc.sum(pc.invert(table.column("structured_output_complete"))).as_py()
                                            or 0),
        # rows per unsupported field dropped (--allow-unknown-fields)
        "ignored_fields": dict(sorted((c["values"], c["counts"]) for c in
                                      pc.value_counts(pc.list_flatten(table.column("ignored_fields"))).to_pylist())),
    }


def summarize_output(output: Path) -> dict:
    """summarize() of a finished output file (its wall time comes from its metadata)."""
    table = pq.read_table(output, columns=SUMMARY_COLUMNS)
    metadata = table.schema.metadata or {}
    counts = json.loads(metadata.get(b"tinyvllm.counts", b"{}"))
    summary = summarize(table, counts.get("wall_time_s", 0.0), output)
    if b"tinyvllm.engine_stats" in metadata:
        summary["engine_stats"] = json.loads(metadata[b"tinyvllm.engine_stats"])
    return summary


def _summarize_pieces(tables: list[pa.Table], output: Path) -> dict:
    """summarize() of the pieces' "row" and SUMMARY_COLUMNS (tables: one a piece), a row in several once, over the
    time its runs spent."""
    run_ends = {}
    for t in tables:
        started = json.loads(t.schema.metadata[b"tinyvllm.run_started"])
        end = pc.max(t.column("finished_at")).as_py()
        run_ends[started] = max(run_ends.get(started, end), end)
    table = pa.concat_tables(tables) if tables else output_schema().empty_table().select(["row", *SUMMARY_COLUMNS])
    _, first = np.unique(table.column("row").to_numpy(), return_index=True)  # a row in several pieces counts once
    table = table.take(first)
    wall = sum(end - start for start, end in run_ends.items())  # time spent running, summed over resumed runs
    return summarize(table, wall, output)
