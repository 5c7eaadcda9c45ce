"""Row preparation for a job: a row's SamplingParams and prompt (row_params, row_prompt), and PrepareWorker, a
process of its own that reads, renders and tokenizes a job's rows ahead of the engine.

Why a process: parsing rows, rendering the chat template and tokenizing is Python that holds the GIL (~0.2 ms a
row), and on a GPU host the engine's own Python step loop is the bottleneck: on a thread of the engine's process
each microsecond of it can delay the engine. The worker runs it in its own interpreter; the engine's thread takes
the prepared rows off a pipe (decoding, the row's SamplingParams), one row at a time as it admits them.

What crosses the pipes are plain values as bytes (jobs/wire.py: JSON, with tuples, bytes and what a Parquet input's
carried columns hold, datetimes and decimals, tagged): nothing is pickled, so a message builds no object but those.
The token ids of a batch's text rows follow its message as one int32 frame (pack_ids): the engine checks an int32
array's ids in one reduction, where JSON would cost its thread ~0.1 us a token to decode.
The worker gets the job's settings and the tokenizer as data (PrepareSpec: its tokenizer.json text and special
tokens), so it tokenizes as the LLM's own tokenizer does, however that was loaded (a probe text is checked at
start); it reads the input itself, skipping the rows already committed. Its process starts before the job's model
loads (WorkerProcess: the interpreter and its imports, ~0.3 s, overlap the load) and waits there for the spec.

Order and exactly-once: the worker sends the rows in input order, error rows in place, then an end message (or the
error reading raised); the engine's thread admits and emits them in that order, as it does the in-process
producer's (jobs/run.py RowPipeline): the commits, pieces and resume do not know which prepared a row.
Bounded: at most PREPARE_AHEAD rows sent and not yet taken (the engine's side acknowledges each batch it takes).
Lifetime: the worker ignores SIGINT/SIGTERM (the job stops it) and exits once its pipes close, so a job that dies,
however it dies, leaves no worker behind; close() waits for it (no zombie).
"""

from __future__ import annotations

import array
import collections
import copy
import hashlib
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from tinyvllm.errors import JobError, JobUsageError
from tinyvllm.io.readers import InputOptions, Row, read_rows
from tinyvllm.jobs import wire
from tinyvllm.sampling_params import SamplingParams

PREPARE_AHEAD = 256  # rows read, rendered and tokenized ahead of the engine
PREPARE_BATCH = 64  # rows prepared (and sent) at once
WORKER_MIN_ROWS = 1000  # prepare_workers unset: a worker for a job of this many rows to do or more
START_SECONDS = 60.0  # the worker's start (imports, tokenizer) takes at most this long
STOP_SECONDS = 2.0  # close(): the worker exits within this, else it is killed
OVERRIDDEN_CACHE = 256  # distinct rows' overrides whose SamplingParams the engine's side keeps
PROBE = "Probe: the worker's tokenizer must match. 12,345 <|begin_of_text|> é\n"
END = object()  # the last item of the rows: no rows left
ERRORS = {cls.__name__: cls for cls in (JobError, JobUsageError)}  # what reading the rows raises on purpose


def wants_worker(prepare_workers: int | None, rows: int) -> bool:
    """Whether a job of `rows` rows to do has them prepared in a worker process: prepare_workers 1, or unset and
    WORKER_MIN_ROWS rows or more."""
    return prepare_workers != 0 and (prepare_workers is not None or rows >= WORKER_MIN_ROWS)


class WorkerUnavailable(Exception):
    """The worker could not start (the job prepares its rows in process)."""


def row_params(row: Row, defaults: SamplingParams, seed: int, max_model_len: int,
               overridden: dict | None = None) -> SamplingParams:
    """The row's SamplingParams: `defaults` with its overrides, its own seed unless one is given. ValueError: the
    row is bad. `overridden`: a cache of defaults.with_overrides by overrides (it checks every field: most of a
    row's preparation)."""
    if not row.overrides:
        params = defaults
    elif overridden is None:
        params = defaults.with_overrides(row.overrides)
    else:
        key = repr(row.overrides)
        params = overridden.get(key)
        if params is None:
            if len(overridden) >= OVERRIDDEN_CACHE:
                overridden.clear()
            params = overridden[key] = defaults.with_overrides(row.overrides)
    if params.max_tokens is not None and params.max_tokens > max_model_len:
        raise ValueError(f"invalid max_tokens={params.max_tokens}: more than max_model_len={max_model_len}")
    if params.seed is None:
        params = with_seed(params, row_seed(seed, row.index))
    return params


def with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    """A copy of checked `params` with a seed from row_seed (in range by construction): replace() would check
    every field again, which is most of a plain row's preparation."""
    params = copy.copy(params)
    params.seed = seed
    return params


def row_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()) >> 1


