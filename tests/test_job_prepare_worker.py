"""The row preparation worker (jobs/prepare.py): a job's output is the same with and without it, bad rows still
become error rows in place, an interrupted job resumes exactly once, and the worker leaves nothing behind."""

import os
import signal
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import Crash, ok_run, run, write_jsonl

from tinyvllm.io import PartsWriter
from tinyvllm.io.writer import output_schema, records_table
from tinyvllm.jobs import prepare
from tinyvllm.jobs.prepare import PrepareWorker

GREEDY = ("--temperature", "0", "--max-tokens", "3", "--piece-rows", "7", "--max-num-seqs", "4")


def rows(n: int = 40) -> list:
    """Plain, chat and token-id rows, per-row overrides, and bad rows of each kind: unparseable, a bad field, a
    chat option on a plain prompt, more max_tokens than the context, a token id outside the vocabulary."""
    out = []
    for i in range(n):
        if i % 9 == 4:
            out.append({"prompt": f"p{i}", "max_tokenz": 3})
        elif i % 9 == 5:
            out.append({"prompt": f"p{i}", "add_generation_prompt": False})
        elif i % 9 == 6:
            out.append({"prompt": f"p{i}", "max_tokens": 1 << 20})
        elif i % 9 == 7:  # token ids: they cross as JSON, the engine checks them (16's are outside the vocabulary)
            out.append({"prompt": [5, 100000] if i == 16 else [4 + i % 5, 3]})
        elif i % 3 == 0:
            out.append({"id": f"c{i}", "messages": [{"role": "user", "content": f"chat {i} about words"}],
                        "temperature": 0.5, "seed": i})
        else:
            out.append({"prompt": f"plain prompt {i}", "keep": i})
    return out


def job_input(tmp_path, n: int = 40):
    src = write_jsonl(tmp_path / "in.jsonl", rows(n))
    with open(src, "a") as f:
        f.write("{not json\n")
    return src


def comparable(table: pa.Table) -> pa.Table:
    return table.drop_columns(["finished_at", "ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"]
                              if "queue_ms" in table.column_names else ["finished_at"])


def results(table: pa.Table) -> dict:
    keep = [n for n in table.column_names if not n.endswith("_ms") and n != "finished_at"]
    return table.select(keep).to_pydict()


@pytest.fixture
def started(monkeypatch):
    """The PrepareWorkers started, kept to check they ended."""
    workers = []
    start = PrepareWorker.start.__func__

    def keep(cls, *args):
        worker = start(cls, *args)
        workers.append(worker)
        return worker

    monkeypatch.setattr(PrepareWorker, "start", classmethod(keep))
    return workers


def test_outputs_are_the_same_with_and_without_the_worker(tiny_model_dir, tmp_path, started):
    src = job_input(tmp_path)
    without = ok_run(tiny_model_dir, src, tmp_path / "a.parquet", *GREEDY, "--prepare-workers", "0")
    assert not started
    with_worker = ok_run(tiny_model_dir, src, tmp_path / "b.parquet", *GREEDY, "--prepare-workers", "1")
    assert len(started) == 1 and started[0].proc.returncode == 0  # it ran, and was waited for
    assert results(with_worker) == results(without)
    errors = dict(zip(with_worker.column("row").to_pylist(), with_worker.column("error").to_pylist()))
    assert all(errors[i] is not None for i in range(40) if i % 9 in (4, 5, 6)) and errors[40] is not None
    assert "outside the vocabulary" in errors[16]
    assert sum(e is not None for e in errors.values()) == 3 * 4 + 2  # and the line that is not JSON


def test_token_ids_cross_packed_exactly():
    """The ids of tokenized text rows cross as one int32 frame and come back as each row's own array; rows whose
    prompt was ids keep them in the JSON; a frame that does not match the rows' counts is refused."""
    items = [[0, None, {}, None, None, None, None, "a", False, [7, 8, 9]],
             [1, None, {}, None, "bad row", None, None, None, None, None],
             [2, None, {}, None, None, None, None, None, False, [1, 2.0, -3]],
             [3, None, {}, None, None, None, None, "b", True, []],
             [4, None, {}, None, None, None, None, "c", True, [2 ** 31 - 1, 0]]]
    sent = [list(item) for item in items]
    frame = prepare.pack_ids(sent)
    assert [item[9] for item in sent] == [3, None, [1, 2.0, -3], 0, 2]
    back = prepare.unpack_ids(sent, np.frombuffer(frame, np.int32))
    for got, want in zip(back, items):
        assert type(got[9]) is type(want[9]) if want[7] is None else isinstance(got[9], np.ndarray)
        assert list(got[9] if got[9] is not None else []) == list(want[9] or [])
    with pytest.raises(RuntimeError, match="sent 4 token ids for rows holding 5"):
        prepare.unpack_ids([list(items[0])[:9] + [2], list(items[4])[:9] + [3]], np.zeros(4, np.int32))


