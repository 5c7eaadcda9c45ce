"""A batch job: read rows -> submit to the engine (a bounded number in flight) -> write rows as they finish.

Memory stays bounded whatever the input size: rows are read lazily, at most `max_in_flight` requests live in the
engine, and finished rows go to disk in small pieces (see io/writer.py). The job drives the engine through
`LLMEngine.add_request` and `step` alone; what runs a step (the backend, its kernels) is below it.

A job survives being killed: rerun the same command and it resumes, skipping the rows already committed in
`<output>.parts/`, whose manifest.json (or, if it is lost, the pieces, which record it too) must still match the
input (size + sha256) and the settings that change results (jobs/resume.py). Nothing is written before the job
can start: the model is loaded first. A lock in that folder keeps two runs off one output (jobs/guard.py).
Rerunning a finished job is a no-op: the output's metadata (the job, and rows 0..N-1 each once) is what says it is
finished.
Job files (jobs/*.toml) are read by jobs/file.py.
"""

from __future__ import annotations

import itertools
import os
import queue
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from tinyvllm.config import SettingError
from tinyvllm.engine.gc_scope import engine_run_gc
from tinyvllm.engine.structured_outputs import check_constraint
from tinyvllm.errors import JobError, JobUsageError
from tinyvllm.io import PartsWriter, Row, count_rows, input_columns, output_record, read_rows
from tinyvllm.io.stdin import STDIN, is_stdin, spooled_stdin
from tinyvllm.io.writer import (OPENAI_LINE_KEYS, id_name, lock_path, output_format, output_schema, parts_dir,
                                sampling_record, summary_path)
from tinyvllm.jobs import resume
from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.dummy import DUMMY_PREFIX, is_dummy, load_dummy
from tinyvllm.jobs.guard import OutputLock, StopSignals, check_not_busy
from tinyvllm.jobs.prepare import END as _END
from tinyvllm.jobs.prepare import (PREPARE_AHEAD, PREPARE_BATCH, PrepareSpec, PrepareWorker, WorkerProcess,
                                   WorkerUnavailable, readable, row_params, row_prompt, tokenizer_spec,
                                   wants_worker)
from tinyvllm.jobs.prepare import row_seed as _row_seed  # noqa: F401 (tests set seeds against it)
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.version import __version__

__all__ = ["JobInterrupted", "LocalExecutor", "PendingRows", "RowPipeline", "complete_rows", "load_llm",
           "prepare_request", "run_job", "sampling_defaults"]

_request_ids = itertools.count()
ERROR_MESSAGES = 3  # the most common error messages the final line names
ROW_LOCATION = re.compile(r"^(line|row) \d+: ")  # how a reader's error message starts