def row_prompt(row: Row, tokenizer, chat: bool, template: str | None,
               template_kwargs: dict) -> tuple[str | list[int], bool]:
    """What to send for a row: (prompt, already templated?); its messages rendered with `template` (None: the
    tokenizer's). ValueError: the row is bad."""
    messages = row.messages
    if messages is None and chat and isinstance(row.prompt, str):
        messages = [{"role": "user", "content": row.prompt}]
    if messages is None:
        if row.chat_options:
            raise ValueError(f"{next(iter(row.chat_options))} applies to a chat (messages, or --chat), not to a "
                             "prompt")
        return row.prompt, False
    options = row.chat_options
    kwargs = {**template_kwargs, **options.get("chat_template_kwargs", {})}  # the row's own keys win
    try:
        return tokenizer.apply_chat_template(
            messages, options.get("add_generation_prompt", True), chat_template=template,
            continue_final_message=options.get("continue_final_message", False), **kwargs), True
    except Exception as e:  # a template may raise anything (jinja's raise_exception): it is this row's problem
        raise ValueError(f"chat template failed: {e}") from None


def readable(rows: Iterator[Row], path: Path) -> Iterator[Row]:
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


@dataclass
class PrepareSpec:
    """What the worker needs, as plain values: where and how to read the rows, which to skip, how to render and
    tokenize them."""

    input: str
    columns: bytes  # the carried input columns: their Arrow schema, serialized
    allow_unknown_fields: bool
    input_options: dict  # InputOptions' fields
    done: bytes  # RowSet.to_bytes() of the rows committed: skipped
    chat: bool
    chat_template: str | None  # a template's source, instead of the tokenizer's
    template_kwargs: dict
    tokenizer: dict  # tokenizer_spec()


def tokenizer_spec(tokenizer) -> dict:
    """The Tokenizer as plain values (tokenizer_from_spec makes it again): what encodes and renders a prompt."""
    return {"json": tokenizer.backend.to_str(), "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "add_bos": tokenizer.add_bos, "chat_template": tokenizer.chat_template,
            "unk_token": tokenizer.unk_token}


def tokenizer_from_spec(spec: dict):
    import tokenizers

    from tinyvllm.tokenizer import Tokenizer

    return Tokenizer(tokenizers.Tokenizer.from_str(spec["json"]), bos_token=spec["bos_token"],
                     eos_tokens=[spec["eos_token"]] if spec["eos_token"] else [], add_bos=spec["add_bos"],
                     chat_template=spec["chat_template"], unk_token=spec["unk_token"])


def probe_ids(tokenizer) -> list[list[int]]:
    """PROBE's token ids, as text and as templated text: the two tokenizers must agree on them."""
    return tokenizer.encode_prompts([(PROBE, False), (PROBE, True)])


def unsendable_column(spec: PrepareSpec) -> str | None:
    """Why the rows of `spec` cannot cross the pipes as wire values (None: they can): a carried column of a type
    whose Python values wire.py has no form for (intervals, extension types, nanosecond times, which pyarrow gives
    as objects of other libraries), or template variables it has none for."""
    import pyarrow as pa

    def sendable(t: pa.DataType) -> bool:
        if pa.types.is_interval(t) or isinstance(t, pa.ExtensionType) or getattr(t, "unit", None) == "ns":
            return False
        if pa.types.is_dictionary(t):
            return sendable(t.value_type)
        return all(sendable(t.field(i).type) for i in range(t.num_fields))

    for f in pa.ipc.read_schema(pa.py_buffer(spec.columns)):
        if not sendable(f.type):
            return f"the input's column {f.name!r} ({f.type}) cannot cross to it"
    if not wire.supported(spec.template_kwargs):
        return "the chat template variables cannot cross to it"
    return None


def send(conn: Connection, message) -> None:
    conn.send_bytes(wire.dumps(message))


def receive(conn: Connection):
    """The next message; EOFError once the other end has closed."""
    return wire.loads(conn.recv_bytes())


# ---- the engine's side ----

