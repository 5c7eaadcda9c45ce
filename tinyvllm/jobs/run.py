"""A batch job: read rows -> submit to the engine (a bounded number in flight) -> write rows as they finish.

Memory stays bounded whatever the input size: rows are read lazily, at most `max_in_flight` requests live in the
engine, and finished rows go to disk in small pieces (see io/writer.py). The runner knows nothing of kernels.

A job survives being killed: rerun the same command and it resumes, skipping the rows already committed in
`<output>.parts/`, whose manifest.json must still match the input (size + sha256) and the settings that change
results. A lock in that folder keeps two runs off one output (jobs/guard.py). Rerunning a finished job is a no-op:
the output's metadata (the job, and rows 0..N-1 each once) is what says it is finished.
Job files (jobs/*.toml) are read by jobs/file.py.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from tinyvllm.config import SettingError
from tinyvllm.errors import JobError
from tinyvllm.io import PartsWriter, Row, count_rows, input_columns, output_record, read_rows
from tinyvllm.io.stdin import STDIN, is_stdin, spooled_stdin
from tinyvllm.io.writer import (OPENAI_LINE_KEYS, atomic_write, clear_parts, lock_path, output_format,
                                output_rows_problem, output_schema, parts_dir, summarize_output, summary_path)
from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.dummy import DUMMY_PREFIX, is_dummy, load_dummy
from tinyvllm.jobs.guard import OutputLock, StopSignals
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.version import __version__

__all__ = ["JobInterrupted", "LocalExecutor", "complete_rows", "load_llm", "prepare_request", "run_job",
           "sampling_defaults"]

_request_ids = itertools.count()
PREPARE_AHEAD = 256  # rows read, rendered and tokenized ahead of the engine
PREPARE_BATCH = 64  # rows the worker tokenizes at once
_END = object()  # the worker's last item: no rows left


class JobInterrupted(JobError):
    """SIGINT/SIGTERM: finished rows are committed; the same command resumes."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class LocalExecutor:
    """Runs a job's rows through one LLM in this process. (ray_runner.RayExecutor spreads them over a cluster.)

    An executor is a context (what it holds, e.g. a cluster connection, lives from before the job's lock and signal
    handlers until after) with one method, run(). `llm`: an LLM already built to run the rows on (a benchmark's),
    instead of loading the job's model and engine settings."""

    def __init__(self, llm=None) -> None:
        self.llm = llm

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, cfg: JobConfig, defaults: SamplingParams, rows: Iterator[Row], num_rows: int,
            emit: Callable[[dict], None], commit: Callable[..., None],
            stopped: Callable[[], bool], columns: pa.Schema) -> tuple[dict, dict]:
        """Complete `rows` (about num_rows rows not done yet; those with an error become error records), emit() one
        output record each as it finishes;
        call commit() now and then (emitted rows are committed once enough wait; commit(force=True): now); stop
        admitting once stopped(). `columns`: the input columns the rows carry. Returns (engine info, engine
        stats)."""
        llm = self.llm or load_llm(cfg)
        complete_rows(llm, rows, defaults, cfg, emit, cfg.in_flight_limit, on_step=commit, stopped=stopped)
        return llm.info(), llm.stats()


