"""Readers (JSONL, Parquet, OpenAI batch, bad rows) and the crash-safe writer, without any model."""

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import write_jsonl

from tinyvllm.io import JobError, PartsWriter, count_rows, output_record, read_rows
from tinyvllm.io.writer import RowSet, output_schema, parts_dir, summary_path
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


def test_jsonl_rows(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        json.dumps({"prompt": "hello"}),
        "",  # blank lines are not records
        json.dumps({"id": 7, "prompt": [1, 2, 3], "max_tokens": 5.0, "stop": "\n", "temperature": None}),
        json.dumps({"id": "c", "messages": [{"role": "user", "content": "hi"}], "top_k": 3, "extra": "ignored"}),
    ])
    rows = list(read_rows(path))
    assert count_rows(path) == 3
    assert [(r.index, r.id, r.error) for r in rows] == [(0, "0", None), (1, "7", None), (2, "c", None)]
    assert rows[0].prompt == "hello" and rows[0].overrides == {}
    assert rows[1].prompt == [1, 2, 3] and rows[1].overrides == {"max_tokens": 5, "stop": ["\n"]}
    assert rows[2].messages == [{"role": "user", "content": "hi"}] and rows[2].overrides == {"top_k": 3}


def test_parquet_rows(tmp_path):
    path = tmp_path / "in.parquet"
    table = pa.table({
        "id": [10, 11, None],
        "prompt": ["a", None, "c"],
        "messages": [None, [{"role": "user", "content": "b"}], None],
        "max_tokens": [4.0, float("nan"), 2.5],  # pandas-style: NaN = missing, 2.5 is not an integer
    })
    pq.write_table(table, path, row_group_size=2)
    rows = list(read_rows(path))
    assert count_rows(path) == 3
    assert [(r.id, r.prompt, r.overrides) for r in rows[:2]] == [("10", "a", {"max_tokens": 4}), ("11", None, {})]
    assert rows[1].messages == [{"role": "user", "content": "b"}]
    assert rows[2].id == "2" and "max_tokens" in rows[2].error and rows[2].error.startswith("row 2:")


def test_openai_batch_rows():
    rows = list(read_rows("examples/openai_batch.jsonl"))
    assert [r.id for r in rows] == ["req-1", "req-2", "req-3", "req-4", "req-5"]
    assert rows[0].messages[0]["role"] == "system" and rows[0].overrides == {"max_tokens": 16, "temperature": 0}
    assert rows[1].overrides["max_tokens"] == 32  # max_completion_tokens
    assert rows[2].prompt == "The quick brown fox" and rows[2].overrides["stop"] == ["."]
    assert rows[3].error is None and "stop" not in rows[3].overrides  # null = not given
    assert "unsupported url" in rows[4].error


def test_openai_batch_bad_rows(tmp_path):
    req = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    path = write_jsonl(tmp_path / "batch.jsonl", [json.dumps(req)] + [json.dumps(r) for r in [
        {**req, "custom_id": None},
        {**req, "custom_id": "b", "method": "GET"},
        {**req, "custom_id": "c", "body": "text"},
        {**req, "custom_id": "d", "body": {"prompt": "x", "tools": []}},
        {**req, "custom_id": "e", "body": {"prompt": "x", "max_completion_tokens": 0}},
        {**req, "custom_id": "a"},
    ]])
    errors = [r.error for r in read_rows(path)]
    assert errors[0] is None
    for error, expected in zip(errors[1:], ["missing custom_id", "unsupported method", "body must be",
                                            "unsupported field 'tools' (tool calling is not supported)",
                                            "invalid max_tokens=0", "duplicate id 'a'"], strict=True):
        assert expected in error


