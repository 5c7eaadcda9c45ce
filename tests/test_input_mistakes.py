"""A new user's input mistakes (issue 37), each fed as a user would and answered with one line or an error row that
names the fix: a misspelt row field, a Parquet input without a prompt column, a plain line in an OpenAI batch file;
and the input options a first look needs: --prompt-column / --messages-column, --limit N, --input - (stdin)."""

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tinyvllm.cli import main
from tinyvllm.errors import JobError, JobUsageError
from tinyvllm.io.readers import (MEANT_FIELDS, OTHER_API_NAMES, REQUEST_FIELDS, InputOptions, count_rows,
                                 input_columns, read_rows)
from tinyvllm.io.stdin import spooled_stdin
from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.file import load_job_file
from tinyvllm.names import edit_distance, nearest
from tinyvllm.sampling_params import OVERRIDABLE_FIELDS

from test_cli import EXAMPLES, metadata, ok_run, run


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_line(result, code: int, message: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


# ---- misspelt row fields --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, meant", [
    ("max_token", "max_tokens"), ("maxTokens", "max_tokens"), ("Max-Tokens", "max_tokens"),
    ("temprature", "temperature"), ("topk", "top_k"), ("TopP", "top_p"), ("stop_sequences", "stop"),
    ("stopSequences", "stop"), ("max_new_tokens", "max_tokens"), ("frequence_penalty", "frequency_penalty"),
    ("repitition_penalty", "repetition_penalty"), ("logprob", "logprobs"),
    ("chat_template_kwarg", "chat_template_kwargs"),
])
def test_a_misspelt_field_is_an_error_row_naming_the_field_meant(tmp_path, field, meant):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", field: 3}, {"prompt": "hi", "max_tokens": 3}])
    bad, good = read_rows(path, input_columns(path))
    assert bad.error == (f"line 1: unknown field {field!r} (did you mean {meant!r}?); --allow-unknown-fields keeps "
                         "it as a data column")
    assert good.error is None and good.overrides == {"max_tokens": 3}


def test_every_misspelling_in_a_row_is_named(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", "max_token": 3, "temprature": 0,
                                               "stop_sequences": ["."]}])
    [row] = read_rows(path)
    assert row.error == ("line 1: unknown fields 'max_token' (did you mean 'max_tokens'?), 'temprature' (did you mean "
                         "'temperature'?), 'stop_sequences' (did you mean 'stop'?); --allow-unknown-fields keeps them "
                         "as data columns")


def test_a_misspelt_prompt_is_named_only_in_a_row_without_one(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"promt": "hi"}, {"Messages": [{"role": "user", "content": "x"}]},
                                               {"prompt": "hi", "prompts": "data", "message": "data"}])
    rows = list(read_rows(path, allow_unknown_fields=True))  # a row without a prompt cannot run, allowed or not
    assert [r.error for r in rows] == ["line 1: unknown field 'promt' (did you mean 'prompt'?)",
                                       "line 2: unknown field 'Messages' (did you mean 'messages'?)", None]
    assert rows[2].columns == {}  # not asked for here; they are data columns (below)
    assert {"prompts", "message"} <= set(input_columns(path).names)


def test_a_field_like_no_request_field_stays_a_data_column(tmp_path):
    data = {"step": 1, "tool": "calc", "seeds": [1, 2], "n_tokens": 5, "ID": "a", "answer": "4", "temperature_c": 21.5,
            "prompt_2": "b", "stops": 2, "topic": "maths"}
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", **data}])
    [row] = read_rows(path, input_columns(path))
    assert row.error is None and row.overrides == {} and row.columns == data


def test_allow_unknown_fields_carries_misspelt_fields_as_columns(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hello there", "max_token": 3, "temprature": 0}])
    table = ok_run(tiny_model_dir, path, tmp_path / "out.parquet", "--allow-unknown-fields", "--max-tokens", "5",
                   "--ignore-eos")
    row = table.to_pylist()[0]
    assert row["error"] is None and row["completion_tokens"] == 5  # the job's max_tokens: max_token is data
    assert row["max_token"] == 3 and row["temprature"] == 0 and row["ignored_fields"] is None


def test_the_issue_row_through_the_cli(tiny_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hello there", "max_token": 3, "temprature": 0,
                                               "stop_sequences": ["."]}, {"prompt": "Hello", "max_tokens": 2}])
    rows = ok_run(tiny_model_dir, path, tmp_path / "out.parquet").to_pylist()
    assert "'max_token' (did you mean 'max_tokens'?)" in rows[0]["error"] and rows[0]["finish_reason"] == "error"
    assert rows[1]["error"] is None


def test_a_misspelt_field_in_an_openai_body_names_the_field_meant(tmp_path):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_token": 3}}
    [row] = read_rows(write_jsonl(tmp_path / "in.jsonl", [line]))
    assert row.error == "line 1: unsupported field 'max_token' (did you mean 'max_tokens'?)"


