"""Issue 12, job side: every request field of a row is applied or refused, the input's other columns reach the output,
n / logprobs / prompt_logprobs columns, the OpenAI batch output format (.jsonl), chat template options."""

import datetime
import decimal
import json
import math
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import EXAMPLES, Crash, one_line_error, run, write_jsonl
from helpers import ok_result as ok_run

from tinyvllm import LLM, SamplingParams
from tinyvllm.cli import main
from tinyvllm.io import JobError, input_columns, read_rows
from tinyvllm.io.readers import parse_request
from tinyvllm.io.writer import PartsWriter, parts_dir

def crash_before_finalize(model, src, out, monkeypatch, *args) -> None:
    """Run the job until every row is committed, then crash before the output is assembled."""
    def crash(self, *a, **k):
        raise Crash

    with monkeypatch.context() as m:
        m.setattr(PartsWriter, "finalize", crash)
        result = run(model, src, out, *args)
    assert isinstance(result.exception, Crash), result.output
    assert not out.exists() and any(parts_dir(out).glob("piece-*.parquet"))


def openai(url: str, custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


# ---- 1. nothing silently ignored ----

@pytest.mark.parametrize("body,overrides", [
    ({"max_completion_tokens": 9, "max_tokens": 4}, {"max_tokens": 9}),
    ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
    ({"logprobs": True}, {"logprobs": 0}),  # OpenAI: the sampled token's logprob only
    ({"logprobs": False}, {}),
    ({"stop": "\n", "n": 3, "seed": 5}, {"stop": ["\n"], "n": 3, "seed": 5}),
    ({"presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"7": 100}},
     {"presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"7": 100}}),
    ({"model": "gpt-x", "user": "u", "metadata": {"a": 1}, "store": False, "stream": False, "tools": None}, {}),
    ({"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [3],
      "include_stop_str_in_output": True, "skip_special_tokens": False, "ignore_eos": True, "prompt_logprobs": 1,
      "allowed_token_ids": [3, 4], "bad_words": ["x"]},
     {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [3],
      "include_stop_str_in_output": True, "skip_special_tokens": False, "ignore_eos": True, "prompt_logprobs": 1,
      "allowed_token_ids": [3, 4], "bad_words": ["x"]}),
])
def test_openai_body_fields_are_applied(body, overrides):
    request = parse_request(openai("/v1/chat/completions", "a", messages=[{"role": "user", "content": "hi"}],
                                   **body))
    assert request.overrides == overrides and request.ignored_fields == []


@pytest.mark.parametrize("body,reason", [
    ({"guided_decoding_backend": "xgrammar"}, "unsupported field 'guided_decoding_backend' (one structured-outputs"),
    ({"tools": [{"type": "function"}]}, "unsupported field 'tools' (tool calling"),
    ({"stream": True}, "unsupported field 'stream'"),
    ({"frobnicate": 1}, "unsupported field 'frobnicate'"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"logprobs": "yes"}, "invalid logprobs='yes'"),
    ({"ignore_eos": 1}, "invalid ignore_eos=1"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs must be an object"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "unsupported field 'messages[].tool_calls'"),
    ({"messages": None, "prompt": "text"}, "/v1/chat/completions takes messages, not prompt"),
])
def test_openai_body_fields_are_refused(body, reason):
    obj = openai("/v1/chat/completions", "a", **{"messages": [{"role": "user", "content": "hi"}], **body})
    with pytest.raises(ValueError) as e:
        parse_request(obj)
    assert reason in str(e.value)


def test_plain_row_fields(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "x", "n": 2, "logprobs": 1, "prompt_logprobs": 0, "answer": "B", "model": "m"},
        {"id": "b", "prompt": "x", "prediction": {"type": "content", "content": "y"}, "answer": "C"},
        {"id": "c", "messages": [{"role": "user", "content": "hi", "name": "bob"}], "add_generation_prompt": False,
         "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}},
    ])
    columns = input_columns(path)
    assert columns.names == ["answer", "model"]  # data: carried, never read as a request field
    a, b, c = read_rows(path, columns)
    assert a.overrides == {"n": 2, "logprobs": 1, "prompt_logprobs": 0} and a.columns == {"answer": "B", "model": "m"}
    assert "unsupported field 'prediction'" in b.error and b.columns == {"answer": "C", "model": None}
    assert c.messages == [{"role": "user", "content": "hi", "name": "bob"}]
    assert c.chat_options == {"add_generation_prompt": False, "continue_final_message": True,
                              "chat_template_kwargs": {"enable_thinking": False}}
    _, b, _ = read_rows(path, columns, allow_unknown_fields=True)
    assert b.error is None and b.ignored_fields == ["prediction"]


def test_input_columns_types(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "a", "num": 1, "mixed": 1, "tags": ["x"], "obj": {"k": 1}, "none": None},
        {"prompt": "b", "num": 2.5, "mixed": "two", "tags": [], "obj": {"k": 2, "j": "s"}},
        {"prompt": "c"},
    ])
    columns = input_columns(path)
    types = {f.name: f.type for f in columns}
    assert types == {"num": pa.float64(), "mixed": pa.string(), "tags": pa.list_(pa.string()),
                     "obj": pa.struct([("k", pa.int64()), ("j", pa.string())]), "none": pa.null()}
    rows = list(read_rows(path, columns))
    assert [r.columns["mixed"] for r in rows] == ["1", '"two"', None]  # no common type: JSON text
    assert [r.columns["num"] for r in rows] == [1, 2.5, None]
    assert input_columns(path, keep=["num"]).names == ["num"] and input_columns(path, drop=True).names == []
    with pytest.raises(JobError, match="has no data column 'nope'"):
        input_columns(path, keep=["nope"])
    with pytest.raises(JobError, match="has no data column 'prompt'"):  # request fields are not carried
        input_columns(path, keep=["prompt"])


# ---- 2. the fields reach the engine, the results reach the output ----

SAMPLED_ROWS = [
    {"id": "bias", "logit_bias": {"42": 100}, "max_tokens": 4, "temperature": 1.0, "seed": 1},
    {"id": "allowed", "allowed_token_ids": [5, 6], "max_tokens": 4, "seed": 2},
    {"id": "penalties", "presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3,
     "max_tokens": 6, "temperature": 0},
    {"id": "n", "n": 3, "max_tokens": 5, "seed": 4, "logprobs": 2},
    {"id": "stop-token", "logit_bias": {"42": 100}, "stop_token_ids": [42], "max_tokens": 5, "seed": 5},
    {"id": "min-tokens", "min_tokens": 3, "max_tokens": 3, "ignore_eos": True, "seed": 6},
    {"id": "prompt-logprobs", "prompt_logprobs": 1, "max_tokens": 2, "temperature": 0},
]


def test_row_sampling_fields_equal_the_engine(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "one two three", "gold": i, **r}
                                              for i, r in enumerate(SAMPLED_ROWS)])
    ok_run(tiny_model_dir, src, tmp_path / "out.parquet", "--output-token-ids")
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    llm = LLM(tiny_model_dir, backend="numpy")
    params = [SamplingParams(**{k: v for k, v in r.items() if k != "id"}) for r in SAMPLED_ROWS]
    for want, fields in zip(llm.generate(["one two three"] * len(params), params), SAMPLED_ROWS):
        got = rows[fields["id"]]
        assert got["error"] is None and got["gold"] == SAMPLED_ROWS.index(fields)  # carried
        assert got["completion"] == want.outputs[0].text and got["completion_token_ids"] == want.outputs[0].token_ids
        assert got["completion_tokens"] == sum(len(c.token_ids) for c in want.outputs)
    assert set(rows["bias"]["completion_token_ids"]) == {42}  # +100 forces it
    assert set(rows["allowed"]["completion_token_ids"]) <= {5, 6}
    assert rows["stop-token"]["finish_reason"] == "stop" and rows["stop-token"]["completion_token_ids"] == [42]
    assert rows["min-tokens"]["completion_tokens"] == 3

    n = rows["n"]
    assert len(n["completions"]) == 3 and n["completions"][0] == n["completion"]
    assert len(set(n["completions"])) > 1 and n["completions_tokens"] == [5, 5, 5]
    assert n["completions_finish_reasons"] == ["length"] * 3 and len(n["completions_cumulative_logprobs"]) == 3
    assert n["cumulative_logprob"] == n["completions_cumulative_logprobs"][0]
    assert len(n["logprobs"]) == 5 and all(2 <= len(top) <= 3 for top in n["top_logprobs"])

    plp = rows["prompt-logprobs"]
    assert len(plp["prompt_logprobs"]) == plp["prompt_tokens"] and plp["prompt_logprobs"][0] is None
    assert all(lp <= 0 for lp in plp["prompt_logprobs"][1:]) and plp["prompt_top_logprobs"][0] is None
    assert plp["logprobs"] is None and rows["bias"]["prompt_logprobs"] is None  # not asked: null
    assert all(r["completions"] is None for r in rows.values() if r["id"] != "n")