class PrepareWorker:
    """The engine's end of a worker: start() it on a job's rows, get() the prepared rows in order, close() it.

    `complete(row, failure, prompt, templated, token_ids)` makes the item the engine's thread admits, (row,
    prepared), from what the worker sent: the row (its error, if reading it failed), why preparing it failed
    (None: it did not), its text (None: a prompt of token ids), whether it was templated, and its token ids."""

    def __init__(self, process: WorkerProcess, complete: Callable) -> None:
        self.process, self.proc, self.rx, self.tx = process, process.proc, process.rx, process.tx
        self.complete = complete
        self.items: collections.deque = collections.deque()

    @classmethod
    def start(cls, spec: PrepareSpec, tokenizer, complete: Callable,
              process: WorkerProcess | None = None) -> PrepareWorker:
        """A worker running, its tokenizer checked against `tokenizer`; WorkerUnavailable says why not. `process`:
        one started ahead (WorkerProcess.start, while the model loaded), else one is started now."""
        unsendable = unsendable_column(spec)
        if unsendable:
            if process is not None:
                process.close()  # not needed: it does not wait for the job's end
            raise WorkerUnavailable(unsendable)
        process = process if process is not None else WorkerProcess.start()
        process.taken = True  # this worker stops it now
        worker = cls(process, complete)
        try:
            worker._handshake(spec, tokenizer)
        except BaseException:
            worker.close()
            raise
        return worker

    def _handshake(self, spec: PrepareSpec, tokenizer) -> None:
        try:
            send(self.tx, asdict(spec))
            if not self.rx.poll(START_SECONDS):
                raise WorkerUnavailable(f"it did not start within {START_SECONDS:.0f} s")
            message = receive(self.rx)
        except (OSError, EOFError):
            raise WorkerUnavailable(f"it exited at start (exit code {self.proc.wait()})") from None
        if message[0] == "failed":
            raise WorkerUnavailable(message[1].strip().splitlines()[-1])
        if message != ("ready", probe_ids(tokenizer)):
            raise WorkerUnavailable("its tokenizer does not tokenize as the model's")

    def get(self, block: bool, stopped: Callable[[], bool]):
        """The next item: (row, prepared), END, or the exception to raise; None if there is none yet (block: wait
        for one, unless stopped())."""
        while not self.items:
            if not self.rx.poll(0.1 if block else 0):
                if not block or stopped():
                    return None
                continue
            self._receive()
        item = self.items.popleft()
        if type(item) is list:  # a row as sent: made into its item when taken, so a batch costs no step at once
            index, row_id, columns, ignored, error, overrides, *prepared = item
            return self.complete(Row(index, row_id, overrides=overrides, ignored_fields=ignored, columns=columns,
                                     error=error), *prepared)
        return item

    def _receive(self) -> None:
        try:
            kind, *body = receive(self.rx)
        except EOFError:
            raise self._exited() from None
        if kind == "rows":
            packed = self._recv_ids()
            try:
                send(self.tx, len(body[0]))  # acknowledged: the worker may send as many more
            except OSError:  # it is gone: the next receive() says so
                pass
            self.items.extend(unpack_ids(body[0], packed))
        elif kind == "end":
            self.items.append(END)
        elif kind == "error":
            self.items.append(ERRORS[body[0]](body[1]))
        else:
            self.items.append(RuntimeError(f"the row preparation worker failed:\n{body[0]}"))

    def _recv_ids(self) -> np.ndarray:
        try:
            return np.frombuffer(self.rx.recv_bytes(), np.int32)
        except EOFError:
            raise self._exited() from None

    def _exited(self) -> JobError:
        return JobError(f"the row preparation worker exited unexpectedly (exit code {self.proc.wait()}); the rows "
                        "committed are kept: run the same command again to resume")

    def close(self) -> None:
        """Stop the worker (closing its pipes ends it) and wait for it."""
        self.process.stop()


class WorkerProcess:
    """A worker's process and pipes, started before its rows are known (it imports meanwhile, then waits for its
    PrepareSpec): a job starts one while its model loads. close() stops it unless a PrepareWorker took it."""

    def __init__(self, proc: subprocess.Popen, rx: Connection, tx: Connection) -> None:
        self.proc, self.rx, self.tx = proc, rx, tx
        self.taken = False

    @classmethod
    def start(cls) -> WorkerProcess:
        """WorkerUnavailable if no process can start."""
        to_parent, to_child = os.pipe(), os.pipe()  # (read end, write end) each
        root = str(Path(__file__).resolve().parents[2])  # this tinyvllm's, whatever sys.path the worker gets
        code = (f"import sys; sys.path.insert(0, {root!r}); from tinyvllm.jobs.prepare import worker_main; "
                f"worker_main({to_child[0]}, {to_parent[1]})")
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(to_child[0], to_parent[1]),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, ValueError) as e:  # no executable, no processes left, a sandbox that forbids them
            for fd in (*to_parent, *to_child):
                os.close(fd)
            raise WorkerUnavailable(f"cannot start a process: {e}") from None
        os.close(to_child[0])  # the worker's ends: its own copies are open in it
        os.close(to_parent[1])
        return cls(proc, Connection(to_parent[0], writable=False), Connection(to_child[1], readable=False))

    def close(self) -> None:
        """Stop it if no worker took it (that worker stops it)."""
        if not self.taken:
            self.stop()

    def stop(self) -> None:
        """Close its pipes (which ends it) and wait for it; again: nothing."""
        self.tx.close()
        self.rx.close()
        try:
            self.proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:  # inside one row's template (at most tokenizer.TEMPLATE_SECONDS)
            self.proc.kill()
            self.proc.wait()