def test_the_fields_meant_are_the_readers_request_fields():
    assert set(OVERRIDABLE_FIELDS) <= MEANT_FIELDS <= REQUEST_FIELDS
    assert set(OTHER_API_NAMES.values()) <= MEANT_FIELDS
    assert "id" not in MEANT_FIELDS and "tools" not in MEANT_FIELDS


def test_nearest():
    known = ["max_tokens", "min_tokens", "seed", "stop", "top_k", "temperature", "frequency_penalty"]
    assert nearest("MAX-TOKENS", known) == "max_tokens" and nearest("mxa_tokens", known) == "max_tokens"
    assert nearest("frequncy_penalti", known) == "frequency_penalty"  # two slips in a long name
    assert nearest("temperatre", known) == "temperature" and nearest("tmperatre", known) is None
    assert nearest("step", known) is None and nearest("Seed", known) == "seed" and nearest("seeds", known) is None
    assert nearest("n_tokens", known) is None and nearest("answer", known) is None
    assert nearest("temperature_c", known) is None and nearest("maxTokens2", known) is None
    assert edit_distance("abcd", "abdc") == 1 and edit_distance("kitten", "sitting") == 3


# ---- a Parquet input without a prompt or messages column, and the column options --------------------------------

def write_parquet(path: Path, **columns) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_a_parquet_input_without_prompt_is_one_line_exit_2(tiny_model_dir, tmp_path):
    path = write_parquet(tmp_path / "in.parquet", question=["What is 2+2?"], answer=["4"])
    result = run(tiny_model_dir, path, tmp_path / "out.parquet")
    one_line(result, 2, f"the input {path} has no prompt or messages column (columns: question, answer): name the one "
                        "to use with --prompt-column NAME or --messages-column NAME")
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "out.parquet.parts").exists()
    cased = write_parquet(tmp_path / "cased.parquet", Prompt=["hi"], Messages=[None])
    one_line(run(tiny_model_dir, cased, tmp_path / "out.parquet"), 2,
             "name the one to use with --prompt-column Prompt or --messages-column Messages")


@pytest.mark.parametrize("args, message", [
    (["--prompt-column", "questio"], "--prompt-column questio: the input {path} has no column 'questio' (columns: "
                                     "question, prompt)"),
    (["--prompt-column", "question"], "--prompt-column question: the input {path} has a 'prompt' column too"),
])
def test_a_column_option_the_parquet_input_does_not_fit_is_one_line_exit_2(tiny_model_dir, tmp_path, args, message):
    path = write_parquet(tmp_path / "in.parquet", question=["What is 2+2?"], prompt=["x"])
    one_line(run(tiny_model_dir, path, tmp_path / "out.parquet", *args), 2, message.format(path=path))


def test_prompt_column_maps_a_parquet_column(tiny_model_dir, tmp_path):
    path = write_parquet(tmp_path / "in.parquet", question=["What is 2+2?", "Hi"], answer=["4", "hello"])
    table = ok_run(tiny_model_dir, path, tmp_path / "out.parquet", "--prompt-column", "question", "--max-tokens", "2")
    assert table.column("prompt").to_pylist() == ["What is 2+2?", "Hi"] and table.column("error").null_count == 2
    assert "answer" in table.column_names and "question" not in table.column_names  # a request field, not data
    assert metadata(table)["job"]["prompt_column"] == "question"


def test_column_options_on_jsonl(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a", "gold": 1}, {"conversation": chat}, {"prompt": "b"},
                                               {"gold": 2}, {"text": "c", "prompt": "d"}])
    options = InputOptions(prompt_column="text", messages_column="conversation")
    assert input_columns(path, options=options).names == ["gold"]
    rows = list(read_rows(path, input_columns(path, options=options), options=options))
    assert [(r.prompt, r.messages) for r in rows[:3]] == [("a", None), (None, chat), ("b", None)]
    assert rows[0].columns == {"gold": 1}
    assert rows[3].error == "line 4: missing 'text' (--prompt-column) or 'conversation' (--messages-column)"
    assert rows[4].error == "line 5: has both 'text' (--prompt-column) and 'prompt': give one"


def test_column_options_are_checked_and_are_job_file_keys(tmp_path):
    for settings, message in [({"prompt_column": "a", "messages_column": "a"}, "both 'a'"),
                              ({"prompt_column": "max_tokens"}, "the name of another request field"),
                              ({"messages_column": ""}, "name a column"), ({"limit": 0}, "must be >= 1")]:
        with pytest.raises(ValueError, match=message):
            JobConfig(input=Path("in.jsonl"), output=Path("out.parquet"), **settings)
    job = tmp_path / "job.toml"
    job.write_text('input = "in.parquet"\noutput = "out.parquet"\nprompt_column = "question"\n'
                   'messages_column = "chat"\nlimit = 5\n')
    cfg = load_job_file(job, {}, {})
    assert cfg.input_options == InputOptions("question", "chat", 5)