def test_unknown_fields_refused_or_allowed_with_one_warning(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "a", "max_tokens": 2, "tools": [{"type": "function"}]},
        {"prompt": "b", "max_tokens": 2, "tools": [], "prediction": {"type": "content", "content": "y"}},
        {"prompt": "c", "max_tokens": 2},
    ])
    ok_run(tiny_model_dir, src, tmp_path / "strict.parquet")
    rows = pq.read_table(tmp_path / "strict.parquet").to_pylist()
    assert "unsupported field 'tools'" in rows[0]["error"] and "unsupported field" in rows[1]["error"]
    assert rows[2]["error"] is None

    result = ok_run(tiny_model_dir, src, tmp_path / "lax.parquet", "--allow-unknown-fields")
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and "'tools'" in warnings[0] + warnings[1]
    rows = pq.read_table(tmp_path / "lax.parquet").to_pylist()
    assert all(r["error"] is None for r in rows)
    assert [r["ignored_fields"] for r in rows] == [["tools"], ["prediction", "tools"], None]
    summary = json.loads((tmp_path / "lax.summary.json").read_text())
    assert summary["ignored_fields"] == {"prediction": 1, "tools": 2}


def test_carried_columns_round_trip_every_arrow_type_and_resume(tiny_model_dir, tmp_path, monkeypatch):
    n = 3
    data = {
        "i8": pa.array([1, -2, None], pa.int8()), "u64": pa.array([2**63, 0, 1], pa.uint64()),
        "f32": pa.array([1.5, None, 2.0], pa.float32()), "f64": pa.array([float("nan"), 1.0, None]),
        "f16": pa.array([np.float16(0.5)] * n, pa.float16()),
        "flag": pa.array([True, False, None]), "text": pa.array(["x", None, "z"], pa.large_string()),
        "blob": pa.array([b"\x00\x01", b"", None]), "fixed": pa.array([b"ab", b"cd", b"ef"], pa.binary(2)),
        "day": pa.array([datetime.date(2020, 1, 2)] * n),
        "when": pa.array([datetime.datetime(2020, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)] * n,
                         pa.timestamp("ms", tz="UTC")),
        "clock": pa.array([datetime.time(1, 2, 3)] * n, pa.time64("us")),
        "span": pa.array([datetime.timedelta(seconds=5)] * n, pa.duration("s")),
        "money": pa.array([decimal.Decimal("1.25"), None, decimal.Decimal("-3.50")], pa.decimal128(6, 2)),
        "cat": pa.array(["a", "b", "a"]).dictionary_encode(),
        "tags": pa.array([["x"], [], None], pa.list_(pa.string())),
        "pair": pa.array([{"k": 1, "v": "a"}, None, {"k": 3, "v": None}]),
        "attrs": pa.array([[("a", 1)], [], None], pa.map_(pa.string(), pa.int64())),
        "nothing": pa.nulls(n),
    }
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["p0", "p1", "p2"], "max_tokens": [2, 3, 2], **data}), src)
    out = tmp_path / "out.parquet"
    crash_before_finalize(tiny_model_dir, src, out, monkeypatch, "--piece-rows", "1")
    result = ok_run(tiny_model_dir, src, out, "--piece-rows", "1")  # resumes from the pieces
    assert "damaged" not in result.stderr
    table = pq.read_table(out)
    kept = table.select(list(data))
    want = pq.read_table(src).select(list(data))
    assert kept.schema.remove_metadata() == want.schema.remove_metadata()
    assert math.isnan(kept.column("f64")[0].as_py())  # a data column's NaN is kept (not taken for "absent")
    assert kept.drop_columns(["f64"]).to_pylist() == want.drop_columns(["f64"]).to_pylist()
    assert kept.column("f64").to_pylist()[1:] == [1.0, None]
    assert table.column("completion_tokens").to_pylist() == [2, 3, 2]

    ok_run(tiny_model_dir, src, tmp_path / "k.parquet", "--keep-columns", "money, tags")
    assert [n for n in pq.read_schema(tmp_path / "k.parquet").names if n in data] == ["money", "tags"]
    ok_run(tiny_model_dir, src, tmp_path / "d.parquet", "--drop-input-columns")
    assert not set(pq.read_schema(tmp_path / "d.parquet").names) & set(data)