def test_the_worker_by_default_only_for_large_jobs(tiny_model_dir, tmp_path, started, monkeypatch):
    src = job_input(tmp_path, 10)
    ok_run(tiny_model_dir, src, tmp_path / "a.parquet", *GREEDY)
    assert not started
    monkeypatch.setattr("tinyvllm.jobs.prepare.WORKER_MIN_ROWS", 5)
    ok_run(tiny_model_dir, src, tmp_path / "b.parquet", *GREEDY)
    assert len(started) == 1


def test_resume_after_a_crash_is_exactly_once(tiny_model_dir, tmp_path, started, monkeypatch):
    src = job_input(tmp_path)
    reference = ok_run(tiny_model_dir, src, tmp_path / "ref.parquet", *GREEDY, "--prepare-workers", "0")
    out = tmp_path / "out.parquet"
    add, added = PartsWriter.add, []

    def crash_midway(self, record):
        added.append(record["row"])
        if len(added) == 20:
            raise Crash()
        add(self, record)

    with monkeypatch.context() as m:
        m.setattr(PartsWriter, "add", crash_midway)
        result = run(tiny_model_dir, src, out, *GREEDY, "--prepare-workers", "1")
    assert isinstance(result.exception, Crash)
    assert started[0].proc.returncode is not None  # waited for, even on an error
    final = ok_run(tiny_model_dir, src, out, *GREEDY, "--prepare-workers", "1")
    assert final.column("row").to_pylist() == list(range(41))
    assert results(final) == results(reference)


def test_a_worker_that_cannot_start_falls_back_in_process(tiny_model_dir, tmp_path, monkeypatch, capsys):
    src = job_input(tmp_path)
    reference = ok_run(tiny_model_dir, src, tmp_path / "ref.parquet", *GREEDY, "--prepare-workers", "0")
    monkeypatch.setattr("sys.executable", "/nonexistent/python")
    result = run(tiny_model_dir, src, tmp_path / "out.parquet", *GREEDY, "--prepare-workers", "1")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("preparing the rows in this process") == 1
    assert results(pq.read_table(tmp_path / "out.parquet")) == results(reference)


def test_a_worker_whose_tokenizer_differs_is_not_used(tiny_model_dir, tmp_path, monkeypatch):
    src = job_input(tmp_path)
    monkeypatch.setattr(prepare, "probe_ids", lambda tokenizer: [[os.getpid()]])  # differs in the worker
    result = run(tiny_model_dir, src, tmp_path / "out.parquet", *GREEDY, "--prepare-workers", "1")
    assert result.exit_code == 0 and "does not tokenize as the model's" in result.stderr


def test_the_worker_exits_when_its_job_dies(tiny_model_dir, tmp_path):
    """Its pipes close when the job's process dies, however it dies: the worker exits (it ignores SIGINT and
    SIGTERM, which the job handles)."""
    import subprocess
    import sys

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i} " * 50} for i in range(3000)])
    code = ("import sys, time; from tinyvllm.cli import main; main(sys.argv[1:])")
    job = subprocess.Popen([sys.executable, "-c", code, "run", "--model", str(tiny_model_dir), "--input", str(src),
                            "--output", str(tmp_path / "out.parquet"), "--backend", "numpy", "--quiet",
                            "--max-tokens", "64", "--prepare-workers", "1"], stderr=subprocess.PIPE)
    worker = None
    for _ in range(600):  # its worker: a child of the job
        children = _children(job.pid)
        if children:
            worker = children[0]
            break
        time.sleep(0.05)
    assert worker is not None
    time.sleep(1.0)
    os.kill(worker, signal.SIGINT)  # ignored
    time.sleep(0.2)
    assert _alive(worker)
    job.kill()
    job.wait()
    for _ in range(100):
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped by whoever inherited it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_records_table_is_from_pylist(tmp_path):
    schema = output_schema(True, pa.schema([("keep", pa.int64()), ("tags", pa.list_(pa.string()))]))
    records = [{"row": 0, "id": "a", "completion": "x", "sampling": {"temperature": 0.5, "stop": ["s"]},
                "completion_token_ids": [1, 2], "logprobs": [-0.5], "top_logprobs": [[{"token_id": 1, "logprob": -1.0}]],
                "keep": 3, "tags": ["t"]},
               {"row": 1, "id": "b", "error": "bad", "keep": None}]
    assert records_table(records, schema).equals(pa.Table.from_pylist(records, schema=schema))