# ---- a plain line in an OpenAI batch file ----------------------------------------------------------------------

def test_a_plain_line_in_an_openai_batch_file_is_an_error_line(tiny_model_dir, tmp_path):
    lines = (EXAMPLES / "openai_batch.jsonl").read_text().splitlines()
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join([lines[0], json.dumps({"prompt": "plain", "max_tokens": 2}), *lines[1:]]) + "\n")
    for output in ("out.parquet", "out.jsonl"):
        result = run(tiny_model_dir, path, tmp_path / output, "--max-tokens", "2")
        assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert rows[1]["error"] == ("line 2: a plain row in an OpenAI batch file (its first line has custom_id): every "
                                "line needs custom_id, method, url and body")
    assert rows[0]["error"] is None and rows[2]["error"] is None and len(rows) == len(lines) + 1
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert "a plain row" in answers[1]["error"]["message"] and answers[0]["error"] is None


# ---- --limit N -----------------------------------------------------------------------------------------------------

def test_limit_runs_the_first_rows_and_is_part_of_the_job(tiny_model_dir, tmp_path):
    src, out = EXAMPLES / "prompts.jsonl", tmp_path / "out.parquet"
    table = ok_run(tiny_model_dir, src, out, "--limit", "3", "--max-tokens", "2")
    assert table.column("row").to_pylist() == [0, 1, 2] and metadata(table)["job"]["limit"] == 3
    again = run(tiny_model_dir, src, out, "--limit", "3", "--max-tokens", "2")
    assert again.exit_code == 0 and "already complete" in again.stderr
    whole = run(tiny_model_dir, src, out, "--max-tokens", "2")  # not the same job: not "already complete"
    one_line(whole, 1, "from a different job (limit 3 -> None); pass --overwrite")
    assert ok_run(tiny_model_dir, src, out, "--max-tokens", "2", "--overwrite").num_rows == count_rows(src) > 3


def test_limit_reads_no_further(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a", "x": 1}\n\n{"prompt": "b"}\n{"prompt": "c", "x": "text"}\nnot json\n')
    options = InputOptions(limit=2)
    assert count_rows(path, options) == 2 and [r.prompt for r in read_rows(path, options=options)] == ["a", "b"]
    assert input_columns(path, options=options).field("x").type == pa.int64()  # typed over the rows read
    parquet = write_parquet(tmp_path / "in.parquet", prompt=["a", "b", "c"])
    assert count_rows(parquet, options) == 2 and len(list(read_rows(parquet, options=options))) == 2


# ---- --input - (standard input) -------------------------------------------------------------------------------------

def stdin_run(model, data: bytes, output: Path, *args):
    return CliRunner().invoke(main, ["run", "--model", str(model), "--input", "-", "--output", str(output),
                                     "--backend", "numpy", "--quiet", "--max-tokens", "2", *args], input=data)


def test_stdin_input_resumes_by_content(tiny_model_dir, tmp_path):
    data, out = (EXAMPLES / "prompts.jsonl").read_bytes(), tmp_path / "out.parquet"
    result = stdin_run(tiny_model_dir, data, out)
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.num_rows == count_rows(EXAMPLES / "prompts.jsonl") and metadata(table)["input"] == "-"
    assert table.column("completion").to_pylist() == ok_run(tiny_model_dir, EXAMPLES / "prompts.jsonl",
                                                            tmp_path / "file.parquet", "--max-tokens", "2").column(
        "completion").to_pylist()
    again = stdin_run(tiny_model_dir, data, out)
    assert again.exit_code == 0 and "already complete" in again.stderr
    other = stdin_run(tiny_model_dir, data.splitlines(keepends=True)[0], out)
    one_line(other, 1, "from a different job (input_sha256")
    assert not list(Path(__import__("tempfile").gettempdir()).glob("tinyvllm-stdin-*"))  # the copies are gone


def test_stdin_parquet_with_a_prompt_column(tiny_model_dir, tmp_path):
    path = write_parquet(tmp_path / "in.parquet", question=["What is 2+2?"])
    result = stdin_run(tiny_model_dir, path.read_bytes(), tmp_path / "out.parquet", "--prompt-column", "question")
    assert result.exit_code == 0, result.output
    assert pq.read_table(tmp_path / "out.parquet").column("prompt").to_pylist() == ["What is 2+2?"]
    one_line(stdin_run(tiny_model_dir, path.read_bytes(), tmp_path / "o2.parquet"), 2,
             "has no prompt or messages column (columns: question)")


def test_stdin_from_a_terminal_is_one_line():
    class Terminal(io.BytesIO):
        def isatty(self) -> bool:
            return True

    with pytest.raises(JobUsageError, match="standard input is a terminal; pipe the input in"):
        with spooled_stdin(Terminal(b"")):
            pass
    assert issubclass(JobUsageError, JobError) and JobUsageError.exit_code == 2