# ---- the worker ----

def worker_main(rx_fd: int, tx_fd: int) -> None:
    """The worker process: PrepareSpec in, then the prepared rows out, in batches, until the input ends or the
    pipes close."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # the job stops it, by closing the pipes
        signal.signal(signum, signal.SIG_IGN)
    rx, tx = Connection(rx_fd, writable=False), Connection(tx_fd, readable=False)
    try:
        _Worker(PrepareSpec(**receive(rx)), rx, tx).run()
    except (EOFError, OSError):  # the job closed the pipes: it is done with the rows, or gone
        return
    except Exception:
        try:
            send(tx, ("failed", traceback.format_exc()))
            while True:  # until the job has read it and closes the pipes
                receive(rx)
        except (EOFError, OSError):
            return


class _Worker:
    def __init__(self, spec: PrepareSpec, rx: Connection, tx: Connection) -> None:
        import pyarrow as pa

        from tinyvllm.io.writer import RowSet

        self.spec, self.rx, self.tx = spec, rx, tx
        self.tokenizer = tokenizer_from_spec(spec.tokenizer)
        self.columns = pa.ipc.read_schema(pa.py_buffer(spec.columns))
        self.done = RowSet.from_bytes(spec.done)
        self.unacked = 0  # rows sent and not yet acknowledged

    def run(self) -> None:
        send(self.tx, ("ready", probe_ids(self.tokenizer)))
        try:
            for batch in self._batches():
                self._send(self._prepare(batch))
            end: tuple = ("end",)
        except JobError as e:  # the engine's thread raises it, after the rows before it
            end = ("error", type(e).__name__ if type(e).__name__ in ERRORS else "JobError", str(e))
        send(self.tx, end)
        while True:  # acknowledgements, until the job closes the pipes
            receive(self.rx)

    def _batches(self) -> Iterator[list[Row]]:
        """The rows not committed, in batches: the first alone (the engine starts at once), then doubling up to
        PREPARE_BATCH."""
        spec = self.spec
        rows = read_rows(spec.input, self.columns, spec.allow_unknown_fields, InputOptions(**spec.input_options))
        batch: list[Row] = []
        size = 1
        for row in readable(rows, Path(spec.input)):
            if row.index in self.done:
                continue
            batch.append(row)
            if len(batch) >= size:
                yield batch
                batch, size = [], min(2 * size, PREPARE_BATCH)
        if batch:
            yield batch

    def _prepare(self, batch: list[Row]) -> list[list]:
        """Per row: [index, id, carried columns, ignored fields, error, overrides, failure, text, templated, token
        ids] (lists, not tuples: a tuple crosses the pipe tagged, and its revival costs the engine's thread). The texts
        are tokenized together (Tokenizer.encode_prompts)."""
        spec = self.spec
        prepared: list[list] = []
        for row in batch:
            failure = text = templated = ids = None
            if row.error is None:
                try:
                    prompt, templated = row_prompt(row, self.tokenizer, spec.chat, spec.chat_template,
                                                   spec.template_kwargs)
                    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
                except ValueError as e:
                    failure = str(e)
            prepared.append([row.index, row.id, row.columns, row.ignored_fields, row.error, row.overrides, failure,
                             text, templated, ids])
        texts = [p for p in prepared if p[7] is not None]
        for p, ids in zip(texts, self.tokenizer.encode_prompts([(p[7], p[8]) for p in texts])):
            p[9] = ids
        return prepared

    def _send(self, items: list[list]) -> None:
        while self.unacked and self.unacked + len(items) > PREPARE_AHEAD:
            self.unacked -= receive(self.rx)
        packed = pack_ids(items)
        send(self.tx, ("rows", items))
        self.tx.send_bytes(packed)
        self.unacked += len(items)


# ---- the rows' token ids on the pipe ----

def pack_ids(items: list[list]) -> bytes:
    """The token ids of the rows whose text the worker tokenized, as one int32 buffer (the message's second frame);
    each such row's ids field becomes their count. Decoding ids from JSON costs the engine's thread ~0.1 us a token,
    taking them from the buffer a few us a row. Ids that came as the row's prompt stay in the JSON as they are, for
    the engine to check."""
    ids = array.array("i")
    for item in items:
        if item[7] is not None:  # a text prompt: the tokenizer's ids
            ids.extend(item[9])
            item[9] = len(item[9])
    return ids.tobytes()


def unpack_ids(items: list[list], packed: np.ndarray) -> list[list]:
    """pack_ids undone: each counted ids field becomes the row's slice of `packed` (int32)."""
    start = 0
    for item in items:
        if item[7] is not None:
            item[9], start = packed[start:start + item[9]], start + item[9]
    if start != len(packed):
        raise RuntimeError(f"the row preparation worker sent {len(packed)} token ids for rows holding {start}")
    return items
