"""The `sampling` output column: each row's SamplingParams as it ran (the job's defaults, the row's fields, an OpenAI
body's), one struct type derived from the declarations for every job, null on error rows; README documents it; an
output or pieces written without it are another job's."""

from __future__ import annotations

import json
import re
from dataclasses import fields

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from helpers import EXAMPLES, Crash, ok_result, ok_run, one_line_error, run, write_jsonl
from tinyvllm.cli import main
from tinyvllm.config import EngineConfig, settings
from tinyvllm.io.writer import SAMPLING_TYPE, PartsWriter, output_schema, parts_dir, sampling_record
from tinyvllm.jobs.run import _row_seed
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams

README = (EXAMPLES.parent / "README.md").read_text()
DEFAULTS = {"max_tokens": 4, "top_p": 0.9, "presence_penalty": 0.5, "stop": ["."]}
FLAGS = ("--max-tokens", "4", "--top-p", "0.9", "--presence-penalty", "0.5", "--stop", ".")


def as_written(value: dict) -> dict:
    """A `sampling` value as read back: the map of logit_bias as the dict it was."""
    return {**value, "logit_bias": None if value["logit_bias"] is None else dict(value["logit_bias"])}


def expected(row: int, **fields) -> dict:
    """What a plain row with these fields runs with under FLAGS: a SamplingParams made directly, its seed the job's
    for that row unless it has its own."""
    params = SamplingParams(**{**DEFAULTS, "seed": _row_seed(EngineConfig().seed, row), **fields})
    return {s.name: getattr(params, s.name) for s in settings(SamplingParams)}


def test_the_struct_is_every_declared_field():
    assert SAMPLING_TYPE.names == [s.name for s in settings(SamplingParams) if s.meta["per_row"]]
    assert SAMPLING_TYPE.names == [f.name for f in fields(SamplingParams)]  # every field may be a row's


def test_every_field_survives_the_column():
    params = SamplingParams(n=3, max_tokens=7, temperature=0.3, top_p=0.5, top_k=9, min_p=0.1, seed=2**64 - 1,
                            stop=["a", "b"], stop_token_ids=[4], ignore_eos=True, min_tokens=2,
                            include_stop_str_in_output=True, presence_penalty=-1, frequency_penalty=1.5,
                            repetition_penalty=1.3, logit_bias={"5": -3}, allowed_token_ids=[1, 2],
                            bad_words=["no"], logprobs=2, prompt_logprobs=1, prompt_logprobs_start=1,
                            skip_special_tokens=False, spaces_between_special_tokens=False,
                            structured_outputs={"regex": "[ab]+"})
    table = pa.Table.from_pylist([{"sampling": sampling_record(params)}], schema=pa.schema([("sampling",
                                                                                             SAMPLING_TYPE)]))
    back = as_written(table.column("sampling")[0].as_py())
    want = {s.name: getattr(params, s.name) for s in settings(SamplingParams)}
    want["structured_outputs"] = want["structured_outputs"].key()
    assert back == want
    assert StructuredOutputsParams.from_value(back["structured_outputs"]) == params.structured_outputs


def test_each_row_has_what_it_ran_with(tiny_model_dir, tmp_path):
    rows = [{"prompt": "a b", "temperature": 0.5, "top_k": 7, "stop": "zz", "seed": 11, "logit_bias": {"3": -2},
             "bad_words": ["foo"]},
            {"prompt": "a b"},
            {"prompt": "a b c", "n": 2, "logprobs": 2, "prompt_logprobs": 1, "stop_token_ids": [5], "min_tokens": 1,
             "ignore_eos": True, "repetition_penalty": 1.2, "frequency_penalty": 0.1, "min_p": 0.05},
            {"prompt": "a", "temperature": -1},  # a bad row
            {"prompt": "a", "max_tokens": 10**6}]  # refused once its SamplingParams are made
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    table = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", *FLAGS)
    got = table.column("sampling").to_pylist()
    for i in range(3):
        assert as_written(got[i]) == expected(i, **{k: v for k, v in rows[i].items() if k != "prompt"})
    assert got[3:] == [None, None]  # error rows
    assert [e is not None for e in table.column("error").to_pylist()] == [False] * 3 + [True] * 2
    result = CliRunner().invoke(main, ["report", str(tmp_path / "out.parquet")])  # reads the new schema
    assert result.exit_code == 0 and json.loads(result.stdout)["rows"] == len(rows), result.output


