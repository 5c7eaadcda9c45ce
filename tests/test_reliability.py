"""Jobs that cannot lose a row (issue 18): one writer per output, exactly-once results, the input never destroyed,
damaged pieces and full disks reported in one line. Each test is the failure seen before, and what happens now."""

import errno
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import EXAMPLES, Crash, cli, job_args, ok_run, one_line_error, run

from tinyvllm.errors import JobError
from tinyvllm.io import PartsWriter, Row, output_record
from tinyvllm.io.writer import output_schema, parts_dir, remove_dead_temps, summary_path
from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.run import complete_rows
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams

PROMPTS = EXAMPLES / "prompts.jsonl"
GREEDY = ("--temperature", "0", "--max-tokens", "4", "--piece-rows", "3")


def texts(table: pa.Table) -> list:
    return list(zip(table.column("row").to_pylist(), table.column("completion").to_pylist()))


@pytest.fixture(scope="module")
def greedy_reference(tiny_model_dir, tmp_path_factory) -> pa.Table:
    return ok_run(tiny_model_dir, PROMPTS, tmp_path_factory.mktemp("ref") / "ref.parquet", *GREEDY)


def committed_not_finalized(model, src, out, monkeypatch, *args) -> Path:
    """Run the job until every row is committed, then crash before the output is assembled; returns the parts."""
    def crash(self, *a, **k):
        raise Crash

    with monkeypatch.context() as m:
        m.setattr(PartsWriter, "finalize", crash)
        result = run(model, src, out, *GREEDY, *args)
    assert isinstance(result.exception, Crash), result.output
    assert not out.exists()
    return parts_dir(out)


def records(rows):
    return [output_record(i, f"id{i}", f"p{i}", error=f"e{i}") for i in rows]


# ---- 1. mutual exclusion ----

HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, bytes.fromhex(sys.argv[2])); "
        "print('held', flush=True); time.sleep(60)")


@pytest.mark.parametrize("note", [b"1 " + os.uname().nodename.encode(), b"\x00\xff\x13garbage"],
                         ids=["dead-pid", "binary"])
def test_a_held_lock_keeps_a_second_run_out(tiny_model_dir, tmp_path, note):
    """Before: a lock naming a dead pid on this host (a run in another pid namespace) was judged stale and broken."""
    out = tmp_path / "out.parquet"
    lock = parts_dir(out) / "lock"
    lock.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), note.hex()], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        result = run(tiny_model_dir, PROMPTS, out)
        assert "is being written by another run" in one_line_error(result, exit_code=75)
        assert ("pid 1 on" if note.startswith(b"1 ") else "its lock names no process") in result.stderr
        assert "delete" not in result.stderr and "remove" not in result.stderr and not out.exists()
    finally:
        holder.kill()
        holder.wait()


def test_lock_removed_mid_run(tiny_model_dir, reference, tmp_path):
    """Before: deleting the lock let a second run in; both wrote pieces of the same names and deleted each other's
    temp files (206 rows for 200). Now the first run stops at its next commit and the second finishes the job."""
    src, ref = reference
    out = tmp_path / "out.parquet"
    first = cli(*job_args(tiny_model_dir, src, out))
    while first.poll() is None and len(list(parts_dir(out).glob("piece-*.parquet"))) < 2:
        time.sleep(0.002)
    (parts_dir(out) / "lock").unlink()
    second = cli(*job_args(tiny_model_dir, src, out))
    assert second.wait() == 0, second.communicate()[1]
    _, stderr = first.communicate()
    assert first.returncode == 75 and "lost the lock" in stderr and "Traceback" not in stderr
    table = pq.read_table(out)
    assert table.column("row").to_pylist() == list(range(ref.num_rows))
    assert table.column("completion").to_pylist() == ref.column("completion").to_pylist()