def complete_rows(llm, rows: Iterable[Row], defaults: SamplingParams, cfg: JobConfig, emit: Callable[[dict], None],
                  max_in_flight: int, on_step: Callable[[], None] = lambda: None,
                  stopped: Callable[[], bool] = lambda: False) -> None:
    """The row loop of every executor: emit() one output record per row (an error record for a bad one) as it
    finishes, keeping at most max_in_flight requests in the engine; on_step() after each engine step. Once stopped(),
    no row is admitted and the requests in flight are abandoned.

    A worker thread takes the rows from `rows` (a reader reads and parses the input there), renders and tokenizes
    them PREPARE_AHEAD ahead of this thread, which runs the engine (the worker's Python runs while this thread waits
    for the device). It hands them over through one queue, in row order, error rows included, so emit() and the
    engine are only ever called from this thread; an error the reader raises comes through the queue after the rows
    before it. Rows are admitted as they are ready, so the engine starts on the first rows instead of waiting for
    max_in_flight."""
    engine, max_model_len = llm.llm_engine, llm.engine_config.max_model_len
    in_flight: dict[str, tuple[Row, str | list[int], bool]] = {}  # request id -> (row, prompt sent, templated)

    def prepare(batch: list[Row]) -> list[tuple[str | list[int], bool, SamplingParams, list[int]] | str]:
        """For each row what to send and its token ids, or the reason it is an error row. The texts are tokenized
        together (Tokenizer.encode_prompts), which leaves the GIL to the engine's thread meanwhile."""
        requests: list[tuple | str] = []
        for row in batch:
            try:
                requests.append(row.error if row.error is not None else
                                prepare_request(row, llm.tokenizer, defaults, cfg, max_model_len))
            except ValueError as e:
                requests.append(str(e))
        texts = [i for i, r in enumerate(requests) if not isinstance(r, str) and isinstance(r[0], str)]
        token_ids = dict(zip(texts, llm.tokenizer.encode_prompts([requests[i][:2] for i in texts]))) if texts else {}
        return [r if isinstance(r, str) else (*r, token_ids.get(i, r[0])) for i, r in enumerate(requests)]

    def step() -> None:
        for out in engine.step():
            row, prompt, templated = in_flight.pop(out.request_id)
            emit(output_record(row.index, row.id, prompt, out, extras=record_extras(row, templated)))
        on_step()
        if in_flight and not engine.has_unfinished_requests():
            raise RuntimeError(f"engine lost {len(in_flight)} request(s)")

    def admit(row: Row, prepared: tuple | str) -> None:
        if isinstance(prepared, str):
            emit(output_record(row.index, row.id, None, error=prepared, extras=record_extras(row)))
            return
        prompt, templated, params, token_ids = prepared
        request_id = str(next(_request_ids))  # unique even where rows repeat (a retried Ray batch)
        # The text was tokenized as the engine would (Tokenizer.encode_prompt): the engine gets the ids.
        engine.add_request(request_id, token_ids, params, prompt_is_templated=templated)
        in_flight[request_id] = (row, prompt, templated)

    ready: queue.Queue = queue.Queue(PREPARE_AHEAD)  # (row, prepared), in row order; then _END or the error
    cancelled = threading.Event()

    def offer(item) -> bool:
        """Queue the item unless the loop has ended; False once it has."""
        while not cancelled.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def offer_prepared(batch: list[Row]) -> bool:
        return all(offer(item) for item in zip(batch, prepare(batch)))

    def produce() -> None:
        """Rows in batches: the first alone (the engine starts at once), then doubling up to PREPARE_BATCH."""
        batch: list[Row] = []
        size = 1
        try:
            for row in rows:  # reading and parsing the input runs here too, when `rows` is a reader
                batch.append(row)
                if len(batch) >= size:
                    ready_rows, batch, size = batch, [], min(2 * size, PREPARE_BATCH)
                    if not offer_prepared(ready_rows):
                        return
            end: object = _END
        except Exception as e:  # the loop raises it, after the rows before it
            end = e
        try:
            if offer_prepared(batch):
                offer(end)
        except Exception as e:
            offer(e)

    worker = threading.Thread(target=produce, name="tinyvllm-prepare", daemon=True)
    worker.start()
    exhausted = False
    try:
        while not stopped():
            # Admit every row that is ready; wait for one only when the engine has nothing else to do.
            while not exhausted and len(in_flight) < max_in_flight:
                try:
                    item = ready.get(block=not in_flight)
                except queue.Empty:
                    break
                if item is _END:
                    exhausted = True
                elif isinstance(item, Exception):
                    raise item
                else:
                    admit(*item)
            if in_flight:
                step()
            elif exhausted:
                return
    finally:
        cancelled.set()
        worker.join()


def record_extras(row: Row, chat: bool | None = None) -> dict:
    """A row's output columns beyond the engine's result: its carried input columns, `chat`, `ignored_fields`."""
    return {**row.columns, "chat": chat, "ignored_fields": row.ignored_fields or None}