@pytest.mark.parametrize("args,message,code", [
    ([], "the input column 'completion' has the name of a result column", 1),
    (["--keep-columns", "nope"], "has no data column 'nope'", 1),
    (["--keep-columns", "a", "--drop-input-columns"], "contradict each other", 2),  # flags that contradict: usage
])
def test_column_clashes_are_job_errors(tiny_model_dir, tmp_path, args, message, code):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "completion": "gold", "a": 1}])
    assert message in one_line_error(run(tiny_model_dir, src, tmp_path / "o.parquet", *args), exit_code=code)
    assert not (tmp_path / "o.parquet").exists()
    if not args:  # dropping the clashing column is the way out
        ok_run(tiny_model_dir, src, tmp_path / "o.parquet", "--keep-columns", "a")


@pytest.mark.parametrize("name", ["out.txt", "out.json", "out"])
def test_unknown_output_extension_is_a_job_error(tiny_model_dir, tmp_path, name):
    error = one_line_error(run(tiny_model_dir, EXAMPLES / "prompts.jsonl", tmp_path / name))
    assert "unsupported output format" in error and not (tmp_path / name).exists()


# ---- 3. OpenAI batch output ----

def check_openai_line(line: dict, data_columns: set[str]) -> None:
    """A line of OpenAI's Batch API output file: {id, custom_id, response: {status_code, request_id, body}, error}."""
    assert set(line) == {"id", "custom_id", "response", "error"} | data_columns
    assert isinstance(line["id"], str) and isinstance(line["custom_id"], str)
    if line["error"] is not None:
        assert line["response"] is None and set(line["error"]) == {"code", "message"}
        assert isinstance(line["error"]["code"], str) and isinstance(line["error"]["message"], str)
        return
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200
    body = response["body"]
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
    chat = body["object"] == "chat.completion"
    assert body["object"] in ("chat.completion", "text_completion") and isinstance(body["created"], int)
    for i, choice in enumerate(body["choices"]):
        assert choice["index"] == i and choice["finish_reason"] in ("stop", "length")
        if chat:
            assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        else:
            assert isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert set(body["metrics"]) == {"queue_ms", "ttft_ms", "tpot_ms", "e2e_ms"} and body["metrics"]["e2e_ms"] > 0


