"""A new user's mistakes, each answered with one line or an error row: eval on a CPU machine, a misspelt chat role,
a model that fails to load, over-long file names, a damaged tokenizer in the model folder; "1 row"."""

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cli import ok_run, run
from test_validation import write_jsonl

from tinyvllm import LLM, SamplingParams
from tinyvllm.backends import cuda_available
from tinyvllm.cli import main
from tinyvllm.tokenizer import Tokenizer

TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"


def one_line(result) -> str:
    """The one line a failed command printed on stderr (exit 1, as README's table has for a job that cannot go
    on)."""
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    return lines[0]


def model_copy(model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


# ---- tinyvllm eval: the device follows the backend's auto choice ---------------------------------------------------

@pytest.mark.skipif(cuda_available(), reason="checks a machine without a usable GPU")
def test_eval_without_device_runs_where_the_backend_can(tiny_model_dir, tmp_path):
    pytest.importorskip("lm_eval")
    result = CliRunner().invoke(main, ["eval", "--model_args", f"pretrained={tiny_model_dir}", "--tasks",
                                       "tinyvllm_mc", "--include_path", str(TASKS_DIR), "--output_path",
                                       str(tmp_path), "--limit", "2"])
    assert result.exit_code == 0, result.output
    written = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    assert written["results"]["tinyvllm_mc"]["sample_len"] == 2


@pytest.mark.skipif(cuda_available(), reason="checks a machine without a usable GPU")
def test_eval_on_cuda_without_a_gpu_is_one_line_naming_evals_options(tiny_model_dir):
    """One error line besides lm-eval's own progress log (its INFO lines, which it prints in a fresh process and
    not where another test set up logging first)."""
    pytest.importorskip("lm_eval")
    result = CliRunner().invoke(main, ["eval", "--model_args", f"pretrained={tiny_model_dir}", "--device", "cuda",
                                       "--tasks", "tinyvllm_mc", "--include_path", str(TASKS_DIR)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = [line for line in result.stderr.strip().splitlines()
             if not re.match(r"\d{4}-\d\d-\d\d:\d\d:\d\d:\d\d INFO ", line)]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert "the cuda backend needs pycuda" in line and "--device cpu" in line and "--backend" not in line


# ---- a chat role no template knows ---------------------------------------------------------------------------------

def test_a_misspelt_role_is_an_error_row(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "usr", "content": "hi"}]},
                                              {"messages": [{"role": "user", "content": "hi"}]}])
    rows = ok_run(tiny_model_dir, src, tmp_path / "o.parquet", "--max-tokens", "2").to_pylist()
    assert rows[0]["error"] == ("chat template failed: message 0 has role 'usr': the chat template knows "
                                "assistant, system, tool, user")
    assert rows[1]["error"] is None


def test_roles_a_template_names_are_known(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    template = ("{% for m in messages %}{% if m['role'] == 'ipython' %}[tool output]{% elif m.role in "
                "['model', 'developer'] %}[{{ m.role }}]{% endif %}{{ m['content'] }}{% endfor %}")
    text = tok.apply_chat_template([{"role": "ipython", "content": "4"}, {"role": "developer", "content": "x"}],
                                   chat_template=template)
    assert text == "[tool output]4[developer]x"
    with pytest.raises(ValueError, match="role 'usr': the chat template knows assistant, developer, ipython, "
                                         "model, system, tool, user"):
        tok.apply_chat_template([{"role": "usr", "content": "hi"}], chat_template=template)
    with pytest.raises(ValueError, match="message 1 has role 'asistant'"):
        LLM(tiny_model_dir, backend="numpy").chat([{"role": "user", "content": "a"},
                                                   {"role": "asistant", "content": "b"}], SamplingParams(max_tokens=1))


def test_openai_developer_messages_are_system_ones_where_the_template_has_none(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    template = "{% for m in messages %}[{{ m.role }}]{{ m['content'] }}{% endfor %}"
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, chat_template=template) == "[system]be brief[user]hi"
    assert messages[0]["role"] == "developer"  # the caller's messages are left as they were
    known = "{% for m in messages %}{% if m.role == 'developer' %}<dev>{% endif %}{{ m['content'] }}{% endfor %}"
    assert tok.apply_chat_template(messages, chat_template=known) == "<dev>be briefhi"


# ---- a model that fails to load; the final line --------------------------------------------------------------------

def test_a_model_load_error_prints_no_progress_bar(tiny_model_dir, tmp_path):
    model = model_copy(tiny_model_dir, tmp_path)
    (model / "model.safetensors").unlink()
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output",
                                       str(tmp_path / "o.parquet"), "--backend", "numpy"])
    assert one_line(result).startswith(f"Error: cannot load model {model}: no model.safetensors")


def test_the_final_line_says_1_row(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    args = ["run", "--model", str(tiny_model_dir), "--input", str(src), "--output", str(tmp_path / "o.parquet"),
            "--backend", "numpy", "--max-tokens", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "wrote 1 row (0 errors) to " in result.stderr, result.stderr
    again = CliRunner().invoke(main, args)
    assert "already complete: " in again.stderr and " has 1 row (0 errors); " in again.stderr


# ---- names over the file system's limit ----------------------------------------------------------------------------

def test_an_input_name_over_255_bytes_is_one_line(tiny_model_dir, tmp_path):
    long_name = tmp_path / ("a" * 300 + ".jsonl")
    line = one_line(run(tiny_model_dir, long_name, tmp_path / "o.parquet"))
    assert line == f"Error: cannot read input {long_name}: File name too long"
    inside = tmp_path / ("b" * 300) / "in.jsonl"
    assert one_line(run(tiny_model_dir, inside, tmp_path / "o.parquet")).endswith(": File name too long")


def test_an_output_name_over_255_bytes_is_one_line(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    assert "output name too long" in one_line(run(tiny_model_dir, src, tmp_path / ("o" * 300 + ".parquet")))


# ---- a damaged tokenizer in the model folder -----------------------------------------------------------------------

DAMAGED = [
    ("tokenizer.json", "{not json", "is not a readable tokenizer"),
    ("tokenizer.json", "{}", "is not a readable tokenizer"),
    ("tokenizer_config.json", "[1, 2]", "must hold a JSON object, not list"),
    ("tokenizer_config.json", "{\"chat_template\": [1]", "is not valid JSON"),
    ("tokenizer_config.json", json.dumps({"chat_template": [1]}), "chat_template must be a string or a list of"),
    ("tokenizer_config.json", json.dumps({"chat_template": [{"name": "default", "template": 3}]}),
     "the default chat_template's \"template\" must be a string"),
]


@pytest.mark.parametrize("name,content,reason", [*DAMAGED, ("chat_template.jinja", b"\xff{{ x }}", "is not UTF-8")])
def test_a_damaged_tokenizer_file_is_one_line_naming_it(tiny_model_dir, tmp_path, name, content, reason):
    model = model_copy(tiny_model_dir, tmp_path)
    if name == "chat_template.jinja":  # read when tokenizer_config.json has no template
        config = json.loads((model / "tokenizer_config.json").read_text())
        config.pop("chat_template")
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=str(model / name)):
        Tokenizer.from_dir(model)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    line = one_line(run(model, src, tmp_path / "o.parquet"))
    assert line.startswith(f"Error: cannot load model {model}: {model / name}") and reason in line, line