def run_job(cfg: JobConfig, executor: LocalExecutor | None = None) -> dict:
    """Run (or resume) the job to the end and return its summary; `summary["already_complete"]` when there was
    nothing to do. Raises JobError for problems of the job as a whole, JobInterrupted on SIGINT/SIGTERM.
    An input of "-" is standard input, read whole first (io/stdin.py)."""
    if is_stdin(cfg.input):
        with spooled_stdin() as copy:
            return run_job(replace(cfg, input=copy, input_label=STDIN), executor)
    defaults = sampling_defaults(cfg)
    model = Path(cfg.model) if cfg.model is not None else _default_model()
    if is_dummy(model):
        from tinyvllm.model.dummy import PRESETS  # only for a dummy model: the CLI starts without the model code

        if str(model)[len(DUMMY_PREFIX):] not in PRESETS:
            raise JobError(f"unknown dummy model {model}: choose from {', '.join(DUMMY_PREFIX + p for p in PRESETS)}")
    elif not model.exists():
        raise JobError(f"model not found: {model}")
    columns = input_columns(cfg.input, cfg.kept_columns, cfg.drop_input_columns, cfg.input_options)  # checks it
    _check_output(cfg.output, cfg.input)
    _check_columns(columns, cfg.output)
    # The OpenAI output names logprobs' tokens by id: its pieces keep the ids.
    cfg = replace(cfg, model=model, chat_template_source=_chat_template_source(cfg),
                  output_token_ids=cfg.output_token_ids or output_format(cfg.output) == "openai")
    rows = read_rows(cfg.input, columns, cfg.allow_unknown_fields, cfg.input_options)
    total = count_rows(cfg.input, cfg.input_options)
    with executor or LocalExecutor() as executor, OutputLock(cfg.output) as lock, StopSignals() as signals:
        stamp = _input_stamp(cfg.input)  # before the hash: a change while hashing shows at the first commit
        job = _job_identity(cfg, defaults)
        if not cfg.overwrite and cfg.output.exists():
            problem = _finished_problem(cfg.output, job, total)
            if problem is None:
                summary = _finished_summary(cfg.output)
                clear_parts(parts_dir(cfg.output))  # left by a run killed while it removed them
                return summary
            manifest = _read_manifest(parts_dir(cfg.output))
            if manifest is None or manifest["job"] != job:  # else: pieces of this job are pending; resume
                raise JobError(f"{cfg.output} exists {problem}; pass --overwrite to replace it")
        manifest = _open_parts(cfg, job)

        def before_commit() -> None:
            lock.verify()
            if _input_stamp(cfg.input) != stamp:  # rows read since may come from other content: none is committed
                raise JobError(f"input {cfg.input} changed while the job ran; stopped, keeping the rows committed "
                               "before: restore it and run the same command again, or pass --overwrite to start over")

        return _run(cfg, executor, rows, columns, total, defaults, manifest, signals, before_commit)