def test_openai_batch_output(tiny_model_dir, tmp_path, monkeypatch):
    rows = [json.loads(line) for line in (EXAMPLES / "openai_batch.jsonl").read_text().splitlines()]
    rows += [openai("/v1/chat/completions", "n-logprobs", messages=[{"role": "user", "content": "hi"}], n=2,
                    max_tokens=3, logprobs=True, top_logprobs=2, seed=1),
             openai("/v1/completions", "text-logprobs", prompt="one two", max_tokens=3, logprobs=1, temperature=0),
             openai("/v1/chat/completions", "refused", messages=[{"role": "user", "content": "hi"}],
                    prediction={"type": "content", "content": "y"}),
             openai("/v1/chat/completions", "json", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                    response_format={"type": "json_schema", "json_schema": {
                        "name": "answer", "strict": True, "schema": {"type": "string", "enum": ["yes", "no"]}}})]
    src = write_jsonl(tmp_path / "batch.jsonl", rows)
    out = tmp_path / "results.jsonl"
    crash_before_finalize(tiny_model_dir, src, out, monkeypatch, "--piece-rows", "2")
    ok_run(tiny_model_dir, src, out, "--piece-rows", "2")  # resumes, then writes the JSONL
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in rows]
    for line in lines:
        check_openai_line(line, set())
    by_id = {line["custom_id"]: line for line in lines}
    assert "unsupported url '/v1/embeddings'" in by_id["req-5"]["error"]["message"]
    assert "unsupported field 'prediction'" in by_id["refused"]["error"]["message"]
    assert json.loads(by_id["json"]["response"]["body"]["choices"][0]["message"]["content"]) in ("yes", "no")
    assert by_id["req-1"]["response"]["body"]["object"] == "chat.completion"
    assert by_id["req-3"]["response"]["body"]["object"] == "text_completion"
    assert by_id["req-1"]["response"]["body"]["usage"]["completion_tokens"] <= 16
    chat = by_id["n-logprobs"]["response"]["body"]
    assert len(chat["choices"]) == 2 and chat["usage"]["completion_tokens"] == 6
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(isinstance(c["token"], str) and c["logprob"] <= 0 for c in content)
    assert all(1 <= len(c["top_logprobs"]) <= 3 for c in content) and chat["choices"][1]["logprobs"] is None
    text = by_id["text-logprobs"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(text["tokens"]) == len(text["token_logprobs"]) == len(text["top_logprobs"]) == 3
    summary = json.loads((tmp_path / "results.summary.json").read_text())
    assert summary["rows"] == len(rows) and summary["error_rows"] == 2 and summary["metadata"]["job"]

    again = ok_run(tiny_model_dir, src, out, "--piece-rows", "2")
    assert "already complete" in again.stderr
    changed = run(tiny_model_dir, src, out, "--max-tokens", "5")
    assert "exists from a different job" in one_line_error(changed)


def test_openai_output_of_plain_rows_carries_their_columns(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "q1", "prompt": "2 + 2 =", "answer": 4, "max_tokens": 2},
        {"id": "q2", "messages": [{"role": "user", "content": "hi"}], "answer": [1, 2], "max_tokens": 2},
        {"id": "q3", "prompt": "", "answer": None},
    ])
    ok_run(tiny_model_dir, src, tmp_path / "o.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    for line in lines:
        check_openai_line(line, {"answer"})
    assert [line["answer"] for line in lines] == ['4', "[1, 2]", None]  # no common type: JSON text
    assert [line["response"]["body"]["object"] for line in lines[:2]] == ["text_completion", "chat.completion"]
    assert lines[2]["error"]["message"].endswith("prompt is empty")


# ---- 4. chat templates ----

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if think is defined and not think %}[no think]{% endif %}"
            "{% endif %}")


