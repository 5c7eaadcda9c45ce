"""A job's own mistakes are answered before it starts: a bad job-wide constraint, a bad flag value (every declared
check), a chat template or JSON schema file that cannot be used, a bad job-file key are one line, exit 2, and nothing
is created. The final line says what the errors were and, after a resume, what its seconds are."""

import json
import re
import sys
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from helpers import Crash, ok_run, one_line_error, run, write_jsonl

from tinyvllm.cli import _shorten, main
from tinyvllm.config import EngineConfig, Setting, settings
from tinyvllm.io.writer import parts_dir, summary_path
from tinyvllm.jobs import run as job_run
from tinyvllm.jobs.config import JobConfig, RayConfig
from tinyvllm.sampling_params import SamplingParams


def nothing_created(tmp_path) -> None:
    assert not (tmp_path / "new").exists(), list((tmp_path / "new").rglob("*"))


def refused(model, tmp_path, *args, message: str, rows=({"prompt": "x"},)) -> str:
    """`tinyvllm run` with args: one line containing message, exit 2, no output folder made. Returns the line."""
    src = write_jsonl(tmp_path / "in.jsonl", list(rows))
    line = one_line_error(run(model, src, tmp_path / "new" / "o.parquet", *args), message, exit_code=2)
    nothing_created(tmp_path)
    return line


# ---- a job-wide constraint is compiled before the job starts ---------------------------------------------------------

BAD_CONSTRAINTS = [
    (["--regex", "("], "invalid structured_outputs.regex: "),
    (["--json-schema", "{tmp}/objekt.json"], "invalid structured_outputs.json: Invalid type: objekt"),
    (["--structured-outputs", '{"grammar": "start: foo"}'], "invalid structured_outputs.grammar: "),
]


@pytest.mark.parametrize("args,message", BAD_CONSTRAINTS, ids=["regex", "json-schema", "grammar"])
def test_a_bad_job_wide_constraint_is_one_line_before_anything_runs(tiny_model_dir, tmp_path, args, message):
    pytest.importorskip("llguidance")
    (tmp_path / "objekt.json").write_text('{"type": "objekt"}')
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = refused(tiny_model_dir, tmp_path, *args, message=f"bad sampling defaults: {message}")
    assert "unclosed group" in line or "regex" not in message  # llguidance's reason, without its source excerpt


@pytest.mark.parametrize("table", ['regex = "("', 'json = { type = "objekt" }'])
def test_a_bad_job_file_constraint_is_one_line_before_anything_runs(tiny_model_dir, tmp_path, table):
    pytest.importorskip("llguidance")
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    job = tmp_path / "job.toml"
    job.write_text(f'input = "{src}"\noutput = "new/o.parquet"\nmodel = "{tiny_model_dir}"\nbackend = "numpy"\n'
                   f"[sampling.structured_outputs]\n{table}\n")
    result = CliRunner().invoke(main, ["job", str(job)])
    one_line_error(result, "bad sampling defaults: invalid structured_outputs.", exit_code=2)
    nothing_created(tmp_path)