def _run(cfg: JobConfig, executor, rows: Iterator[Row], columns: pa.Schema, total: int, defaults: SamplingParams,
         manifest: dict, signals: StopSignals, before_commit: Callable[[], None]) -> dict:
    started = time.time()
    writer = PartsWriter(cfg.output, output_schema(cfg.output_token_ids, columns), started, total,
                         piece_rows=cfg.piece_rows, guard=before_commit)
    for damaged in writer.damaged:
        print(f"warning: set aside damaged piece {damaged}; its rows will be computed again", file=sys.stderr)
    done = writer.committed_rows()
    warned: set[str] = set()
    bar = tqdm(total=total, initial=len(done), unit="row", file=sys.stderr, disable=cfg.quiet, dynamic_ncols=True)
    tokens = 0

    def emit(record: dict) -> None:
        nonlocal tokens
        writer.add(record)
        tokens += record["completion_tokens"]
        bar.update(1)
        bar.set_postfix_str(f"{tokens / max(time.time() - started, 1e-9):.1f} tok/s", refresh=False)

    def stopped() -> bool:
        return signals.received is not None

    def pending() -> Iterator[Row]:
        """The rows still to do, those that failed to parse included (the executor emits their error records). It
        may run on the executor's worker thread: it touches nothing but `warned` and what does not change."""
        for row in _readable(rows, cfg.input):
            if stopped():
                return
            if row.index in done:
                continue
            for name in set(row.ignored_fields) - warned:
                warned.add(name)
                tqdm.write(f"warning: ignoring the unsupported field {name!r} (--allow-unknown-fields); the summary "
                           "counts the rows that had it", file=sys.stderr)
            yield row

    try:
        def commit(force: bool = False) -> None:
            writer.flush() if force else writer.maybe_flush()

        info, stats = executor.run(cfg, defaults, pending(), total - len(done), emit, commit, stopped, columns)
    finally:
        writer.flush()
        bar.close()
    if signals.received:
        name = signal.Signals(signals.received).name
        raise JobInterrupted(f"interrupted by {name}: {len(done) + writer.committed} rows committed in "
                             f"{writer.parts}; run the same command again to resume", 128 + signals.received)
    if _input_sha256(cfg.input) != manifest["job"]["input_sha256"]:  # a change the stamp missed (same clock tick)
        raise JobError(f"input {cfg.input} changed while the job ran, so the job is not complete: the "
                       f"{writer.discard()} rows this run computed are dropped (they may come from the changed input), "
                       "those committed before are kept: restore it and run the same command again, or pass "
                       "--overwrite to start over")
    metadata = {"model": info.get("model", str(cfg.model)), "backend": info.get("backend", cfg.engine.backend),
                "batching": info.get("batching", cfg.engine.batching), "engine": info, "sampling": asdict(defaults),
                "chat": cfg.chat, "chat_template": cfg.chat_template,
                "chat_template_kwargs": cfg.template_kwargs or None, "input": cfg.input_label or str(cfg.input),
                "version": __version__,
                "job": manifest["job"], "start_time": manifest["started_at"], "end_time": _iso(time.time())}
    return writer.finalize(metadata, stats)


def sampling_defaults(cfg: JobConfig) -> SamplingParams:
    """The SamplingParams every row of the job starts from; JobError names a bad one."""
    try:
        return cfg.sampling_params()
    except (TypeError, ValueError) as e:
        raise JobError(f"bad sampling defaults: {e}") from None


def prepare_request(row: Row, tokenizer, defaults: SamplingParams, cfg: JobConfig,
                    max_model_len: int) -> tuple[str | list[int], bool, SamplingParams]:
    """What to send for a row: (prompt, already templated?, its SamplingParams). ValueError: the row is bad."""
    params = defaults.with_overrides(row.overrides)
    if params.max_tokens > max_model_len:
        raise ValueError(f"invalid max_tokens={params.max_tokens}: more than max_model_len={max_model_len}")
    if params.seed is None:
        params = replace(params, seed=_row_seed(cfg.engine.seed, row.index))
    messages = row.messages
    if messages is None and cfg.chat and isinstance(row.prompt, str):
        messages = [{"role": "user", "content": row.prompt}]
    if messages is None:
        if row.chat_options:
            raise ValueError(f"{next(iter(row.chat_options))} applies to a chat (messages, or --chat), not to a "
                             "prompt")
        return row.prompt, False, params
    options = row.chat_options
    kwargs = {**cfg.template_kwargs, **options.get("chat_template_kwargs", {})}  # the row's own keys win
    try:
        return tokenizer.apply_chat_template(
            messages, options.get("add_generation_prompt", True), chat_template=cfg.chat_template_source,
            continue_final_message=options.get("continue_final_message", False), **kwargs), True, params
    except Exception as e:  # a template may raise anything (jinja's raise_exception): it is this row's problem
        raise ValueError(f"chat template failed: {e}") from None


def _chat_template_source(cfg: JobConfig) -> str | None:
    """The --chat-template file's content, checked to compile; JobError (one line) if it cannot be used."""
    if cfg.chat_template is None:
        return None
    from tinyvllm.tokenizer import check_chat_template

    try:
        source = Path(cfg.chat_template).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(f"cannot read chat template {cfg.chat_template}: {getattr(e, 'strerror', None) or e}") from None
    try:
        check_chat_template(source)
    except ValueError as e:
        raise JobError(f"chat template {cfg.chat_template} is not a valid template: {e}") from None
    return source