def test_chat_template_file_and_options(tiny_model_dir, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    hi = [{"role": "user", "content": "hi"}]
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "job-kwargs", "messages": hi},
        {"id": "row-kwargs", "messages": hi, "chat_template_kwargs": {"think": True}},
        {"id": "continue", "messages": hi + [{"role": "assistant", "content": "Sure"}],
         "add_generation_prompt": False, "continue_final_message": True},
        {"id": "both", "messages": hi, "continue_final_message": True},
        {"id": "prompt", "prompt": "x", "chat_template_kwargs": {"think": True}},
    ])
    ok_run(tiny_model_dir, src, tmp_path / "o.parquet", "--chat-template", template, "--chat-template-kwargs",
           '{"think": false}', "--max-tokens", "2")
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "o.parquet").to_pylist()}
    assert rows["job-kwargs"]["prompt"] == "<user>hi</user><assistant>[no think]"
    assert rows["row-kwargs"]["prompt"] == "<user>hi</user><assistant>"  # the row's own key wins
    assert rows["continue"]["prompt"] == "<user>hi</user><assistant>Sure"
    assert "needs add_generation_prompt false" in rows["both"]["error"]
    assert "applies to a chat" in rows["prompt"]["error"]
    assert [rows[i]["chat"] for i in ("job-kwargs", "continue", "prompt")] == [True, True, None]

    job = tmp_path / "jobs" / "j.toml"  # a job file's template path is relative to the file
    job.parent.mkdir()
    job.write_text(f'model = "{tiny_model_dir}"\ninput = "../in.jsonl"\noutput = "../j.parquet"\nbackend = "numpy"\n'
                   'chat_template = "../t.jinja"\nchat_template_kwargs = \'{"think": false}\'\nquiet = true\n'
                   '[sampling]\nmax_tokens = 2\n')
    assert CliRunner().invoke(main, ["job", str(job)]).exit_code == 0
    assert pq.read_table(tmp_path / "j.parquet").column("prompt").to_pylist() == [
        rows[i]["prompt"] for i in rows]