def test_a_job_wide_choice_without_llguidance_is_one_line(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    refused(tiny_model_dir, tmp_path, "--choice", "yes,no", message="need llguidance: pip install")


def test_a_fixed_constraint_then_runs_and_a_rows_bad_one_stays_an_error_row(tiny_model_dir, tmp_path):
    pytest.importorskip("llguidance")
    rows = [{"prompt": "a", "structured_outputs": {"regex": "("}}, {"prompt": "b"}]
    refused(tiny_model_dir, tmp_path, "--regex", "(", message="invalid structured_outputs.regex", rows=rows)
    out = ok_run(tiny_model_dir, tmp_path / "in.jsonl", tmp_path / "new" / "o.parquet", "--choice", "yes,no",
                 "--max-tokens", "4").to_pylist()
    assert out[0]["finish_reason"] == "error" and "invalid structured_outputs.regex" in out[0]["error"]
    assert "\n" not in out[0]["error"] and out[1]["completion"] in ("yes", "no")


# ---- every flag with a bad value: exit 2, one line ----------------------------------------------------------------

def bad_values(s: Setting) -> list[str]:
    """Values the setting's declaration refuses, as a flag gives them: out of its bounds or choices, a blank item."""
    meta = s.meta
    if s.kind is None:  # structured_outputs
        return ["{}"]
    if s.container is dict:
        return [json.dumps({"1": meta["high"] * 2})]
    if meta["choices"]:
        return ["nope"]
    values = []
    if s.kind in (int, float):
        if meta["low"] is not None:
            values.append(meta["low"] - 2)  # -2: top_k's -1 means "all tokens"
        if meta["high"] is not None:
            values.append(meta["high"] + 1 if s.kind is int else meta["high"] * 2)
    elif s.kind is str and s.container is list:
        values.append("")
    return [str(v) for v in values]


def flag(s: Setting) -> str:
    return s.meta["flag"] or "--" + s.name.replace("_", "-")


def flag_cases(cls, message) -> list:
    return [pytest.param(flag(s), value, message(s), id=f"{s.name}={value}")
            for s in settings(cls) if s.meta["flag"] is not False for value in bad_values(s)]


SAMPLING_CASES = flag_cases(SamplingParams, lambda s: "bad sampling defaults: " + (
    "structured_outputs needs exactly one" if s.kind is None else f"invalid {s.name}="))
OTHER_CASES = [case for cls in (EngineConfig, JobConfig, RayConfig)
               for case in flag_cases(cls, lambda s: f"Error: Invalid value for '{flag(s)}'")]


def test_the_cases_cover_the_declared_checks():
    assert {c.values[0] for c in SAMPLING_CASES} >= {"--temperature", "--max-tokens", "--top-p", "--top-k", "--n",
                                                      "--stop", "--logit-bias", "--structured-outputs"}
    assert {c.values[0] for c in OTHER_CASES} >= {"--max-num-seqs", "--backend", "--seed", "--piece-rows",
                                                   "--num-replicas", "--gpu-memory-utilization"}


@pytest.mark.parametrize("flag,value,message", SAMPLING_CASES)
def test_a_bad_sampling_flag_exits_2(tiny_model_dir, tmp_path, flag, value, message):
    refused(tiny_model_dir, tmp_path, flag, value, message=message)


@pytest.mark.parametrize("flag,value,message", OTHER_CASES)
def test_a_bad_engine_or_job_flag_exits_2(tiny_model_dir, tmp_path, flag, value, message):
    line = refused(tiny_model_dir, tmp_path, flag, value, message=message)
    assert line.startswith(message) and line.endswith("(see main run --help)")


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "bad sampling defaults: invalid temperature=-1.0: must be >= 0.01 or 0"),
    (["--max-tokens", "0"], "bad sampling defaults: invalid max_tokens=0: must be >= 1"),
    (["--min-tokens", "5", "--max-tokens", "2"], "invalid min_tokens=5: must be <= max_tokens (2)"),
    (["--stop", "x", "--no-detokenize"], "invalid detokenize=False"),
    (["--chat-template", "{tmp}/missing.jinja"], "cannot read chat template {tmp}/missing.jinja: No such file"),
    (["--chat-template", "{tmp}/bad.jinja"], "is not a valid template"),
    (["--json-schema", "{tmp}/missing.json"], "cannot read --json-schema {tmp}/missing.json: No such file"),
    (["--json-schema", "{tmp}/bad.jinja"], "--json-schema {tmp}/bad.jinja is not JSON"),
    (["--keep-columns", ","], "invalid keep_columns=','"),
    (["--chat-template-kwargs", "[1]"], "invalid chat_template_kwargs: must be a JSON object"),
    (["--prompt-column", "q", "--messages-column", "q"], "are both 'q'"),
    (["--temprature", "0"], "No such option '--temprature'"),
    (["--regex", "a", "--choice", "a"], "give one of --regex, --choice"),
])
def test_bad_flags_and_the_files_they_name_exit_2(tiny_model_dir, tmp_path, args, message):
    (tmp_path / "bad.jinja").write_text("{% for %}")
    refused(tiny_model_dir, tmp_path, *(a.format(tmp=tmp_path) for a in args), message=message.format(tmp=tmp_path))