def _check_columns(columns: pa.Schema, output: Path) -> None:
    """The carried input columns must not take a result column's name."""
    results = set(output_schema(True).names) | (set(OPENAI_LINE_KEYS) if output_format(output) == "openai" else set())
    clash = [name for name in columns.names if name in results]
    if clash:
        raise JobError(f"the input column {clash[0]!r} has the name of a result column of the output: rename it, "
                       "or leave it out with --keep-columns or --drop-input-columns")


def _row_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()) >> 1


def _job_identity(cfg: JobConfig, defaults: SamplingParams) -> dict:
    """What must not change between a run and its resumption: the input's content and what shapes the results.
    (Scheduling knobs and the backend may change: a job killed for memory can resume with a smaller batch.)"""
    return {"input_size": cfg.input.stat().st_size, "input_sha256": _input_sha256(cfg.input),
            "model": str(cfg.model) if is_dummy(cfg.model) else str(Path(cfg.model).resolve()),
            "max_model_len": cfg.engine.max_model_len, "seed": cfg.engine.seed,
            "sampling": asdict(defaults), "chat": cfg.chat, "output_token_ids": cfg.output_token_ids,
            "logprobs": cfg.logprobs,
            "chat_template_sha256": (hashlib.sha256(cfg.chat_template_source.encode()).hexdigest()
                                     if cfg.chat_template_source is not None else None),
            "chat_template_kwargs": cfg.template_kwargs, "allow_unknown_fields": cfg.allow_unknown_fields,
            "keep_columns": cfg.kept_columns, "drop_input_columns": cfg.drop_input_columns,
            **cfg.input_options.identity()}


def _input_sha256(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:  # gone or unreadable since the job started
        return None
    return digest.hexdigest()


def _input_stamp(path: Path) -> tuple | None:
    """What changes whenever the file's content does (its ctime cannot be set back), short of a change within one
    tick of the file system's clock, which the hash at the end of a run catches."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _differences(old: dict, new: dict) -> str:
    old, new = _flat(old), _flat(new)
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(f"{k} {str(old.get(k))[:60]} -> {str(new.get(k))[:60]}" for k in keys)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _finished_problem(output: Path, job: dict, num_rows: int) -> str | None:
    """None if `output` is this job's finished output (its metadata names this job; rows 0..num_rows-1 each once),
    else what it is instead. An OpenAI JSONL output's metadata is in its summary, written after it."""
    try:
        if output_format(output) == "parquet":
            previous = json.loads((pq.read_schema(output).metadata or {})[b"tinyvllm.job"])
        else:
            previous = json.loads(summary_path(output).read_bytes())["metadata"]["job"]
    except Exception:  # not Parquet, or not ours; a JSONL output without its summary
        return "and is not a finished tinyvllm output"
    if previous != job:
        return f"from a different job ({_differences(previous, job)})"
    try:
        problem = output_rows_problem(output, num_rows)
    except Exception as e:  # pyarrow raises several types for damaged data
        problem = f"its rows cannot be read: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
    return None if problem is None else f"but is not complete: {problem}"


def _finished_summary(output: Path) -> dict:
    """The summary of a finished output; written again if it is missing or damaged (the output holds it all)."""
    try:
        summary = json.loads(summary_path(output).read_text())
    except (OSError, ValueError):
        summary = summarize_output(output)
        try:
            atomic_write(summary_path(output), lambda f: f.write(json.dumps(summary, indent=2).encode() + b"\n"),
                         parts_dir(output))
        except OSError as e:
            raise JobError(f"cannot write {summary_path(output)}: {e.strerror}") from None
    return {**summary, "already_complete": True}


def _read_manifest(parts: Path) -> dict | None:
    """The manifest of the pieces in `parts` (None: there is none); JobError if it is damaged."""
    path = parts / "manifest.json"
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise JobError(f"cannot resume: {path} is damaged ({e}); pass --overwrite to start over") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("job"), dict):
        raise JobError(f"cannot resume: {path} is damaged (no job in it); pass --overwrite to start over")
    return manifest


