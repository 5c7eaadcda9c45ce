"""End-to-end: `tinyvllm run` over JSONL, Parquet, OpenAI-batch and bad-row inputs with a tiny random model."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tinyvllm.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BASE_COLUMNS = ["row", "id", "prompt", "completion", "finish_reason", "prompt_tokens", "completion_tokens", "error",
                "queue_ms", "ttft_ms", "tpot_ms", "e2e_ms", "finished_at"]


def run(model, input_path, output, *args):
    result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(input_path), "--output",
                                       str(output), "--backend", "numpy", "--quiet", *args])
    return result


def ok_run(model, input_path, output, *args) -> pa.Table:
    result = run(model, input_path, output, *args)
    assert result.exit_code == 0, result.output + str(result.exception)
    assert not Path(str(output) + ".parts").exists()
    return pq.read_table(output)


def metadata(table: pa.Table) -> dict:
    return {k.decode()[len("tinyvllm."):]: json.loads(v) for k, v in table.schema.metadata.items()
            if k.startswith(b"tinyvllm.")}


def test_run_jsonl(tiny_model_dir, tmp_path):
    out = tmp_path / "prompts.parquet"
    table = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, "--max-tokens", "6")
    assert table.schema.names == BASE_COLUMNS
    assert table.schema.field("id").type == pa.string()
    assert table.schema.field("completion_tokens").type == pa.int32()
    assert table.schema.field("e2e_ms").type == pa.float64()
    ids = [json.loads(line)["id"] for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines()]
    assert table.column("id").to_pylist() == ids  # input order, whatever the finishing order
    rows = table.to_pylist()
    assert all(r["error"] is None and r["finish_reason"] in ("stop", "length") for r in rows)
    assert all(isinstance(r["completion"], str) and r["prompt_tokens"] > 0 for r in rows)
    assert rows[0]["prompt"] == "The capital of France is" and rows[0]["completion_tokens"] <= 6
    assert all(r["e2e_ms"] >= r["ttft_ms"] >= 0 for r in rows)
    meta = metadata(table)
    assert meta["backend"] == "numpy" and meta["batching"] == "continuous" and meta["model"]
    assert meta["sampling"]["max_tokens"] == 6 and meta["version"] and meta["start_time"] <= meta["end_time"]
    assert meta["counts"] == {"rows": 16, "error_rows": 0, "finish_reasons": meta["counts"]["finish_reasons"],
                              "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                              "output_tokens": sum(r["completion_tokens"] for r in rows)}
    summary = json.loads((tmp_path / "prompts.summary.json").read_text())
    assert summary["rows"] == 16 and summary["error_rows"] == 0 and summary["latency_ms"]["e2e"]["p50"] > 0


def test_run_parquet_chat_token_ids_logprobs(tiny_model_dir, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "id": [3, 1, 2],
        "prompt": ["hello there", None, None],
        "messages": [None, [{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]],
        "max_tokens": [5, 3, None],
    }), src)
    table = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", "--output-token-ids", "--logprobs", "2",
                   "--max-tokens", "4", "--temperature", "0")
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["3", "1", "2"]
    assert "<|im_start|>user\nhi" in rows[1]["prompt"]  # rendered with the model's chat template
    assert rows[0]["prompt"] == "hello there"
    assert all(1 <= r["completion_tokens"] <= limit for r, limit in zip(rows, [5, 3, 4]))
    for r in rows:
        assert len(r["completion_token_ids"]) == len(r["logprobs"]) == len(r["top_logprobs"]) == r["completion_tokens"]
        assert all(lp <= 0 for lp in r["logprobs"]) and all(2 <= len(top) <= 3 for top in r["top_logprobs"])
        assert r["top_logprobs"][0][0]["logprob"] >= r["top_logprobs"][0][-1]["logprob"]


def test_run_openai_batch(tiny_model_dir, tmp_path):
    table = ok_run(tiny_model_dir, EXAMPLES / "openai_batch.jsonl", tmp_path / "batch.parquet")
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["req-1", "req-2", "req-3", "req-4", "req-5"]
    assert [r["finish_reason"] == "error" for r in rows] == [False] * 4 + [True]
    assert "unsupported url '/v1/embeddings'" in rows[4]["error"] and rows[4]["completion"] is None
    assert rows[1]["completion_tokens"] <= 32 and rows[0]["completion_tokens"] <= 16
    assert rows[0]["prompt"].startswith("<|im_start|>system")


def test_run_bad_rows(tiny_model_dir, tmp_path):
    table = ok_run(tiny_model_dir, EXAMPLES / "bad_rows.jsonl", tmp_path / "bad.parquet")
    rows = table.to_pylist()
    assert [r["row"] for r in rows] == list(range(17))
    good = [r for r in rows if r["error"] is None]
    assert [r["id"] for r in good] == ["good-1", "good-2", "good-3"] and all(r["completion"] is not None for r in good)
    bad = [r for r in rows if r["error"] is not None]
    assert len(bad) == 14 and all(r["finish_reason"] == "error" and r["completion"] is None for r in bad)
    assert len({r["error"] for r in bad}) == 14  # each bad row says what is wrong with it
    assert metadata(table)["counts"]["error_rows"] == 14


def test_overlong_prompt_is_an_error_row(tiny_model_dir, tmp_path):
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"id": "long", "prompt": "word " * 200}) + "\n" + json.dumps({"prompt": "short"}) + "\n")
    rows = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", "--max-model-len", "64").to_pylist()
    assert rows[0]["finish_reason"] == "error" and "tokens; the limit is" in rows[0]["error"]
    assert rows[0]["completion"] is None and rows[0]["prompt"] == "word " * 200
    assert rows[1]["finish_reason"] in ("stop", "length")


def test_chat_flag_and_greedy_repeatable(tiny_model_dir, tmp_path):
    args = ("--chat", "--temperature", "0", "--max-tokens", "8", "--max-num-seqs", "3")
    a = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", tmp_path / "a.parquet", *args)
    b = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", tmp_path / "b.parquet", *args, "--batching", "static")
    assert all(p.startswith("<|im_start|>user\n") for p in a.column("prompt").to_pylist())
    assert a.column("completion").to_pylist() == b.column("completion").to_pylist()
    assert metadata(a)["chat"] is True and metadata(b)["batching"] == "static"


@pytest.mark.parametrize("case,args,message", [
    ("missing input", ["--input", "{tmp}/nope.jsonl"], "input not found"),
    ("bad extension", ["--input", "{tmp}/in.txt"], "unsupported input format '.txt'"),
    ("missing model", ["--model", "{tmp}/no-model"], "model not found"),
    ("unreadable model", ["--model", "{tmp}/in.txt"], "cannot load model"),
    ("output dir is a file", ["--output", "{tmp}/in.txt/out.parquet"], "cannot create output directory"),
    ("bad default", ["--temperature", "-1"], "bad sampling defaults: invalid temperature=-1"),
])
def test_job_level_errors(tiny_model_dir, tmp_path, case, args, message):
    (tmp_path / "in.txt").write_text("hello\n")
    base = {"--model": str(tiny_model_dir), "--input": str(EXAMPLES / "prompts.jsonl"),
            "--output": str(tmp_path / "out.parquet")}
    base.update(dict(zip(args[::2], (a.format(tmp=tmp_path) for a in args[1::2]))))
    result = CliRunner().invoke(main, ["run", "--backend", "numpy", "--quiet", *sum(base.items(), ())])
    assert result.exit_code != 0
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out.parquet").exists()


def test_no_default_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))
    result = CliRunner().invoke(main, ["run", "--input", str(EXAMPLES / "prompts.jsonl"),
                                       "--output", str(tmp_path / "o.parquet")])
    assert result.exit_code != 0 and "tinyvllm fetch-default-model" in result.stderr


def test_python_dash_m(tiny_model_dir, tmp_path):
    out = tmp_path / "o.parquet"
    proc = subprocess.run([sys.executable, "-m", "tinyvllm", "run", "--model", str(tiny_model_dir), "--input",
                           str(EXAMPLES / "chat.jsonl"), "--output", str(out), "--backend", "numpy"],
                          capture_output=True, text=True, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 6 rows (0 errors)" in proc.stderr and pq.read_table(out).num_rows == 6
    evaluate = subprocess.run([sys.executable, str(EXAMPLES / "evaluate.py"), str(out)], capture_output=True, text=True)
    assert evaluate.returncode == 0 and "rows:          6" in evaluate.stdout