def typed_parquet(tmp_path, extra: dict | None = None):
    """A Parquet input whose carried columns hold the Arrow types a job carries as Python objects."""
    import datetime as dt
    from decimal import Decimal

    n = 12
    columns = {
        "prompt": pa.array([f"typed prompt {i}" for i in range(n)]),
        "when": pa.array([dt.datetime(2024, 1, 1 + i, 12, tzinfo=dt.timezone.utc) for i in range(n)],
                         pa.timestamp("us", tz="Europe/Paris")),
        "day": pa.array([dt.date(2024, 2, 1 + i) for i in range(n)]),
        "price": pa.array([Decimal(f"{i}.25") for i in range(n)], pa.decimal128(8, 2)),
        "blob": pa.array([bytes([i, 255 - i]) for i in range(n)]),
        "tags": pa.array([[("a", i), ("b", None)] for i in range(n)], pa.map_(pa.string(), pa.int64())),
        "meta": pa.array([{"k": i, "v": [i, i + 1]} for i in range(n)]),
        "took": pa.array([dt.timedelta(seconds=i) for i in range(n)]),
        **(extra or {}),
    }
    pq.write_table(pa.table(columns), tmp_path / "typed.parquet")
    return tmp_path / "typed.parquet"


def test_typed_parquet_columns_cross_the_worker_exactly(tiny_model_dir, tmp_path, started, monkeypatch):
    """The carried columns of a Parquet input come out the same through the worker's pipes (wire.py: no pickle;
    the job's process never unpickles a message)."""
    import multiprocessing.connection
    import pickle

    src = typed_parquet(tmp_path)
    without = ok_run(tiny_model_dir, src, tmp_path / "a.parquet", *GREEDY, "--prepare-workers", "0")

    def refuse(*args, **kwargs):
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(multiprocessing.connection._ForkingPickler, "loads", refuse)
    with_worker = ok_run(tiny_model_dir, src, tmp_path / "b.parquet", *GREEDY, "--prepare-workers", "1")
    assert len(started) == 1 and started[0].proc.returncode == 0
    assert with_worker.schema == without.schema
    assert results(with_worker) == results(without)
    assert with_worker.column("error").null_count == 12


def test_a_column_the_pipes_cannot_carry_keeps_the_rows_in_process(tiny_model_dir, tmp_path, started, capsys):
    src = typed_parquet(tmp_path, {"stamp": pa.array(range(12), pa.timestamp("ns"))})  # as pandas writes them
    result = run(tiny_model_dir, src, tmp_path / "out.parquet", *GREEDY, "--prepare-workers", "1")
    assert result.exit_code == 0, result.output
    assert not started
    assert result.stderr.count("preparing the rows in this process") == 1
    assert "'stamp'" in result.stderr


@pytest.fixture
def ahead(monkeypatch):
    """The worker processes started ahead of their jobs (WorkerProcess.start), kept to check who took and ended them."""
    processes = []
    start = prepare.WorkerProcess.start.__func__

    def keep(cls):
        process = start(cls)
        processes.append(process)
        return process

    monkeypatch.setattr(prepare.WorkerProcess, "start", classmethod(keep))
    return processes


def test_the_worker_process_starts_while_the_model_loads(tiny_model_dir, tmp_path, started, ahead, monkeypatch):
    """A job that will use a worker starts its process before the model loads (it imports meanwhile), and the
    worker takes that one: one process a job, waited for at the end; a job that will not use one starts none."""
    from tinyvllm.jobs import run as job_run

    order = []
    load = job_run.load_llm
    monkeypatch.setattr(job_run, "load_llm", lambda cfg: (order.append(len(ahead)), load(cfg))[1])
    src = job_input(tmp_path)
    ok_run(tiny_model_dir, src, tmp_path / "a.parquet", *GREEDY, "--prepare-workers", "0")
    assert not ahead and not started
    out = ok_run(tiny_model_dir, src, tmp_path / "b.parquet", *GREEDY, "--prepare-workers", "1")
    assert order == [0, 1], "started before the second job's model loaded"
    assert len(ahead) == 1 and len(started) == 1 and started[0].process is ahead[0]
    assert ahead[0].proc.returncode == 0
    assert out.column("row").to_pylist() == list(range(41))


def test_a_worker_process_no_worker_takes_is_stopped(tiny_model_dir, tmp_path, started, ahead):
    """A process started ahead for rows that then stay in this process (a column the pipes cannot carry) is
    stopped and waited for when the job ends."""
    src = typed_parquet(tmp_path, {"stamp": pa.array(range(12), pa.timestamp("ns"))})
    result = run(tiny_model_dir, src, tmp_path / "out.parquet", *GREEDY, "--prepare-workers", "1")
    assert result.exit_code == 0, result.output
    assert not started and len(ahead) == 1
    assert not ahead[0].taken and ahead[0].proc.returncode is not None