BAD_LINES = [
    (b'{"prompt": "no closing brace"', "line 1: malformed JSON: Expecting ',' delimiter"),
    (b'["a", "list"]', "not a JSON object (got list)"),
    (b'"just a string"', "not a JSON object (got str)"),
    (b'{"id": "x", "text": "neither"}', "missing prompt or messages"),
    (b'{"prompt": ""}', "prompt is empty"),
    (b'{"prompt": []}', "prompt is empty"),
    (b'{"prompt": 42}', "prompt must be a string or a list of token ids, got int"),
    (b'{"prompt": [1, -2]}', "token ids must be >= 0"),
    (b'{"prompt": [1, 2.5]}', "prompt token ids must be integers, got 2.5"),
    (b'{"prompt": ["a", "b"]}', "prompt is a list of texts (several prompts in one request"),
    (b'{"prompt": [1, "2"]}', 'prompt token ids must be integers, got "2"'),
    (b'{"prompt": [true, 2]}', "prompt token ids must be integers, got true"),
    (b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "both prompt and messages"),
    (b'{"messages": []}', "messages must be a non-empty list"),
    (b'{"messages": ["hi"]}', "messages[0] must be an object"),
    (b'{"messages": [{"content": "hi"}]}', "messages[0].role must be a non-empty string"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content must be a string"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "only text parts"),
    (b'{"prompt": "a", "max_tokens": -1}', "invalid max_tokens=-1"),
    (b'{"prompt": "a", "max_tokens": 2.5}', "invalid max_tokens=2.5"),
    (b'{"prompt": "a", "max_tokens": "10"}', "invalid max_tokens='10'"),
    (b'{"prompt": "a", "temperature": -1}', "invalid temperature=-1"),
    (b'{"prompt": "a", "temperature": NaN}', "invalid temperature=nan"),
    (b'{"prompt": "a", "top_p": 0}', "invalid top_p=0"),
    (b'{"prompt": "a", "top_k": true}', "invalid top_k=True"),
    (b'{"prompt": "a", "min_p": 2}', "invalid min_p=2"),
    (b'{"prompt": "a", "seed": "s"}', "invalid seed='s'"),
    (b'{"prompt": "a", "stop": 3}', "invalid stop=3"),
    (b'{"prompt": "a", "stop": {"x": 1}}', "invalid stop="),
    (b'{"prompt": "a", "stop": ["", "x"]}', "invalid stop="),
    (b'{"id": [1], "prompt": "a"}', "id must be a non-empty string or an integer"),
    (b'{"id": "", "prompt": "a"}', "id must be a non-empty string or an integer"),
    (b'{"prompt": "caf\xe9"}', "invalid UTF-8 (byte 0xe9"),
    (b'{"prompt": "\\ud800"}', "unpaired surrogate"),
    (b"[" * 100000, "nested too deeply"),
]


@pytest.mark.parametrize("line,reason", BAD_LINES, ids=[reason for _, reason in BAD_LINES])
def test_bad_row_reason(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "in.jsonl", [line, b'{"prompt": "fine"}'])
    bad, good = read_rows(path)
    assert reason in bad.error and bad.error.startswith("line 1: ")
    assert (good.index, good.error) == (1, None)  # the next row is unaffected


def test_examples_bad_rows():
    rows = list(read_rows("examples/bad_rows.jsonl"))
    assert [r.id for r in rows if r.error is None] == ["good-1", "good-2", "good-3"]
    assert all(r.error for r in rows if r.id not in ("good-1", "good-2", "good-3") or r.index == 13)
    assert "duplicate id 'good-1'" in rows[13].error


def test_job_level_input_errors(tmp_path):
    with pytest.raises(JobError, match="input not found"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(JobError, match="unsupported input format '.csv'"):
        read_rows(write_jsonl(tmp_path / "in.csv", ["a,b"]))
    with pytest.raises(JobError, match="input is not a file"):
        read_rows(tmp_path)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(JobError, match="cannot read Parquet input"):
        read_rows(tmp_path / "bad.parquet")


def fake_output(request_id, text="ok", tokens=(5, 6), finish="stop", error=None, logprobs=None):
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.1, first_token_time=100.2,
                             finished_time=100.4, num_generated_tokens=len(tokens))
    comp = CompletionOutput(0, text, list(tokens), cumulative_logprob=-1.5 if logprobs else None,
                            logprobs=logprobs, finish_reason="error" if error else finish)
    return RequestOutput(request_id, "p", [1, 2, 3], [comp], True, metrics, error=error)


def test_output_record():
    rec = output_record(3, "x", "prompt", fake_output("3", logprobs=[{5: -1.0, 9: -0.5}, {6: -0.5}]))
    assert rec["row"] == 3 and rec["completion"] == "ok" and rec["finish_reason"] == "stop"
    assert (rec["prompt_tokens"], rec["completion_tokens"], rec["completion_token_ids"]) == (3, 2, [5, 6])
    assert rec["ttft_ms"] == pytest.approx(200.0) and rec["tpot_ms"] == pytest.approx(200.0)
    assert rec["logprobs"] == [-1.0, -0.5]
    assert rec["top_logprobs"][0] == [{"token_id": 9, "logprob": -0.5}, {"token_id": 5, "logprob": -1.0}]
    err = output_record(4, "y", "prompt", fake_output("4", error="prompt too long"))
    assert (err["completion"], err["finish_reason"], err["error"], err["completion_tokens"]) == \
        (None, "error", "prompt too long", 0)
    bad = output_record(5, "z", None, error="line 6: prompt is empty")
    assert bad["prompt_tokens"] is None and bad["ttft_ms"] is None and bad["finish_reason"] == "error"
    assert output_record(6, "t", [1, 2], fake_output("6"))["prompt"] is None  # token-id prompts: no text


def test_writer_pieces_assembly_metadata_summary(tmp_path):
    out = tmp_path / "out.parquet"
    first_run = time.time() - 100  # two runs: the first committed its rows ~100 s ago, then died
    writer = PartsWriter(out, output_schema(token_ids=True), run_started=first_run - 3, num_rows=8, piece_rows=3)
    for i in [5, 0, 3, 1, 2, 6]:  # finishing order, not input order
        tokens, finish = ((1, 2, 3, 4), "length") if i == 6 else ((5, 6), "stop")
        writer.add(output_record(i, f"id{i}", f"p{i}", fake_output(str(i), f"t{i}", tokens, finish)) |
                   {"finished_at": first_run})
    writer.flush()  # nothing buffered: waits for the second piece, committed on the writer's thread
    assert len(writer.pieces()) == 2 and set(writer.committed_rows()) == {0, 1, 2, 3, 5, 6}
    (parts_dir(out) / "piece-00000099.parquet.tmp").write_bytes(b"half a piece")  # a crash mid-write
    writer = PartsWriter(out, output_schema(token_ids=True), time.time() - 1, 8, piece_rows=3)  # resumed
    assert not list(parts_dir(out).glob("*.tmp")) and set(writer.committed_rows()) == {0, 1, 2, 3, 5, 6}
    writer.add(output_record(7, "id7", "p7", fake_output("7", error="boom")))
    writer.add(output_record(4, "id4", None, error="line 5: prompt is empty"))
    assert len(writer.pieces()) == 2  # not yet committed: below piece_rows and piece_seconds
    summary = writer.finalize({"model": "m", "backend": "numpy", "batching": "continuous", "sampling": {"x": 1}})

    assert not parts_dir(out).exists() and not (tmp_path / "out.parquet.tmp").exists()
    table = pq.read_table(out)
    assert table.column("row").to_pylist() == list(range(8))
    assert table.column("id").to_pylist() == [f"id{i}" for i in range(8)]
    assert table.column("completion").to_pylist()[:4] == ["t0", "t1", "t2", "t3"]
    assert table.column("finish_reason").to_pylist()[4:] == ["error", "stop", "length", "error"]
    assert table.column("error").to_pylist()[7] == "boom" and table.column("completion_token_ids")[0].as_py() == [5, 6]
    schema = table.schema
    assert schema.field("id").type == pa.string() and schema.field("prompt_tokens").type == pa.int32()
    assert schema.field("ttft_ms").type == pa.float64()
    assert schema.field("completion_token_ids").type == pa.list_(pa.int32())
    assert table.column("logprobs").null_count == 8 and table.column("completions").null_count == 8  # not asked
    meta = {k.decode(): json.loads(v) for k, v in schema.metadata.items() if k.startswith(b"tinyvllm.")}
    assert meta["tinyvllm.model"] == "m" and meta["tinyvllm.sampling"] == {"x": 1}
    assert meta["tinyvllm.counts"]["rows"] == 8 and meta["tinyvllm.counts"]["error_rows"] == 2
    assert meta["tinyvllm.counts"]["finish_reasons"] == {"error": 2, "length": 1, "stop": 5}

    assert json.loads(summary_path(out).read_text()) == summary
    assert summary_path(out).name == "out.summary.json"
    assert summary["rows"] == 8 and summary["error_rows"] == 2 and summary["output_tokens"] == 2 * 5 + 4
    assert summary["prompt_tokens"] == 3 * 7  # the row that never reached the engine has no prompt tokens
    assert summary["latency_ms"]["ttft"]["p50"] == pytest.approx(200.0)
    assert summary["latency_ms"]["e2e"]["p99"] == pytest.approx(400.0)
    assert summary["wall_time_s"] == pytest.approx(3 + 1, abs=0.5)  # time spent running, not the gap between runs
    assert summary["output_tok_per_s"] == pytest.approx(14 / summary["wall_time_s"], rel=0.01)


def test_merge_takes_each_row_once_from_its_first_piece_in_row_order(tmp_path, monkeypatch):
    """finalize's merge over sorted pieces that overlap, interleave and repeat rows: row order, each row once (the
    copy of the first piece that has it), across the batches it writes, each piece read once."""
    from tinyvllm.io import writer as writer_module

    monkeypatch.setattr(writer_module, "FINAL_BATCH_ROWS", 7)  # batches cut across pieces and runs
    rng = np.random.default_rng(0)
    schema = output_schema()
    pieces, first_piece = [], {}
    for k in range(12):
        rows = np.sort(rng.choice(np.arange(10 * k, 10 * k + 40), 15, replace=False))  # overlapping ranges
        for row in rows:
            first_piece.setdefault(int(row), k)
        path = tmp_path / f"piece-{k:08d}.parquet"
        records = [output_record(int(r), f"p{k}-r{r}", None, error="x") for r in rows]
        pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
        pieces.append(path)
    read = []
    real_read = writer_module._read_piece

    def counting_read(piece, columns=None):
        if columns is None:
            read.append(piece)
        return real_read(piece, columns)

    monkeypatch.setattr(writer_module, "_read_piece", counting_read)
    rows = [writer_module._read_piece(p, ["row"]).column("row").to_numpy() for p in pieces]
    tables = list(writer_module._merged(pieces, schema, rows))
    merged = pa.concat_tables(tables)
    assert merged.column("row").to_pylist() == sorted(first_piece)
    assert merged.column("id").to_pylist() == [f"p{first_piece[r]}-r{r}" for r in sorted(first_piece)]
    assert all(t.num_rows <= 7 for t in tables) and merged.schema.equals(schema)
    assert sorted(read) == pieces  # each piece read whole once
    assert list(writer_module._merged([], schema, [])) == []


def test_finalize_reads_each_piece_twice(tmp_path, monkeypatch):
    """finalize() reads a piece's small columns once (the every-row check, the summary and the merge's order share
    them) and the piece whole once (the merge), whatever the pieces hold; the output is every row once, in order."""
    import tinyvllm.io.writer as writer_module

    out = tmp_path / "out.parquet"
    writer = PartsWriter(out, output_schema(), run_started=time.time() - 5, num_rows=10, piece_rows=4)
    for i in [3, 9, 0, 4, 8, 1, 2, 7, 6, 5, 2]:  # row 2 twice: a row in two pieces is kept once
        writer.add(output_record(i, f"id{i}", f"p{i}", fake_output(str(i), f"t{i}")))
    writer.flush()
    pieces = writer.pieces()
    assert len(pieces) == 3
    reads = []
    real_read = writer_module._read_piece
    monkeypatch.setattr(writer_module, "_read_piece", lambda piece, columns=None: (
        reads.append((piece.name, columns is None)), real_read(piece, columns))[1])
    summary = writer.finalize({"model": "m"})
    assert sorted(reads) == sorted([(p.name, False) for p in pieces] + [(p.name, True) for p in pieces])
    assert pq.read_table(out).column("row").to_pylist() == list(range(10)) and summary["rows"] == 10


def test_writer_empty_job(tmp_path):
    out = tmp_path / "empty.parquet"
    summary = PartsWriter(out, output_schema(), run_started=0.0, num_rows=0).finalize({})
    table = pq.read_table(out)
    assert table.num_rows == 0 and "top_logprobs" in table.schema.names
    assert summary["rows"] == 0 and summary["output_tok_per_s"] is None
    assert summary["latency_ms"]["e2e"] == {"p50": None, "p90": None, "p99": None}


def test_jsonl_byte_order_mark_and_crlf(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert [(r.prompt, r.error) for r in read_rows(path)] == [("a", None), ("b", None)]


def test_row_set_of_committed_rows():
    rows = RowSet()
    assert len(rows) == 0 and 0 not in rows and -1 not in rows
    rows.update(np.array([3, 1, 3, 7]))
    rows.update(np.array([], np.int64))
    rows.update(np.array([7, 1000]))
    assert len(rows) == 4 and [r for r in range(1002) if r in rows] == list(rows) == [1, 3, 7, 1000]
    assert 1001 not in rows and 10**9 not in rows