def test_a_live_writers_temp_file_is_left_alone(tmp_path):
    """Before: a new run deleted every *.tmp, including those another live run was writing."""
    parts = tmp_path / "out.parquet.parts"
    parts.mkdir()
    live, dead, link = parts / "piece-a.parquet.x.tmp", parts / "piece-b.parquet.y.tmp", parts / "c.tmp"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    dead.write_bytes(b"half a piece")
    link.symlink_to(victim)
    fd = os.open(live, os.O_WRONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as atomic_write holds it while writing
    try:
        remove_dead_temps(parts)
        assert live.exists() and not dead.exists() and not link.is_symlink() and victim.read_text() == "keep"
    finally:
        os.close(fd)
    remove_dead_temps(parts)
    assert not live.exists()


def test_pieces_of_two_runs_never_share_a_name(tmp_path):
    out = tmp_path / "out.parquet"
    names = set()
    for _ in range(2):  # two runs, each committing its first piece
        writer = PartsWriter(out, output_schema(), 0.0, num_rows=2)
        writer.add(output_record(0, "a", "p", error="x"))
        writer.flush()
        names |= {p.name for p in writer.pieces()}
    assert len(names) == 2


def test_a_run_that_loses_its_lock_while_finishing_removes_no_piece(tmp_path):
    """Before the check, the soak saw a run whose lock was deleted as it finished remove the pieces that the run
    which took the new lock was reading."""
    out = tmp_path / "out.parquet"

    def lock_lost_once_the_output_is_written():
        if out.exists():
            raise JobError("lost the lock")

    writer = PartsWriter(out, output_schema(), 0.0, num_rows=3, guard=lock_lost_once_the_output_is_written)
    for rec in records([0, 1, 2]):
        writer.add(rec)
    with pytest.raises(JobError, match="lost the lock"):
        writer.finalize({})
    assert out.exists() and len(writer.pieces()) == 1


# ---- 2. exactly once ----

def test_finalize_refuses_a_short_result(tmp_path):
    out = tmp_path / "out.parquet"
    writer = PartsWriter(out, output_schema(), 0.0, num_rows=10, piece_rows=4)
    for rec in records([0, 1, 2, 3, 4, 5, 7, 9]):
        writer.add(rec)
    with pytest.raises(JobError, match=r"not complete: 2 of 10 rows have no result \(the first is row 6\)"):
        writer.finalize({})
    assert not out.exists() and sorted(writer.committed_rows()) == [0, 1, 2, 3, 4, 5, 7, 9]


def test_finalize_keeps_a_row_once_when_pieces_overlap(tmp_path):
    """Before: a copied piece gave 216 rows for 200."""
    out = tmp_path / "out.parquet"
    writer = PartsWriter(out, output_schema(), 0.0, num_rows=6, piece_rows=3)
    for rec in records([0, 1, 2, 3, 4, 5]):
        writer.add(rec)
    first = writer.pieces()[0]
    (first.parent / "piece-copied.parquet").write_bytes(first.read_bytes())
    summary = writer.finalize({})
    assert pq.read_table(out).column("row").to_pylist() == list(range(6))
    assert summary["rows"] == 6 and summary["error_rows"] == 6


def test_an_over_full_output_is_not_already_complete(tiny_model_dir, tmp_path, greedy_reference):
    """Before: an output with a row twice was reported "already complete" on the next run."""
    out = tmp_path / "out.parquet"
    table = ok_run(tiny_model_dir, PROMPTS, out, *GREEDY)
    pq.write_table(pa.concat_tables([table, table.slice(3, 1)]).sort_by("row"), out)  # metadata kept
    result = run(tiny_model_dir, PROMPTS, out, *GREEDY)
    assert "exists but is not complete: row 3 where row 4 belongs" in one_line_error(result)
    assert texts(ok_run(tiny_model_dir, PROMPTS, out, *GREEDY, "--overwrite")) == texts(greedy_reference)


# ---- 3. the input is never destroyed ----

@pytest.mark.parametrize("case", ["same", "symlink", "hardlink", "summary", "parts"])
def test_refuses_to_write_over_the_input(tiny_model_dir, tmp_path, case):
    src = tmp_path / "in.jsonl"
    src.write_bytes(PROMPTS.read_bytes())
    out = {"same": src, "symlink": tmp_path / "link.jsonl", "hardlink": tmp_path / "hard.jsonl",
           "summary": tmp_path / "in.parquet", "parts": tmp_path / "in"}[case]
    if case == "summary":  # in.parquet writes its summary to in.summary.json
        src = src.rename(tmp_path / "in.summary.json")
    elif case == "parts":  # in writes its pieces to in.parts/
        (tmp_path / "in.parts").mkdir()
        src = src.rename(tmp_path / "in.parts" / "in.jsonl")
    elif case == "symlink":
        out.symlink_to(src)
    elif case == "hardlink":
        os.link(src, out)
    result = run(tiny_model_dir, src, out, "--overwrite")
    assert "input" in one_line_error(result)
    assert src.read_bytes() == PROMPTS.read_bytes()


def rewrite_input_after(monkeypatch, src: Path, commits: int) -> None:
    """Rewrite `src` (same size, other content) once the run has committed `commits` pieces."""
    commit, done = PartsWriter._commit_piece, []

    def commit_then_rewrite(self, *args):
        commit(self, *args)
        done.append(1)
        if len(done) == commits:
            src.write_bytes(PROMPTS.read_bytes().replace(b"France", b"Spain!"))

    monkeypatch.setattr(PartsWriter, "_commit_piece", commit_then_rewrite)


def test_an_input_rewritten_during_the_run_stops_it(tiny_model_dir, tmp_path, monkeypatch, greedy_reference):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    src.write_bytes(PROMPTS.read_bytes())
    rewrite_input_after(monkeypatch, src, commits=2)
    result = run(tiny_model_dir, src, out, *GREEDY)
    assert "changed while the job ran; stopped" in one_line_error(result) and not out.exists()
    assert len(list(parts_dir(out).glob("piece-*.parquet"))) == 2  # committed before the change: kept
    monkeypatch.undo()
    src.write_bytes(PROMPTS.read_bytes())  # restored: the same command resumes and completes
    assert texts(ok_run(tiny_model_dir, src, out, *GREEDY)) == texts(greedy_reference)


def test_a_change_only_the_hash_sees(tiny_model_dir, tmp_path, monkeypatch, greedy_reference):
    """Within one tick of the file system's clock a rewrite can keep size and times: the hash at the end sees it."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    src.write_bytes(PROMPTS.read_bytes())
    monkeypatch.setattr("tinyvllm.jobs.resume.input_stamp", lambda path: "unchanged")
    rewrite_input_after(monkeypatch, src, commits=1)
    result = run(tiny_model_dir, src, out, *GREEDY)
    assert "changed while the job ran, so the job is not complete" in one_line_error(result) and not out.exists()
    assert not any(parts_dir(out).glob("piece-*.parquet"))  # this run's rows may come from the new content
    monkeypatch.undo()
    src.write_bytes(PROMPTS.read_bytes())
    assert texts(ok_run(tiny_model_dir, src, out, *GREEDY)) == texts(greedy_reference)


# ---- 4. killed while removing the pieces of a finished job ----

def test_killed_while_removing_the_pieces(tiny_model_dir, tmp_path, monkeypatch):
    """Before: the manifest gone, some pieces left: "pieces but no manifest", refused on every rerun."""
    out = tmp_path / "out.parquet"

    def killed_midway(parts):
        (parts / "manifest.json").unlink()
        next(parts.glob("piece-*.parquet")).unlink()
        raise Crash

    with monkeypatch.context() as m:
        m.setattr("tinyvllm.io.writer.clear_parts", killed_midway)
        assert isinstance(run(tiny_model_dir, PROMPTS, out, *GREEDY).exception, Crash)
    first = pq.read_table(out)
    result = run(tiny_model_dir, PROMPTS, out, *GREEDY)
    assert result.exit_code == 0 and "already complete" in result.stderr, result.output
    assert not parts_dir(out).exists() and pq.read_table(out).equals(first)


# ---- 5. temp files never follow a planted link ----

def test_planted_links_are_never_followed(tiny_model_dir, tmp_path, greedy_reference):
    out = tmp_path / "out.parquet"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    parts_dir(out).mkdir()
    for name in ("out.parquet.tmp", "out.summary.json.tmp", "out.parquet.parts/manifest.json.tmp",
                 "out.parquet.parts/piece-00000000.parquet.tmp"):
        (tmp_path / name).symlink_to(victim)
    assert texts(ok_run(tiny_model_dir, PROMPTS, out, *GREEDY)) == texts(greedy_reference)
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("planted", ["out.parquet.parts", "out.parquet.parts/lock"])
def test_a_planted_link_for_the_parts_or_lock_is_refused(tiny_model_dir, tmp_path, planted):
    out, elsewhere = tmp_path / "out.parquet", tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted.endswith("lock"):
        parts_dir(out).mkdir()
    (tmp_path / planted).symlink_to(elsewhere / "x")
    assert "symbolic link" in one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY))
    assert list(elsewhere.iterdir()) == []


# ---- 9. damaged pieces and manifests ----

@pytest.mark.parametrize("damage", ["truncated", "random", "foreign-rows", "stray-names"])
def test_damaged_pieces_are_set_aside_and_recomputed(tiny_model_dir, tmp_path, monkeypatch, greedy_reference, damage):
    out = tmp_path / "out.parquet"
    parts = committed_not_finalized(tiny_model_dir, PROMPTS, out, monkeypatch)
    piece = sorted(parts.glob("piece-*.parquet"))[1]
    if damage == "truncated":
        piece.write_bytes(piece.read_bytes()[:-50])
    elif damage == "random":
        piece.write_bytes(os.urandom(piece.stat().st_size))
    elif damage == "foreign-rows":  # a piece of a bigger input
        table = pq.read_table(piece)
        pq.write_table(table.set_column(0, "row", pa.array(range(100, 100 + table.num_rows), pa.int64())), piece)
    else:
        (parts / "piece-abc.parquet").write_bytes(b"not a piece")
        (parts / "piece-dir.parquet").mkdir()
        (parts / "notes.txt").write_text("a user's note")
        piece = parts / "piece-abc.parquet"
    result = run(tiny_model_dir, PROMPTS, out, *GREEDY)
    assert result.exit_code == 0, result.output
    assert f"set aside damaged piece {piece.name}" in result.stderr and "Traceback" not in result.stderr
    assert texts(pq.read_table(out)) == texts(greedy_reference)


@pytest.mark.parametrize("manifest", [b"{not json", b"{}", b"[1, 2]", b"\xff\xfe"])
def test_a_damaged_manifest_is_rebuilt_from_the_pieces(tiny_model_dir, tmp_path, monkeypatch, greedy_reference,
                                                       manifest):
    out = tmp_path / "out.parquet"
    parts = committed_not_finalized(tiny_model_dir, PROMPTS, out, monkeypatch)
    (parts / "manifest.json").write_bytes(manifest)
    result = run(tiny_model_dir, PROMPTS, out, *GREEDY)
    assert result.exit_code == 0, result.output
    assert "manifest.json is damaged" in result.stderr and "resuming from its" in result.stderr
    assert texts(pq.read_table(out)) == texts(greedy_reference)


# ---- 10. full disks, long names, odd locks, damaged inputs ----

@pytest.mark.parametrize("failing_write", [2, "output", "summary"])
def test_disk_full(tiny_model_dir, tmp_path, monkeypatch, greedy_reference, failing_write):
    """ENOSPC on a piece (the third), on the output or on the summary: one line, nothing lost, a rerun finishes."""
    from tinyvllm.io import writer

    out = tmp_path / "out.parquet"
    real, calls = writer.atomic_write, []

    def full(path, write, temp_dir):
        calls.append(path)
        kind = "output" if path == out else "summary" if path.name.endswith(".summary.json") else len(calls) - 1

        def write_then_fail(f):
            write(f)
            if kind == failing_write:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        real(path, write_then_fail, temp_dir)

    monkeypatch.setattr(writer, "atomic_write", full)
    error = one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY))
    assert "No space left on device" in error and "run the same command again" in error
    assert not list(parts_dir(out).glob("*.tmp")) and out.exists() == (failing_write == "summary")
    monkeypatch.undo()
    assert texts(ok_run(tiny_model_dir, PROMPTS, out, *GREEDY)) == texts(greedy_reference)
    assert json.loads(summary_path(out).read_text())["rows"] == greedy_reference.num_rows


def test_an_output_name_over_255_bytes(tiny_model_dir, tmp_path):
    out = tmp_path / ("é" * 122 + ".parquet")  # 252 bytes: fine, but its .parts folder would have 258
    assert "output name too long" in one_line_error(run(tiny_model_dir, PROMPTS, out))


def test_a_lock_that_is_a_folder(tiny_model_dir, tmp_path):
    out = tmp_path / "out.parquet"
    (parts_dir(out) / "lock").mkdir(parents=True)
    assert "is a folder" in one_line_error(run(tiny_model_dir, PROMPTS, out))


def test_a_lock_holding_binary_is_taken(tiny_model_dir, tmp_path):
    out = tmp_path / "out.parquet"
    parts_dir(out).mkdir()
    (parts_dir(out) / "lock").write_bytes(os.urandom(300))  # left by anything: nobody holds it
    ok_run(tiny_model_dir, PROMPTS, out, *GREEDY)


def test_a_parquet_input_with_corrupt_data_pages(tiny_model_dir, tmp_path):
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"prompt": [f"prompt number {i} " * 8 for i in range(300)]}), src,
                   row_group_size=100, compression="snappy")
    data = bytearray(src.read_bytes())
    middle = pq.ParquetFile(src).metadata.row_group(1).column(0)
    start = middle.data_page_offset
    data[start:start + 64] = b"\xff" * 64
    src.write_bytes(data)
    with pytest.raises(Exception):  # as a precondition: pyarrow cannot read it
        pq.read_table(src)
    error = one_line_error(run(tiny_model_dir, src, out, "--max-tokens", "1", "--max-num-seqs", "64"))
    assert "cannot read input" in error and "damaged" in error and not out.exists()


# ---- 11. the row loop's worker thread ----

class FakeEngine:
    """Finishes each request one step after it was added, the latest first; notes the thread of every call."""

    def __init__(self) -> None:
        self.added, self.waiting, self.threads = [], [], set()

    def add_request(self, request_id, token_ids, params, prompt_is_templated=False) -> None:
        self.threads.add(threading.get_ident())
        self.added.append(token_ids[0])
        self.waiting.append((request_id, token_ids))

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.get_ident())
        done, self.waiting = self.waiting[::-1], []
        return [RequestOutput(request_id, None, ids, [CompletionOutput(0, "x", [1], finish_reason="length")], True,
                              RequestMetrics(0.0)) for request_id, ids in done]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    engine_config = SimpleNamespace(max_num_seqs=4)

    def get_num_waiting_requests(self) -> int:
        return len(self.waiting)

    def device_busy(self) -> bool:  # as a backend that cannot tell: admission stops at max_num_seqs waiting
        return False


def test_the_worker_reads_rows_and_hands_them_over_in_order(tmp_path):
    """complete_rows takes the rows on its worker thread (a reader parses the input there) and hands each over in row
    order, error rows included: the rows the input or their preparation made bad become error records, emit() and
    the engine run on the caller's thread only, and an error the reader raises comes after the rows before it."""
    engine = FakeEngine()
    llm = SimpleNamespace(llm_engine=engine, engine_config=SimpleNamespace(max_model_len=64), tokenizer=None)
    cfg = JobConfig(tmp_path / "in.jsonl", tmp_path / "out.parquet")
    main, read_on, emitted = threading.get_ident(), set(), []

    def rows(n: int, fail_after: int | None = None):
        for i in range(n):
            read_on.add(threading.get_ident())
            if i == fail_after:
                raise JobError(f"cannot read input after row {i - 1}")
            if i % 5 == 2:
                yield Row(i, str(i), error=f"line {i + 1}: malformed JSON")
            else:  # every 7th asks for more than max_model_len: bad once prepared, in the worker
                yield Row(i, str(i), prompt=[i], overrides={"max_tokens": 100} if i % 7 == 3 else {})

    def emit(record: dict) -> None:
        assert threading.get_ident() == main
        emitted.append(record)

    complete_rows(llm, rows(600), SamplingParams(max_tokens=4), cfg, emit, max_in_flight=8)
    assert read_on and main not in read_on and engine.threads == {main}
    assert sorted(r["row"] for r in emitted) == list(range(600))  # each row once
    bad = {r["row"]: r["error"] for r in emitted if r["error"] is not None}
    assert bad == {i: "line %d: malformed JSON" % (i + 1) if i % 5 == 2 else
                   "invalid max_tokens=100: more than max_model_len=64" for i in range(600) if i % 5 == 2 or i % 7 == 3}
    assert engine.added == [i for i in range(600) if i not in bad]  # admitted in row order

    emitted.clear()
    with pytest.raises(JobError, match="after row 299"):
        complete_rows(llm, rows(600, fail_after=300), SamplingParams(max_tokens=4), cfg, emit, max_in_flight=1000)
    assert {r["row"] for r in emitted} >= {i for i in range(300) if i % 5 == 2}  # the error rows before it


@pytest.mark.parametrize("busy", [False, True])
def test_rows_join_while_the_device_runs_once_a_batch_waits(tmp_path, busy):
    """Once max_num_seqs requests wait, the job admits more only while the device still runs its queued step: with
    a device that has always finished (or a backend that cannot tell), every step finds at most max_num_seqs
    waiting though more rows are ready; with a busy one, rows keep joining up to max_in_flight. Each row is
    emitted once, in admission order, either way."""
    engine = FakeEngine()
    engine.device_busy = lambda: busy
    seen = []
    fake_step = engine.step

    def step():
        seen.append(len(engine.waiting))
        time.sleep(0.005)  # the producer has every row ready by the next admission
        return fake_step()

    engine.step = step
    llm = SimpleNamespace(llm_engine=engine, engine_config=SimpleNamespace(max_model_len=64), tokenizer=None)
    cfg = JobConfig(tmp_path / "in.jsonl", tmp_path / "out.parquet")
    emitted = []
    rows = (Row(i, str(i), prompt=[i]) for i in range(60))
    complete_rows(llm, rows, SamplingParams(max_tokens=4), cfg, emitted.append, max_in_flight=16)
    assert sorted(r["row"] for r in emitted) == list(range(60)) == engine.added and sum(seen) == 60
    if busy:
        assert max(seen) == 16
    else:
        assert max(seen) == engine.engine_config.max_num_seqs == 4


def test_commits_run_on_their_own_thread_and_their_errors_reach_the_caller(tmp_path, monkeypatch):
    """A piece is written on the writer's thread while the caller goes on; a failed write is raised by the caller's
    next commit, and `committed` counts only the rows of pieces on disk."""
    from tinyvllm.io import writer as writer_module

    real, threads = writer_module.atomic_write, []

    def second_write_fails(path, write, temp_dir):
        threads.append(threading.get_ident())
        if len(threads) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, write, temp_dir)

    monkeypatch.setattr(writer_module, "atomic_write", second_write_fails)
    writer = PartsWriter(tmp_path / "out.parquet", output_schema(), 0.0, num_rows=9, piece_rows=3)
    for record in records(range(6)):  # two pieces started; the second fails
        writer.add(record)
    with pytest.raises(JobError, match="No space left on device"):
        for record in records(range(6, 9)):  # the third commit raises the second's error
            writer.add(record)
    assert len(threads) == 2 and threading.get_ident() not in threads
    assert writer.committed == 3
    writer.flush()  # rows 6..8, still buffered, are committed; rows 3..5 are not done: a resume redoes them
    assert writer.committed == 6
    assert sorted(r for p in writer.pieces() for r in pq.read_table(p).column("row").to_pylist()) == [0, 1, 2, 6, 7, 8]