class JobInterrupted(JobError):
    """SIGINT/SIGTERM: finished rows are committed; the same command resumes."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class LocalExecutor:
    """Runs a job's rows through one LLM in this process. (jobs/ray_executor.py's RayExecutor
    spreads them over a cluster.)

    An executor is a context (what it holds, e.g. a cluster connection, lives from before the job's lock and signal
    handlers until after) with one method, run(). `llm`: an LLM already built to run the rows on (a benchmark's),
    instead of loading the job's model and engine settings."""

    def __init__(self, llm=None) -> None:
        self.llm = llm

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def start(self, cfg: JobConfig) -> None:
        """Load the job's model, before the job writes anything: a model that cannot load leaves nothing behind."""
        if self.llm is None:
            self.llm = load_llm(cfg)

    def tokenizer(self, cfg: JobConfig):
        """The job's tokenizer: its LLM's, or read alone where no rows were left to run."""
        return self.llm.tokenizer if self.llm is not None else load_job_tokenizer(cfg)

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
    """The row loop of every executor (RowPipeline): emit() one output record per row (an error record for a bad
    one) as it finishes, keeping at most max_in_flight requests in the engine; on_step() after each engine step. Once
    stopped(), no row is admitted and the requests in flight are abandoned."""
    RowPipeline(llm, defaults, cfg, emit, max_in_flight, on_step, stopped).run(rows)


class RowPipeline:
    """Rows -> the engine -> output records, the engine on the calling thread, the rows prepared PREPARE_AHEAD
    ahead of it by a worker process or a producer thread.

    A job's rows (PendingRows) are read, rendered and tokenized by a worker process (jobs/prepare.py PrepareWorker:
    its Python then takes no GIL from the engine's thread) where cfg.prepare_workers asks for one (unset: a job of
    WORKER_MIN_ROWS rows or more) and one can start; else (or for other rows) by a producer thread (`_produce`),
    which takes the rows from `rows` (a reader reads and parses the input there) and renders and tokenizes them
    (`_prepare`) while the engine waits for the device. Either hands them over in row order, error rows included,
    so emit() and the engine are only ever called from the calling thread; an error the reader raises comes after
    the rows before it. The calling thread admits rows as they are ready (`_admit_ready`), so the engine starts on
    the first rows instead of waiting for max_in_flight, and steps the engine (`_step`), emitting the rows that
    finish."""

    def __init__(self, llm, defaults: SamplingParams, cfg: JobConfig, emit: Callable[[dict], None],
                 max_in_flight: int, on_step: Callable[[], None] = lambda: None,
                 stopped: Callable[[], bool] = lambda: False) -> None:
        self.llm, self.engine, self.max_model_len = llm, llm.llm_engine, llm.engine_config.max_model_len
        self.defaults, self.cfg, self.emit, self.max_in_flight = defaults, cfg, emit, max_in_flight
        self.on_step, self.stopped = on_step, stopped
        # request id -> (row, prompt, templated, its SamplingParams)
        self.in_flight: dict[str, tuple[Row, str | list[int], bool, SamplingParams]] = {}
        self.ready: queue.Queue = queue.Queue(PREPARE_AHEAD)  # (row, prepared), in row order; then _END or the error
        self.cancelled = threading.Event()  # the loop has ended: the producer stops
        self.worker: PrepareWorker | None = None  # where the rows come from instead of the producer's queue
        self.overridden: dict = {}  # row_params' cache, for the worker's rows
        self.noted: Callable[[Row], None] = lambda row: None  # PendingRows.noted, for the worker's rows

    def run(self, rows: Iterable[Row]) -> None:
        """Complete `rows`: return once each is emitted, or once stopped()."""
        self.worker = self._start_worker(rows)
        producer = None
        if self.worker is None:
            producer = threading.Thread(target=self._produce, args=(rows,), name="tinyvllm-prepare", daemon=True)
            producer.start()
        try:
            with engine_run_gc():
                self._loop()
        finally:
            self.cancelled.set()
            if producer is not None:
                producer.join()
            if self.worker is not None:
                self.worker.close()

    def _loop(self) -> None:
        """Admit the rows that are ready and step the engine until every row is emitted, or stopped()."""
        exhausted = False
        while not self.stopped():
            if not exhausted:
                exhausted = self._admit_ready()
            if self.in_flight:
                self._step()
            elif exhausted:
                return

    def _start_worker(self, rows: Iterable[Row]) -> PrepareWorker | None:
        """A worker preparing a job's rows, if the job asks for one and one starts (else one line says why not)."""
        if not isinstance(rows, PendingRows) or not wants_worker(self.cfg.prepare_workers, rows.count):
            return None
        try:
            worker = PrepareWorker.start(rows.spec(self.llm.tokenizer), self.llm.tokenizer, self._from_worker,
                                         rows.take_worker_process())
        except WorkerUnavailable as e:
            tqdm.write(f"warning: preparing the rows in this process: the worker process did not start ({e})",
                       file=sys.stderr)
            return None
        self.noted = rows.noted
        return worker

    # ---- the engine's thread ----

    def _admit_ready(self) -> bool:
        """Admit the rows that are ready, up to max_in_flight, until the engine has a batch's worth waiting and its
        device has run out of work (`_admitted_enough`); wait for a row only when the engine has nothing else to do.
        True once the producer has no rows left; raises the error the producer met."""
        while len(self.in_flight) < self.max_in_flight and not self._admitted_enough():
            item = self._next(block=not self.in_flight)
            if item is None:
                return False
            if item is _END:
                return True
            if isinstance(item, Exception):
                raise item
            self._admit(*item)
        return False

    def _admitted_enough(self) -> bool:
        """Whether the next step would be delayed by admitting more, and does not need more: the device has finished
        the step queued last (or the backend cannot tell) and max_num_seqs sequences wait, so the next step's
        batch is the same. Rows then join in the device's shadow, a few each step, not hundreds at once in the
        device's idle time when a batch's worth of sequences finish together."""
        return (self.engine.get_num_waiting_requests() >= self.engine.engine_config.max_num_seqs
                and not self.engine.device_busy())

    def _next(self, block: bool):
        """The next item, (row, prepared), _END or an exception; None if none is ready (block: wait for one)."""
        if self.worker is not None:
            return self.worker.get(block, self.stopped)
        try:
            return self.ready.get(block=block)
        except queue.Empty:
            return None

    def _from_worker(self, row: Row, failure: str | None, text: str | None, templated: bool | None,
                     token_ids: list[int] | None) -> tuple[Row, tuple | str]:
        """The worker's row as an item: its SamplingParams made here (row_params, as _prepare does; checked first,
        as there), its error rows in place."""
        self.noted(row)
        if row.error is not None:
            return row, row.error
        try:
            params = row_params(row, self.defaults, self.cfg.engine.seed, self.max_model_len, self.overridden)
        except ValueError as e:
            return row, str(e)
        if failure is not None:
            return row, failure
        return row, (token_ids if text is None else text, templated, params, token_ids)

    def _admit(self, row: Row, prepared: tuple | str) -> None:
        """Add the row's request to the engine, or emit its error record."""
        if isinstance(prepared, str):
            self.emit(output_record(row.index, row.id, None, error=prepared, extras=record_extras(row)))
            return
        prompt, templated, params, token_ids = prepared
        request_id = str(next(_request_ids))  # unique even where rows repeat (a retried Ray batch)
        # The text was tokenized as the engine would (Tokenizer.encode_prompt): the engine gets the ids.
        self.engine.add_request(request_id, token_ids, params, prompt_is_templated=templated)
        self.in_flight[request_id] = (row, prompt, templated, params)

    def _step(self) -> None:
        """One engine step; emit the rows it finished."""
        for out in self.engine.step():
            row, prompt, templated, params = self.in_flight.pop(out.request_id)
            # max_tokens None: the engine generated up to the context, what the prompt left of max_seq_len
            limit = None if params.max_tokens is not None else self.engine.max_seq_len - len(out.prompt_token_ids)
            sampling = sampling_record(params, limit)
            self.emit(output_record(row.index, row.id, prompt, out, extras=record_extras(row, templated),
                                    sampling=sampling))
        self.on_step()
        if self.in_flight and not self.engine.has_unfinished_requests():
            raise RuntimeError(f"engine lost {len(self.in_flight)} request(s)")

    # ---- the producer's thread ----

    def _produce(self, rows: Iterable[Row]) -> None:
        """Rows in batches: the first alone (the engine starts at once), then doubling up to PREPARE_BATCH; then
        _END, or the error reading them raised."""
        batch: list[Row] = []
        size = 1
        try:
            for row in rows:  # reading and parsing the input runs here too, when `rows` is a reader
                batch.append(row)
                if len(batch) >= size:
                    ready_rows, batch, size = batch, [], min(2 * size, PREPARE_BATCH)
                    if not self._offer_prepared(ready_rows):
                        return
            end: object = _END
        except Exception as e:  # the engine's thread raises it, after the rows before it
            end = e
        try:
            if self._offer_prepared(batch):
                self._offer(end)
        except Exception as e:
            self._offer(e)

    def _offer_prepared(self, batch: list[Row]) -> bool:
        return all(self._offer(item) for item in zip(batch, self._prepare(batch)))

    def _offer(self, item) -> bool:
        """Queue the item unless the loop has ended; False once it has."""
        while not self.cancelled.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _prepare(self, batch: list[Row]) -> list[tuple[str | list[int], bool, SamplingParams, list[int]] | str]:
        """For each row what to send and its token ids, or the reason it is an error row. The texts are tokenized
        together (Tokenizer.encode_prompts), which leaves the GIL to the engine's thread meanwhile."""
        tokenizer = self.llm.tokenizer
        requests: list[tuple | str] = []
        for row in batch:
            try:
                requests.append(row.error if row.error is not None else
                                prepare_request(row, tokenizer, self.defaults, self.cfg, self.max_model_len))
            except ValueError as e:
                requests.append(str(e))
        texts = [i for i, r in enumerate(requests) if not isinstance(r, str) and isinstance(r[0], str)]
        token_ids = dict(zip(texts, tokenizer.encode_prompts([requests[i][:2] for i in texts]))) if texts else {}
        return [r if isinstance(r, str) else (*r, token_ids.get(i, r[0])) for i, r in enumerate(requests)]


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
    template = _chat_template_source(cfg)
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
    cfg = replace(cfg, model=model, chat_template_source=template,
                  output_token_ids=cfg.output_token_ids or output_format(cfg.output) == "openai")
    rows = read_rows(cfg.input, columns, cfg.allow_unknown_fields, cfg.input_options)
    total = count_rows(cfg.input, cfg.input_options)
    with ExitStack() as stack:
        executor = stack.enter_context(executor or LocalExecutor())
        # Nothing is written until the job can start: the output free, the model loaded. Then the lock keeps other
        # runs out, and what was read before it is read again under it.
        check_not_busy(cfg.output)
        stamp = resume.input_stamp(cfg.input)  # before the hash: a change while hashing shows at the first commit
        job = resume.job_identity(cfg, defaults)
        ahead = None
        if resume.work_to_do(cfg, job, total):
            ahead = _worker_ahead(cfg, executor, total)
            if ahead is not None:
                stack.callback(ahead.close)  # if no worker took it
            executor.start(cfg)
        _make_output_dir(cfg.output)
        lock, signals = stack.enter_context(OutputLock(cfg.output)), stack.enter_context(StopSignals())
        summary = resume.finished_summary(cfg, job, total)
        if summary is not None and not (cfg.retry_errors and summary["error_rows"]):  # --retry-errors: rows to redo
            return summary
        manifest = resume.open_parts(cfg, job)

        def before_commit() -> None:
            lock.verify()
            if resume.input_stamp(cfg.input) != stamp:  # rows read since may come from other content: none committed
                raise JobError(f"input {cfg.input} changed while the job ran; stopped, keeping the rows committed "
                               "before: restore it and run the same command again, or pass --overwrite to start over")

        job_run = _JobRun(cfg, columns, total, signals, before_commit, job, retry_output=summary is not None,
                          worker_process=ahead)
        info, stats = job_run.execute(executor, defaults, rows)
        job_run.check_complete(manifest)
        return job_run.finish(_metadata(cfg, defaults, manifest, info), stats, _token_names(cfg, executor))


def _worker_ahead(cfg: JobConfig, executor, total: int) -> WorkerProcess | None:
    """A row-preparation worker's process started now, so that it imports while the model loads, where the job's
    rows will likely be prepared by one (RowPipeline._start_worker decides: a job of WORKER_MIN_ROWS rows or more,
    unless prepare_workers says); None otherwise, or if none starts (_start_worker tries again and says why)."""
    if not isinstance(executor, LocalExecutor) or not wants_worker(cfg.prepare_workers, total):
        return None
    try:
        return WorkerProcess.start()
    except WorkerUnavailable:
        return None


class _JobRun:
    """One run of a job in this process: the pieces writer, the progress bar, and the rows still to do."""

    def __init__(self, cfg: JobConfig, columns: pa.Schema, total: int, signals: StopSignals,
                 before_commit: Callable[[], None], job: dict, retry_output: bool = False,
                 worker_process: WorkerProcess | None = None) -> None:
        self.cfg, self.columns, self.total, self.signals = cfg, columns, total, signals
        self.started = time.time()
        self.writer = PartsWriter(cfg.output, output_schema(cfg.output_token_ids, columns), self.started, total,
                                  piece_rows=cfg.piece_rows, guard=before_commit, job=job)
        for damaged in self.writer.damaged:
            print(f"warning: set aside damaged piece {damaged}; its rows will be computed again", file=sys.stderr)
        if cfg.retry_errors:
            self._take_out_errors(retry_output)
        self.done = self.writer.committed_rows()
        self.warned: set[str] = set()  # the ignored fields warned about
        self.tokens = 0  # completion tokens emitted by this run
        self.errors: dict[int, str] = {}  # row -> error, of the error rows this run emitted
        # the shown bar comes once the rows are read (the model loaded): a load error prints none
        self.bar = tqdm(disable=True)
        self.worker_process = worker_process  # started ahead for the rows' worker (_worker_ahead)

    def _take_out_errors(self, from_output: bool) -> None:
        """--retry-errors: take the error rows out of the committed pieces (and first the finished output's rows
        back into pieces, `from_output`), so that this run computes them again; the summary counts them."""
        retried = 0
        if from_output:
            retried = self.writer.adopt_output(self.cfg.output)
            resume.mark_retrying(self.cfg.output)
        retried += self.writer.drop_error_rows()
        self.writer.summary_extra["retried_rows"] = retried
        if not self.cfg.quiet:
            print(f"retrying {retried} error row{'s' * (retried != 1)}; the other rows are kept", file=sys.stderr)

    def execute(self, executor, defaults: SamplingParams, rows: Iterator[Row]) -> tuple[dict, dict]:
        """The executor's run over the rows not done yet; returns its (engine info, engine stats). What was emitted
        is flushed, whatever happens."""
        try:
            return executor.run(self.cfg, defaults, PendingRows(self, rows), self.total - len(self.done), self.emit,
                                self.commit, self.stopped, self.columns)
        finally:
            self.writer.flush()
            self.bar.close()

    def emit(self, record: dict) -> None:
        self.writer.add(record)
        self.tokens += record["completion_tokens"]
        if record["error"] is not None:
            self.errors[record["row"]] = record["error"]
        self.bar.update(1)
        self.bar.set_postfix_str(f"{self.tokens / max(time.time() - self.started, 1e-9):.1f} tok/s", refresh=False)

    def commit(self, force: bool = False) -> None:
        self.writer.flush() if force else self.writer.maybe_flush()

    def stopped(self) -> bool:
        return self.signals.received is not None

    def pending(self, rows: Iterator[Row]) -> Iterator[Row]:
        """The rows still to do, those that failed to parse included (the executor emits their error records). It
        may run on the executor's worker thread: it touches only `warned`, `bar` (first) and what does not change."""
        self.show_progress()
        for row in readable(rows, self.cfg.input):
            if self.stopped():
                return
            if row.index in self.done:
                continue
            self.noted(row)
            yield row

    def show_progress(self) -> None:
        """The progress bar, from when the rows are first read on (the model is loaded then)."""
        if self.bar.disable and not self.cfg.quiet:
            self.bar = _progress_bar(self.cfg, self.total, len(self.done))

    def noted(self, row: Row) -> None:
        """Warn once about each unsupported field a row had (--allow-unknown-fields)."""
        for name in set(row.ignored_fields) - self.warned:
            self.warned.add(name)
            tqdm.write(f"warning: ignoring the unsupported field {name!r} (--allow-unknown-fields); the summary "
                       "counts the rows that had it", file=sys.stderr)

    def finish(self, metadata: dict, stats: dict, token_names: Callable[[], Callable] = lambda: id_name) -> dict:
        """Write the output; return its summary with what the final line says beyond the file's: `run_wall_time_s`
        (this run's; `wall_time_s` sums every run that committed rows), `runs` (those runs) and `error_messages`
        (the most common, with their counts). Only a resume reads the pieces for them: earlier runs' rows are there."""
        runs, errors = _runs_and_errors(self.writer.pieces()) if len(self.done) else (1, _messages(self.errors))
        summary = self.writer.finalize(metadata, stats, token_names)
        return {**summary, "run_wall_time_s": round(time.time() - self.started, 3), "runs": runs,
                "error_messages": errors.most_common(ERROR_MESSAGES)}

    def check_complete(self, manifest: dict) -> None:
        """JobInterrupted if a signal stopped the run; JobError if the input changed under it."""
        if self.signals.received:
            name = signal.Signals(self.signals.received).name
            raise JobInterrupted(f"interrupted by {name}: {len(self.done) + self.writer.committed} rows committed in "
                                 f"{self.writer.parts}; run the same command again to resume",
                                 128 + self.signals.received)
        if resume.input_sha256(self.cfg.input) != manifest["job"]["input_sha256"]:  # a change the stamp missed
            raise JobError(f"input {self.cfg.input} changed while the job ran, so the job is not complete: the "
                           f"{self.writer.discard()} rows this run computed are dropped (they may come from the "
                           "changed input), those committed before are kept: restore it and run the same command "
                           "again, or pass --overwrite to start over")


class PendingRows:
    """The rows a run of a job still has to do (those that failed to parse included), read in this process as they
    are iterated (_JobRun.pending), or described for a worker process to read itself (spec())."""

    def __init__(self, job_run: _JobRun, rows: Iterator[Row]) -> None:
        self.job_run, self.rows = job_run, rows
        self.count = job_run.total - len(job_run.done)

    def __iter__(self) -> Iterator[Row]:
        return self.job_run.pending(self.rows)

    def spec(self, tokenizer) -> PrepareSpec:
        """What a worker needs to read and prepare these rows (and so the progress bar shows)."""
        job_run, cfg = self.job_run, self.job_run.cfg
        job_run.show_progress()
        return PrepareSpec(os.path.abspath(cfg.input), job_run.columns.serialize().to_pybytes(),
                           cfg.allow_unknown_fields, asdict(cfg.input_options), job_run.done.to_bytes(), cfg.chat,
                           cfg.chat_template_source, cfg.template_kwargs, tokenizer_spec(tokenizer))

    def noted(self, row: Row) -> None:
        self.job_run.noted(row)

    def take_worker_process(self) -> WorkerProcess | None:
        """The worker process started ahead for these rows, if any (once: whoever takes it stops it)."""
        process, self.job_run.worker_process = self.job_run.worker_process, None
        return process


def _runs_and_errors(pieces: list[Path]) -> tuple[int, Counter]:
    """How many runs committed the pieces, and their rows' error messages (_messages; a row in several pieces
    counts once)."""
    runs, errors = set(), {}
    for piece in pieces:
        try:
            table = pq.read_table(piece, columns=["row", "error"])
        except (OSError, pa.ArrowException):  # gone or damaged: finalize() says so
            continue
        runs.add((table.schema.metadata or {}).get(b"tinyvllm.run_started"))
        failed = table.filter(pc.is_valid(table.column("error")))
        errors.update(zip(failed.column("row").to_pylist(), failed.column("error").to_pylist()))
    return len(runs), _messages(errors)


def _messages(errors: dict[int, str]) -> Counter:
    """The rows' error messages counted without where the row is ("line 7: "), so that one mistake on many lines
    counts as one message."""
    return Counter(ROW_LOCATION.sub("", error, count=1) for error in errors.values())


def _metadata(cfg: JobConfig, defaults: SamplingParams, manifest: dict, info: dict) -> dict:
    """The output's metadata: what ran, on what, and the job's identity (what says the output is finished)."""
    return {"model": info.get("model", str(cfg.model)), "backend": info.get("backend", cfg.engine.backend),
            "batching": info.get("batching", cfg.engine.batching), "engine": info, "sampling": asdict(defaults),
            "chat": cfg.chat, "chat_template": cfg.chat_template,
            "chat_template_kwargs": cfg.template_kwargs or None, "input": cfg.input_label or str(cfg.input),
            "version": __version__,
            "job": manifest["job"], "start_time": manifest["started_at"], "end_time": resume.iso_time(time.time())}


def _progress_bar(cfg: JobConfig, total: int, initial: int) -> tqdm:
    return tqdm(total=total, initial=initial, unit="row", file=sys.stderr, disable=cfg.quiet, dynamic_ncols=True)


def sampling_defaults(cfg: JobConfig) -> SamplingParams:
    """The SamplingParams every row of the job starts from, its job-wide constraint compiled (a bad one would make
    every row an error row); JobUsageError (exit 2, as for a bad flag) names a bad one."""
    try:
        defaults = cfg.sampling_params()
        if defaults.structured_outputs is not None:
            check_constraint(defaults.structured_outputs)
    except (TypeError, ValueError) as e:
        raise JobUsageError(f"bad sampling defaults: {e}") from None
    return defaults


def prepare_request(row: Row, tokenizer, defaults: SamplingParams, cfg: JobConfig,
                    max_model_len: int) -> tuple[str | list[int], bool, SamplingParams]:
    """What to send for a row: (prompt, already templated?, its SamplingParams). ValueError: the row is bad."""
    params = row_params(row, defaults, cfg.engine.seed, max_model_len)
    return (*row_prompt(row, tokenizer, cfg.chat, cfg.chat_template_source, cfg.template_kwargs), params)


def _chat_template_source(cfg: JobConfig) -> str | None:
    """The --chat-template file's content, checked to compile; JobUsageError (one line, exit 2 as for a
    --json-schema file) if it cannot be used."""
    if cfg.chat_template is None:
        return None
    from tinyvllm.tokenizer import check_chat_template

    try:
        source = Path(cfg.chat_template).read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise JobUsageError(f"cannot read chat template {cfg.chat_template}: {why}") from None
    try:
        check_chat_template(source)
    except ValueError as e:
        raise JobUsageError(f"chat template {cfg.chat_template} is not a valid template: {e}") from None
    return source


def _check_columns(columns: pa.Schema, output: Path) -> None:
    """The carried input columns must not take a result column's name."""
    results = set(output_schema(True).names) | (set(OPENAI_LINE_KEYS) if output_format(output) == "openai" else set())
    clash = [name for name in columns.names if name in results]
    if clash:
        raise JobError(f"the input column {clash[0]!r} has the name of a result column of the output: rename it, "
                       "or leave it out with --keep-columns or --drop-input-columns")


def _check_output(output: Path, input_path: Path) -> None:
    """The output can be written and none of the files it makes can be the input. Creates nothing (its folder is
    made once the job can start: _make_output_dir)."""
    folder = _nearest_existing(output.parent)
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except OSError as e:
        raise JobError(f"cannot create output directory {output.parent}: {e.strerror}") from None
    if not folder.is_dir():
        raise JobError(f"cannot create output directory {output.parent}: {folder} is not a directory")
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
    if not os.access(folder, os.W_OK | os.X_OK):
        raise JobError(f"output directory is not writable: {folder}")
    output_format(output)


def _nearest_existing(folder: Path) -> Path:
    """`folder`, or the closest of its parents that exists."""
    while not os.path.lexists(folder) and folder.parent != folder:
        folder = folder.parent
    return folder


def _make_output_dir(output: Path) -> None:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(f"cannot create output directory {output.parent}: {e.strerror}") from None


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` is `b`: the same path once links are resolved, or the same file (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist
        return False


def _default_model() -> Path:
    from tinyvllm.fetch import default_model_path

    path = default_model_path()
    if path is None:
        raise JobError("no model given and the default model is not fetched: "
                       "run `tinyvllm fetch-default-model` (or `make run`) first")
    return path


def _token_names(cfg: JobConfig, executor) -> Callable[[], Callable]:
    """How the OpenAI output names logprobs' tokens (made when a row has logprobs): by their text and bytes, or
    "token_id:N" with return_tokens_as_token_ids."""
    if cfg.return_tokens_as_token_ids or output_format(cfg.output) != "openai":
        return lambda: id_name
    from tinyvllm.tokenizer import TokenNames

    return lambda: TokenNames(executor.tokenizer(cfg))


def load_job_tokenizer(cfg: JobConfig):
    """The job's model's tokenizer alone (a process without the job's LLM); JobError (one line) if unreadable."""
    from tinyvllm.model.loader import load_tokenizer

    try:
        return load_dummy(str(cfg.model)).tokenizer if is_dummy(cfg.model) else load_tokenizer(cfg.model)
    except (ValueError, OSError, ImportError) as e:
        raise JobError(f"cannot read the tokenizer of {cfg.model}: {e}".splitlines()[0]) from None


def load_llm(cfg: JobConfig):
    """The job's LLM; JobError (one line) if it cannot be built."""
    from tinyvllm.llm import LLM  # heavy: only once the job is known to be runnable

    try:
        return LLM(load_dummy(str(cfg.model)) if is_dummy(cfg.model) else cfg.model, **asdict(cfg.engine))
    except SettingError as e:  # a setting this model or machine cannot meet: the settings' problem, not the model's
        raise JobUsageError(str(e)) from None
    # What a bad model file, a setting the model or machine cannot meet, or a missing GPU raise; anything else is a
    # bug and keeps its traceback.
    except (ValueError, OSError, RuntimeError, MemoryError, ImportError, JobError) as e:
        raise JobError(f"cannot load model {cfg.model}: {e}".splitlines()[0]) from None