def test_an_openai_body_is_recorded_under_sampling_params_names(tiny_model_dir, tmp_path):
    body = {"model": "m", "prompt": "a b", "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2,
            "stop": "x", "seed": 5}
    src = write_jsonl(tmp_path / "batch.jsonl", [{"custom_id": "c0", "method": "POST", "url": "/v1/completions",
                                                  "body": body}])
    (got,) = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", *FLAGS).column("sampling").to_pylist()
    assert as_written(got) == expected(0, max_tokens=3, logprobs=2, stop=["x"], seed=5)


def test_the_openai_output_keeps_openais_shape(tiny_model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    ok_result(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, "--max-tokens", "2")
    for line in out.read_text().splitlines():
        obj = json.loads(line)
        assert "sampling" not in obj and "sampling" not in obj["response"]["body"]


def test_resumed_pieces_concatenate(tiny_model_dir, tmp_path, monkeypatch):
    """Pieces of two runs, rows with and without fields of their own, one output."""
    rows = [{"prompt": f"p {i}", **({"logit_bias": {"1": 1}} if i % 2 else {"stop": ["q"]})} for i in range(8)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    crash_after_commits(monkeypatch, tiny_model_dir, src, out, "--piece-rows", "1")
    pieces = sorted(parts_dir(out).glob("piece-*.parquet"))
    for piece in pieces[::2]:
        piece.unlink()  # their rows are computed again by the next run
    table = ok_run(tiny_model_dir, src, out, *FLAGS, "--piece-rows", "1")
    got = table.column("sampling").to_pylist()
    assert [as_written(g) for g in got] == [expected(i, **{k: v for k, v in r.items() if k != "prompt"})
                                            for i, r in enumerate(rows)]


def crash_after_commits(monkeypatch, model, src, out, *args) -> None:
    def crash(self, *a, **k):
        raise Crash

    with monkeypatch.context() as m:
        m.setattr(PartsWriter, "finalize", crash)
        assert isinstance(run(model, src, out, *FLAGS, *args).exception, Crash)


def _as_older_version(table: pa.Table, job: dict) -> pa.Table:
    """The table as a tinyvllm without the column wrote it: no `sampling`, a job identity without its digest."""
    job = {k: v for k, v in job.items() if k != "output_schema"}
    metadata = {**(table.schema.metadata or {}), b"tinyvllm.job": json.dumps(job).encode()}
    return table.drop_columns(["sampling"]).replace_schema_metadata(metadata)


def test_an_older_finished_output_is_another_job(tiny_model_dir, tmp_path):
    out = tmp_path / "out.parquet"
    table = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, *FLAGS)
    job = json.loads(table.schema.metadata[b"tinyvllm.job"])
    assert "output_schema" in job
    pq.write_table(_as_older_version(table, job), out)
    line = one_line_error(run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, *FLAGS), "--overwrite")
    assert "output columns are another tinyvllm version's" in line
    again = ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, *FLAGS, "--overwrite")
    assert again.schema.field("sampling").type == SAMPLING_TYPE


def test_older_pieces_are_not_resumed(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out.parquet"
    crash_after_commits(monkeypatch, tiny_model_dir, EXAMPLES / "prompts.jsonl", out)
    parts = parts_dir(out)
    manifest = json.loads((parts / "manifest.json").read_text())
    for piece in parts.glob("piece-*.parquet"):
        pq.write_table(_as_older_version(pq.read_table(piece), manifest["job"]), piece)
    del manifest["job"]["output_schema"]
    (parts / "manifest.json").write_text(json.dumps(manifest))
    line = one_line_error(run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, *FLAGS), "cannot resume")
    assert "output columns are another tinyvllm version's" in line and "--overwrite" in line
    assert not out.exists()
    ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, *FLAGS, "--overwrite")


def test_readme_lists_every_output_column():
    section = README.split("## Output schema", 1)[1].splitlines()
    start = next(i for i, line in enumerate(section) if line.startswith("| column |"))
    listed = set()
    for line in section[start + 2:]:
        if not line.startswith("|"):
            break
        listed.update(re.findall(r"`([a-z0-9_]+)`", line.split(" | ")[0]))
    assert [name for name in output_schema(token_ids=True).names if name not in listed] == []
