"""--retry-errors: on a finished (or interrupted) output, only the error rows are computed again; the other rows
are kept as they are, every row is in the output exactly once and in input order, and the summary says how many
rows were retried."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import EXAMPLES, Crash, counted_run, ok_run, one_line_error, run, write_jsonl

from tinyvllm.cli import main
from tinyvllm.io import PartsWriter
from tinyvllm.io.writer import parts_dir, summary_path
from tinyvllm.jobs.run import RowPipeline

PROMPTS = EXAMPLES / "prompts.jsonl"
GREEDY = ("--temperature", "0", "--max-tokens", "4", "--piece-rows", "3")
FLAKY = {1, 5, 6, 12}  # rows that fail in the first run only
TRANSIENT = "transient failure"


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> pa.Table:
    return ok_run(tiny_model_dir, PROMPTS, tmp_path_factory.mktemp("ref") / "ref.parquet", *GREEDY)


def results(table: pa.Table) -> list:
    return list(zip(*(table.column(name).to_pylist() for name in ("row", "id", "completion", "error"))))


def flaky(monkeypatch, rows=FLAKY) -> None:
    """Make `rows` error rows (as a transient failure would) for the rest of the test's monkeypatch context."""
    prepare = RowPipeline._prepare

    def failing(self, batch):
        return [TRANSIENT if row.index in rows else r for row, r in zip(batch, prepare(self, batch))]

    monkeypatch.setattr(RowPipeline, "_prepare", failing)


def with_errors(model, src, out, monkeypatch, *args) -> pa.Table:
    """A finished output in which the FLAKY rows are error rows."""
    with monkeypatch.context() as m:
        flaky(m)
        return ok_run(model, src, out, *GREEDY, *args)


def retried(model, src, out, monkeypatch, *args):
    """run() with GREEDY, and the rows it computed."""
    return counted_run(monkeypatch, model, src, out, *GREEDY, *args)


def test_retry_recomputes_only_the_error_rows(tiny_model_dir, tmp_path, monkeypatch, reference):
    out = tmp_path / "out.parquet"
    first = with_errors(tiny_model_dir, PROMPTS, out, monkeypatch)
    errors = [r for r, e in zip(first.column("row").to_pylist(), first.column("error").to_pylist()) if e is not None]
    assert set(FLAKY) <= set(errors)
    again = run(tiny_model_dir, PROMPTS, out, *GREEDY)  # without the flag: finished, nothing to do
    assert again.exit_code == 0 and "already complete" in again.stderr

    result, computed = retried(tiny_model_dir, PROMPTS, out, monkeypatch, "--retry-errors")
    assert result.exit_code == 0, result.output
    assert computed == errors  # the error rows alone
    final = pq.read_table(out)
    assert results(final) == results(reference)  # fixed, each row once, in input order
    kept = [r for r in range(final.num_rows) if r not in errors]
    assert final.take(kept).column("finished_at").equals(first.take(kept).column("finished_at"))  # kept as they were
    summary = json.loads(summary_path(out).read_text())
    assert summary["retried_rows"] == len(errors) and summary["error_rows"] == len(errors) - len(FLAKY)
    assert not parts_dir(out).exists()