def test_a_setting_the_model_cannot_meet_exits_2(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    one_line_error(run(tiny_model_dir, src, tmp_path / "o.parquet", "--max-model-len", "100000"),
                   "invalid max_model_len=100000: the model supports up to", exit_code=2)


@pytest.mark.parametrize("text,message", [
    ("seed = -1\n", "invalid seed=-1: must be >= 0"),
    ("[sampling]\ntemperature = -1\n", "bad sampling defaults: invalid temperature=-1.0"),
    ("max_num_seq = 4\n", "unknown key 'max_num_seq' (did you mean max_num_seqs?)"),
    ("[sampling]\nstop = 5\n", "sampling.stop = 5 has the wrong type"),
])
def test_a_bad_job_file_key_exits_2(tiny_model_dir, tmp_path, text, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    job = tmp_path / "job.toml"
    job.write_text(f'input = "{src}"\noutput = "new/o.parquet"\nmodel = "{tiny_model_dir}"\nbackend = "numpy"\n'
                   + text)
    one_line_error(CliRunner().invoke(main, ["job", str(job)]), message, exit_code=2)
    nothing_created(tmp_path)
    one_line_error(CliRunner().invoke(main, ["job", str(tmp_path / "nope.toml")]), "job file not found", exit_code=2)


@pytest.mark.parametrize("text,meant", [
    ("Max-Num-Seqs = 4\n", "max_num_seqs"),  # case and separators
    ("[sampling]\nmaxTokens = 4\n", "sampling.max_tokens"),  # camelCase
    ("max_token = 4\n", "sampling.max_tokens"),  # a [sampling] key, misspelt, at the top level
    ("[sampling]\nmax_num_seqs = 4\n", "max_num_seqs"),  # a top-level key under [sampling]
])
def test_an_unknown_job_file_key_names_the_nearest_as_rows_and_flags_do(tmp_path, text, meant):
    job = tmp_path / "job.toml"
    job.write_text('input = "in.jsonl"\noutput = "o.parquet"\n' + text)
    line = one_line_error(CliRunner().invoke(main, ["job", str(job)]), exit_code=2)
    assert line.endswith(f"(did you mean {meant}?)")


# ---- the final line ---------------------------------------------------------------------------------------------

def final_lines(model, src, out, *args) -> list[str]:
    """`tinyvllm run` (not quiet), which must succeed: its last lines on stderr, after the progress bar."""
    result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(out),
                                       "--backend", "numpy", "--max-tokens", "2", *args])
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("wrote ")):]


def test_the_final_line_names_the_most_common_errors(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": ""}, "{malformed", {"prompt": "ok"}, {"prompt": ""}])
    wrote, errors = final_lines(tiny_model_dir, src, tmp_path / "o.parquet")
    assert wrote.startswith("wrote 4 rows (3 errors) to ") and "this run" not in wrote
    assert errors.startswith('3 error rows: 2 x "prompt is empty", 1 x "malformed JSON: '), errors
    assert errors.endswith('..."') and len(errors) < 120  # cut short, at a word


def test_the_final_line_names_three_messages_and_counts_the_rest(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": ""}, "{malformed", [1], {"prompt": "x", "best_of": 2},
                                              {"prompt": "x", "max_token": 2}, {"prompt": "x", "max_token": 2}])
    errors = final_lines(tiny_model_dir, src, tmp_path / "o.parquet")[-1]
    named = re.findall(r'(\d+) x "', errors)
    assert errors.startswith("6 error rows: 2 x \"unknown field 'max_token' (did you mean 'max_tokens'?)...\", ")
    assert named == ["2", "1", "1"] and errors.endswith(", 2 others"), errors  # 5 messages in 6 rows


def test_shorten_cuts_at_a_word_and_keeps_one_line():
    assert _shorten("short", 60) == "short"
    assert _shorten("a\n  b", 60) == "a b"
    long = "word " * 30
    assert _shorten(long, 60) == ("word " * 11).strip() + "..." and len(_shorten(long, 60)) <= 60
    assert _shorten("x" * 100, 60) == "x" * 57 + "..."


def test_after_a_resume_the_final_lines_say_what_its_seconds_and_errors_are(tiny_model_dir, tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}" if i % 5 else ""} for i in range(6)])
    out = tmp_path / "o.parquet"
    real_emit, emitted = job_run._JobRun.emit, []

    def emit_then_crash(self, record):
        real_emit(self, record)
        emitted.append(record)
        if len(emitted) == 3:
            raise Crash

    with monkeypatch.context() as m:  # a first run that started 5 s earlier than it did, killed after 3 rows
        m.setattr(job_run._JobRun, "emit", emit_then_crash)
        m.setattr(job_run, "time", SimpleNamespace(time=lambda: time.time() - 5))
        result = run(tiny_model_dir, src, out, "--max-tokens", "2", "--piece-rows", "1")
    assert isinstance(result.exception, Crash) and any(parts_dir(out).glob("piece-*.parquet"))
    wrote, errors = final_lines(tiny_model_dir, src, out, "--piece-rows", "1")
    assert errors == '2 error rows: 2 x "prompt is empty"'  # row 0's from the first run, row 5's from this one
    found = re.search(r" in (\d+\.\d)s \(this run; (\d+\.\d)s over 2 runs\), ", wrote)
    assert found, wrote
    this_run, total = map(float, found.groups())
    assert this_run < 5 <= total and total == round(json.loads(summary_path(out).read_text())["wall_time_s"], 1)