@pytest.mark.parametrize("args,message", [
    (["--chat-template", "{tmp}/missing.jinja"], "cannot read chat template"),
    (["--chat-template", "{tmp}/bad.jinja"], "is not a valid template: line 1"),
    (["--chat-template-kwargs", "[1]"], "invalid chat_template_kwargs: must be a JSON object"),
])
def test_bad_chat_template_settings_are_job_errors(tiny_model_dir, tmp_path, args, message):
    (tmp_path / "bad.jinja").write_text("{% for %}")
    args = [a.format(tmp=tmp_path) for a in args]
    result = run(tiny_model_dir, EXAMPLES / "chat.jsonl", tmp_path / "o.parquet", *args)
    assert message in one_line_error(result, exit_code=2)  # a bad setting, as a bad flag


def test_llm_chat_options(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="numpy")
    params = SamplingParams(max_tokens=2, temperature=0)
    hi = [{"role": "user", "content": "hi"}]
    out = llm.chat(hi, params, chat_template=TEMPLATE, chat_template_kwargs={"think": False})
    assert out[0].prompt == "<user>hi</user><assistant>[no think]"
    out = llm.chat(hi + [{"role": "assistant", "content": "Sure"}], params, chat_template=TEMPLATE,
                   add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt == "<user>hi</user><assistant>Sure"
    with pytest.raises(ValueError, match="needs add_generation_prompt false"):
        llm.chat(hi, params, continue_final_message=True)


def test_example_eval_rows(tiny_model_dir, tmp_path):
    src = EXAMPLES / "eval_rows.jsonl"
    ok_run(tiny_model_dir, src, tmp_path / "eval.parquet")
    rows = pq.read_table(tmp_path / "eval.parquet").to_pylist()
    want = [json.loads(line) for line in src.read_text().splitlines()]
    assert all(r["error"] is None for r in rows)
    assert [(r["answer"], r["subject"]) for r in rows] == [(w["answer"], w["subject"]) for w in want]
    by_id = {r["id"]: r for r in rows}
    assert len(by_id["pass-at-4"]["completions"]) == 4 and by_id["arith-2"]["top_logprobs"] is not None
    assert by_id["loglikelihood"]["prompt_logprobs"][0] is None and by_id["capital"]["chat"] is True


def test_ray_job_carries_columns_and_request_fields(tiny_model_dir, tmp_path):
    """Carried columns (typed), per-row chat options and n > 1 survive staging to Ray replicas: the output equals a
    single-process run."""
    ray = pytest.importorskip("ray")
    from tinyvllm.config import EngineConfig
    from tinyvllm.jobs.config import JobConfig, RayConfig
    from tinyvllm.jobs.ray_executor import RayExecutor
    from tinyvllm.jobs.run import run_job

    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "prompt": ["one", None, "three"],
        "messages": [None, [{"role": "user", "content": "hi"}], None],
        "chat_template_kwargs": [None, {"think": False}, None],
        "n": [1, 1, 3],
        "gold": pa.array([decimal.Decimal("1.5"), None, decimal.Decimal("2.0")], pa.decimal128(4, 1)),
        "day": pa.array([datetime.date(2021, 5, 6)] * 3),
        "meta": pa.array([{"k": 1}, {"k": 2}, None]),
    }), src)
    (tmp_path / "t.jinja").write_text(TEMPLATE)

    def job(out: Path) -> JobConfig:
        return JobConfig(input=src, output=out, model=tiny_model_dir, engine=EngineConfig(backend="numpy"),
                         sampling={"max_tokens": 3, "temperature": 0.8}, chat_template=str(tmp_path / "t.jinja"),
                         quiet=True)

    run_job(job(tmp_path / "local.parquet"))
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(num_cpus=2, object_store_memory=256 << 20, include_dashboard=False, logging_level="warning")
    try:
        run_job(job(tmp_path / "ray.parquet"), RayExecutor(RayConfig(num_replicas=1, batch_size=2)))
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)  # ray.init installed its own
    local, remote = pq.read_table(tmp_path / "local.parquet"), pq.read_table(tmp_path / "ray.parquet")
    assert remote.schema.remove_metadata() == local.schema.remove_metadata()
    columns = ["prompt", "completion", "completions", "chat", "gold", "day", "meta"]
    assert remote.select(columns).to_pylist() == local.select(columns).to_pylist()
    assert local.column("prompt")[1].as_py() == "<user>hi</user><assistant>[no think]"
    assert len(local.column("completions")[2].as_py()) == 3


def test_a_row_truncates_its_prompt(tiny_model_dir, tmp_path):
    """truncate_prompt_tokens, a row's field or the job's default: the output counts the prompt tokens kept."""
    long = "one two three four five six seven eight nine ten " * 40
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "cut", "prompt": long, "truncate_prompt_tokens": 6},
                                              {"id": "fit", "prompt": long * 20, "truncate_prompt_tokens": -1},
                                              {"id": "whole", "prompt": long},
                                              {"id": "bad", "prompt": long, "truncate_prompt_tokens": 0}])
    ok_run(tiny_model_dir, src, tmp_path / "o.parquet", "--max-tokens", "3", "--max-model-len", "256")
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "o.parquet").to_pylist()}
    assert rows["cut"]["prompt_tokens"] == 6 and rows["cut"]["error"] is None
    assert rows["fit"]["prompt_tokens"] == 256 - 3 and rows["fit"]["completion_tokens"] == 3
    assert rows["whole"]["prompt_tokens"] > 6 and rows["whole"]["prompt"] == rows["cut"]["prompt"] == long
    assert "truncate_prompt_tokens=0" in rows["bad"]["error"]