def test_retry_on_an_output_without_errors_does_nothing(tiny_model_dir, tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    out = tmp_path / "out.parquet"
    ok_run(tiny_model_dir, src, out, *GREEDY)
    mtime = out.stat().st_mtime_ns
    result, computed = retried(tiny_model_dir, src, out, monkeypatch, "--retry-errors")
    assert result.exit_code == 0 and "already complete" in result.stderr and computed == []
    assert out.stat().st_mtime_ns == mtime


def test_retry_on_an_interrupted_output(tiny_model_dir, tmp_path, monkeypatch, reference):
    """The pieces of a run killed before it finished: their error rows are dropped and computed again, the rows
    no piece has yet computed too."""
    out = tmp_path / "out.parquet"

    def crash(self, *a, **k):
        raise Crash

    with monkeypatch.context() as m:
        flaky(m)
        m.setattr(PartsWriter, "finalize", crash)
        assert isinstance(run(tiny_model_dir, PROMPTS, out, *GREEDY).exception, Crash)
    pieces = sorted(parts_dir(out).glob("piece-*.parquet"))
    pieces[-1].unlink()  # rows not committed yet
    result, computed = retried(tiny_model_dir, PROMPTS, out, monkeypatch, "--retry-errors")
    assert result.exit_code == 0, result.output
    assert set(FLAKY) <= set(computed) and computed == sorted(set(computed))  # each computed once
    assert results(pq.read_table(out)) == results(reference)


@pytest.mark.parametrize("rerun", [(), ("--retry-errors",)], ids=["same-command", "without-the-flag"])
def test_a_stopped_retry_resumes(tiny_model_dir, tmp_path, monkeypatch, reference, rerun):
    """A retry killed after it took the output's rows back into pieces resumes from them, with the flag or
    without: the rows it fixed are kept, not computed a third time."""
    out = tmp_path / "out.parquet"
    with_errors(tiny_model_dir, PROMPTS, out, monkeypatch)
    commit = PartsWriter._commit_piece
    committed = []

    def stop_after_one_commit(self, records, seq):
        if committed:
            raise Crash
        commit(self, records, seq)
        committed.extend(r["row"] for r in records)

    with monkeypatch.context() as m:
        m.setattr(PartsWriter, "_commit_piece", stop_after_one_commit)
        assert isinstance(run(tiny_model_dir, PROMPTS, out, *GREEDY, "--retry-errors").exception, Crash)
    assert committed and set(committed) <= set(FLAKY)
    result, computed = retried(tiny_model_dir, PROMPTS, out, monkeypatch, *rerun)
    assert result.exit_code == 0 and "already complete" not in result.stderr, result.output
    assert computed and not set(computed) & set(committed) and set(computed) | set(committed) >= set(FLAKY)
    assert results(pq.read_table(out)) == results(reference)
    assert not parts_dir(out).exists()


def test_retry_an_openai_output(tiny_model_dir, tmp_path, monkeypatch):
    """A finished .jsonl output does not keep its rows whole, so it cannot give them back: one line, exit 2. An
    interrupted one retries from its pieces."""
    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as m:
        flaky(m)
        assert run(tiny_model_dir, PROMPTS, out, *GREEDY).exit_code == 0
    before = out.read_bytes()
    one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY, "--retry-errors"), "--retry-errors", exit_code=2)
    assert out.read_bytes() == before and not parts_dir(out).exists()

    def crash(self, *a, **k):
        raise Crash

    out = tmp_path / "interrupted.jsonl"
    with monkeypatch.context() as m:
        flaky(m)
        m.setattr(PartsWriter, "finalize", crash)
        assert isinstance(run(tiny_model_dir, PROMPTS, out, *GREEDY).exception, Crash)
    result, computed = retried(tiny_model_dir, PROMPTS, out, monkeypatch, "--retry-errors")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [int(line["id"].rsplit("_", 1)[1]) for line in lines] == list(range(16))
    assert set(FLAKY) <= set(computed) and all(lines[r]["error"] is None for r in FLAKY)


def test_retry_errors_in_a_job_file(tiny_model_dir, tmp_path, monkeypatch, reference):
    out = tmp_path / "out.parquet"
    with_errors(tiny_model_dir, PROMPTS, out, monkeypatch)
    job = tmp_path / "job.toml"
    job.write_text(f'model = "{tiny_model_dir}"\ninput = "{PROMPTS}"\noutput = "{out}"\nbackend = "numpy"\n'
                   'piece_rows = 3\nretry_errors = true\n[sampling]\ntemperature = 0.0\nmax_tokens = 4\n')
    result = CliRunner().invoke(main, ["job", str(job)])
    assert result.exit_code == 0, result.output
    assert f"retrying {len(FLAKY)} error rows; the other rows are kept" in result.stderr, result.stderr
    assert results(pq.read_table(out)) == results(reference)
    assert json.loads(summary_path(out).read_text())["retried_rows"] == len(FLAKY)


def test_retry_errors_and_overwrite_contradict(tiny_model_dir, tmp_path):
    result = run(tiny_model_dir, PROMPTS, tmp_path / "out.parquet", "--retry-errors", "--overwrite")
    assert "contradict" in one_line_error(result, exit_code=None)
    assert not Path(tmp_path / "out.parquet.parts").exists()
