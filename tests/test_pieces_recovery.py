"""Each committed piece records its job's identity and a checksum of its rows: a missing or damaged manifest.json
costs no committed row (the job resumes from the pieces), a piece whose rows were edited after commit is set aside
and its rows computed again, and a piece of another job is refused."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from helpers import EXAMPLES, Crash, counted_run, ok_run, one_line_error, run

from tinyvllm.io import PartsWriter
from tinyvllm.io.writer import parts_dir, rows_sha256

PROMPTS = EXAMPLES / "prompts.jsonl"
GREEDY = ("--temperature", "0", "--max-tokens", "4", "--piece-rows", "3")
ROWS = 16


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> pa.Table:
    return ok_run(tiny_model_dir, PROMPTS, tmp_path_factory.mktemp("ref") / "ref.parquet", *GREEDY)


def results(table: pa.Table) -> list:
    return list(zip(*(table.column(name).to_pylist() for name in ("row", "id", "completion", "error"))))


def crashed_run(model, out, monkeypatch, commits: int | None = None, *args) -> Path:
    """A run that crashes after `commits` pieces (None: once every row is committed, before the output is
    written); returns its parts folder."""
    commit = PartsWriter._commit_piece
    done = []

    def counted(self, records, seq):
        if commits is not None and len(done) == commits:
            raise Crash
        commit(self, records, seq)
        done.append(seq)

    def crash(self, *a, **k):
        raise Crash

    with monkeypatch.context() as m:
        m.setattr(PartsWriter, "_commit_piece", counted)
        m.setattr(PartsWriter, "finalize", crash)
        result = run(model, PROMPTS, out, *GREEDY, *args)
    assert isinstance(result.exception, Crash), result.output
    assert not out.exists() and len(list(parts_dir(out).glob("piece-*.parquet"))) == len(done)
    return parts_dir(out)


def computed_rows(model, out, monkeypatch, *args):
    """The run's Result and the rows it computed (rather than kept from the pieces)."""
    return counted_run(monkeypatch, model, PROMPTS, out, *GREEDY, *args)


def committed(parts: Path) -> list[int]:
    return sorted(r for p in parts.glob("piece-*.parquet") for r in pq.read_table(p).column("row").to_pylist())


def test_each_piece_records_the_job_and_a_checksum_of_its_rows(tiny_model_dir, tmp_path, monkeypatch):
    parts = crashed_run(tiny_model_dir, tmp_path / "out.parquet", monkeypatch)
    job = json.loads((parts / "manifest.json").read_bytes())["job"]
    for piece in parts.glob("piece-*.parquet"):
        table = pq.read_table(piece)
        assert json.loads(table.schema.metadata[b"tinyvllm.job"]) == job
        assert table.schema.metadata[b"tinyvllm.rows_sha256"].decode() == rows_sha256(table)
        edited = table.set_column(3, "completion", pa.array(["x"] * table.num_rows, pa.string()))
        assert rows_sha256(edited) != rows_sha256(table)


@pytest.mark.parametrize("commits", [None, 2], ids=["all-committed", "killed-after-2-pieces"])
@pytest.mark.parametrize("manifest", ["missing", b"{not json", b"{}", b'{"job": {"input_size": 1}'])
def test_a_lost_manifest_costs_no_committed_row(tiny_model_dir, tmp_path, monkeypatch, reference, commits, manifest):
    out = tmp_path / "out.parquet"
    parts = crashed_run(tiny_model_dir, out, monkeypatch, commits)
    kept = committed(parts)
    if manifest == "missing":
        (parts / "manifest.json").unlink()
    else:
        (parts / "manifest.json").write_bytes(manifest)
    result, computed = computed_rows(tiny_model_dir, out, monkeypatch)
    assert result.exit_code == 0, result.output
    assert "resuming from its" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert computed == sorted(set(range(ROWS)) - set(kept))  # no committed row computed again
    assert results(pq.read_table(out)) == results(reference)  # every row exactly once, in order
    assert not parts.exists()


@pytest.mark.parametrize("manifest", ["kept", "missing"])
def test_a_piece_edited_after_commit_is_recomputed(tiny_model_dir, tmp_path, monkeypatch, reference, manifest):
    out = tmp_path / "out.parquet"
    parts = crashed_run(tiny_model_dir, out, monkeypatch)
    piece = sorted(parts.glob("piece-*.parquet"))[1]
    table = pq.read_table(piece)  # the metadata (job, checksum) kept, one completion changed
    completions = table.column("completion").to_pylist()
    completions[0] = "edited by hand"
    pq.write_table(table.set_column(3, "completion", pa.array(completions, pa.string())), piece)
    if manifest == "missing":
        (parts / "manifest.json").unlink()
    result, computed = computed_rows(tiny_model_dir, out, monkeypatch)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "set aside" in line]
    assert len(warnings) == 1 and piece.name in warnings[0] and "checksum" in warnings[0], result.stderr
    assert computed == table.column("row").to_pylist()  # that piece's rows alone
    final = pq.read_table(out)
    assert results(final) == results(reference)
    assert not pc.any(pc.equal(final.column("completion"), "edited by hand")).as_py()


def test_a_piece_of_another_job_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    out, other = tmp_path / "out.parquet", tmp_path / "other.parquet"
    parts = crashed_run(tiny_model_dir, out, monkeypatch)
    foreign = sorted(crashed_run(tiny_model_dir, other, monkeypatch, None, "--max-tokens", "2").glob("piece-*"))[0]
    planted = parts / "piece-0other-000000.parquet"
    planted.write_bytes(foreign.read_bytes())
    line = one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY))  # beside this job's manifest
    assert planted.name in line and "different job" in line and "sampling.max_tokens 2 -> 4" in line
    (parts / "manifest.json").unlink()
    line = one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY))  # with no manifest
    assert planted.name in line and "different job" in line
    assert planted.exists() and len(committed(parts)) > ROWS  # nothing removed


def test_pieces_that_record_no_job_still_need_their_manifest(tiny_model_dir, tmp_path, monkeypatch):
    """Pieces without the job's identity (written by an older version) can be resumed only with their manifest."""
    out = tmp_path / "out.parquet"
    parts = crashed_run(tiny_model_dir, out, monkeypatch)
    for piece in parts.glob("piece-*.parquet"):
        table = pq.read_table(piece)
        metadata = {k: v for k, v in table.schema.metadata.items() if k == b"tinyvllm.run_started"}
        pq.write_table(table.replace_schema_metadata(metadata), piece)
    (parts / "manifest.json").unlink()
    assert "has pieces but no manifest.json" in one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY))