def _open_parts(cfg: JobConfig, job: dict) -> dict:
    """Create `<output>.parts/` with its manifest, or check that the one there is this job's (to resume)."""
    parts = parts_dir(cfg.output)
    manifest_path = parts / "manifest.json"
    try:
        if cfg.overwrite:
            clear_parts(parts)
        manifest = _read_manifest(parts)
        if manifest is not None:
            if manifest["job"] != job:
                raise JobError(f"cannot resume: {parts} holds rows of a different job "
                               f"({_differences(manifest['job'], job)}); rerun with the original input and "
                               "settings, or pass --overwrite to start over")
            return manifest
        if any(parts.glob("piece-*.parquet")):
            raise JobError(f"cannot resume: {parts} has pieces but no manifest.json; pass --overwrite to start over")
        manifest = {"job": job, "input": cfg.input_label or str(cfg.input), "started_at": _iso(time.time()),
                    "version": __version__}
        atomic_write(manifest_path, lambda f: f.write(json.dumps(manifest, indent=2).encode() + b"\n"), parts)
    except OSError as e:
        raise JobError(f"cannot prepare {parts}: {e.strerror}") from None
    return manifest


def _check_output(output: Path, input_path: Path) -> None:
    """The output can be written and none of the files it makes can be the input."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        name_max = os.pathconf(output.parent, "PC_NAME_MAX")
    except OSError as e:
        raise JobError(f"cannot create output directory {output.parent}: {e.strerror}") from None
    for made in (output, summary_path(output), parts_dir(output)):
        if len(made.name.encode()) > name_max:
            raise JobError(f"output name too long: {made.name[:40]}... would be {len(made.name.encode())} bytes, "
                           f"over the file system's {name_max}")
    for made in (output, summary_path(output), parts_dir(output), lock_path(output)):
        if _same_file(made, input_path):
            raise JobError(f"refusing to overwrite the input: {made} (written by this job) is the input {input_path}")
    if os.path.realpath(input_path).startswith(os.path.realpath(parts_dir(output)) + os.sep):
        raise JobError(f"the input {input_path} is inside {parts_dir(output)}, which this job clears")
    if output.is_dir():
        raise JobError(f"output is a directory: {output}")
    if not os.access(output.parent, os.W_OK | os.X_OK):
        raise JobError(f"output directory is not writable: {output.parent}")
    output_format(output)


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` is `b`: the same path once links are resolved, or the same file (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist
        return False


def _readable(rows: Iterator[Row], path: Path) -> Iterator[Row]:
    """`rows`, with a failure to read the input past its start (a corrupt Parquet data page) as one JobError."""
    index = -1
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except JobError:
            raise
        except Exception as e:  # pyarrow raises several types for damaged data
            raise JobError(f"cannot read input {path} after row {index}, it is damaged: "
                           f"{str(e).splitlines()[0][:200]}; repair it and run again with --overwrite") from None
        index = row.index
        yield row


def _default_model() -> Path:
    from tinyvllm.fetch import default_model_path

    path = default_model_path()
    if path is None:
        raise JobError("no model given and the default model is not fetched: "
                       "run `tinyvllm fetch-default-model` (or `make run`) first")
    return path


def load_llm(cfg: JobConfig):
    """The job's LLM; JobError (one line) if it cannot be built."""
    from tinyvllm.llm import LLM  # heavy: only once the job is known to be runnable

    try:
        return LLM(load_dummy(str(cfg.model)) if is_dummy(cfg.model) else cfg.model, **asdict(cfg.engine))
    except SettingError as e:  # a setting this model or machine cannot meet: the settings' problem, not the model's
        raise JobError(str(e)) from None
    # What a bad model file, a setting the model or machine cannot meet, or a missing GPU raise; anything else is a
    # bug and keeps its traceback.
    except (ValueError, OSError, RuntimeError, MemoryError, ImportError, JobError) as e:
        raise JobError(f"cannot load model {cfg.model}: {e}".splitlines()[0]) from None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")
