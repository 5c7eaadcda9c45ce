"""Hostile input, one class at a time (issue 18): chat templates that hang or fill memory, absurd model files,
out-of-range numbers, settings errors, ids, and `report` on files tinyvllm did not write. Each gets an error row or one
clear line, never a traceback or a hang."""

import json
import shutil
import struct
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from click.testing import CliRunner
from helpers import ok_run, run, write_jsonl
from helpers import one_line_error as one_line_failure

from tinyvllm import tokenizer
from tinyvllm.cli import main
from tinyvllm.model.gguf import config_from_gguf


def model_copy(model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# ---- 6: chat templates are bounded in time and size ------------------------------------------------------------------

HOSTILE_TEMPLATES = {
    "nested-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "more than 1000000 loop steps"),
    "big-string": ("{{ 'a' * 400000000 }}", "would build a value of 400000000 characters"),
    "doubling": ("{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                 "{% endfor %}", "would build a value of"),
    "big-width": ("{{ 'a'|center(400000000) }}", "argument 400000000 is too large"),
    "big-format": ("{{ '%0400000000d' % 1 }}", "%-format width"),
    "big-power": ("{{ 2 ** 1000000000 }}", "would build a value of"),
    "big-output": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "would build a value of"),
    "empty-raise": ("{{ raise_exception('') }}", "TemplateError"),
}


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_chat_template_is_an_error_row(tiny_model_dir, tmp_path, name):
    template, reason = HOSTILE_TEMPLATES[name]
    model = model_copy(tiny_model_dir, tmp_path)
    edit_json(model / "tokenizer_config.json", chat_template=template)
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "plain"}])
    started = time.monotonic()
    rows = ok_run(model, src, tmp_path / "out.parquet", "--max-tokens", "2").to_pylist()
    assert time.monotonic() - started < 60
    assert rows[0]["finish_reason"] == "error" and reason in rows[0]["error"], rows[0]["error"]
    assert rows[0]["error"].startswith("chat template failed: ") and rows[0]["error"].count("chat template") == 1
    assert rows[1]["error"] is None  # the job went on


def test_chat_template_time_limit(monkeypatch):
    monkeypatch.setattr(tokenizer, "TEMPLATE_SECONDS", 0.05)
    tok = tokenizer.Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()),
                              chat_template="{% for i in range(100000) %}{% for j in range(9) %}{{ j }}{% endfor %}"
                                            "{% endfor %}")
    started = time.monotonic()
    with pytest.raises(ValueError, match="rendering took more than 0.05 s"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < 5
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"  # the budget starts afresh


# ---- 7 and 11: model files and configs are checked before anything is sized from them ------------------------------

def _safetensors_header_beyond_file(model: Path) -> None:
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")


def _index_outside_the_folder(model: Path) -> None:
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "/etc/passwd"}}))


def _offsets_beyond_data(model: Path) -> None:
    raw = (model / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["lm_head.weight"]["data_offsets"] = [0, 10**9]
    head = json.dumps(header).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


@pytest.mark.parametrize("change,message", [
    ({"num_hidden_layers": 10**9}, "invalid num_hidden_layers=1000000000 in the model config"),
    ({"num_attention_heads": 0}, "invalid num_attention_heads=0"),
    ({"hidden_size": "64"}, "invalid hidden_size='64'"),
    ({"max_position_embeddings": -1}, "invalid max_position_embeddings=-1"),
    ({"eos_token_id": 100000}, "eos_token_id 100000 in the model config: not a token id of the vocabulary"),
    ({"rope_theta": None}, "invalid rope_theta=None"),
    (_safetensors_header_beyond_file, "header length is missing or beyond the file"),
    (_index_outside_the_folder, "shard '/etc/passwd' is not a .safetensors file name"),
    (_offsets_beyond_data, "does not match its data_offsets [0, 1000000000]"),
])
def test_bad_model_is_one_line(tiny_model_dir, tmp_path, change, message):
    model = model_copy(tiny_model_dir, tmp_path)
    change(model) if callable(change) else edit_json(model / "config.json", **change)
    result = run(model, write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}]), tmp_path / "out.parquet")
    one_line_failure(result, message)
    assert "cannot load model" in result.stderr and not (tmp_path / "out.parquet").exists()


def test_bad_gguf_is_one_line(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)
    result = run(tmp_path / "m.gguf", write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}]), tmp_path / "o.parquet")
    one_line_failure(result, "is not a readable GGUF file: truncated or damaged")
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 10**9,
            "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "tokenizer.ggml.tokens": ["a"] * 8}
    with pytest.raises(ValueError, match="invalid num_hidden_layers=1000000000"):
        config_from_gguf(meta, {})
    with pytest.raises(ValueError, match="invalid num_attention_heads=0"):
        config_from_gguf({**meta, "llama.attention.head_count": 0}, {})


# ---- 8: every numeric field is range-checked at the row, before the engine ------------------------------------------

ROW_ERRORS = {
    "top-k-int32": ({"top_k": 2**31}, "invalid top_k=2147483648"),
    "max-tokens-int32": ({"max_tokens": 2**31}, "invalid max_tokens=2147483648"),
    "seed-negative": ({"seed": -1}, "invalid seed=-1"),
    "seed-65-bits": ({"seed": 2**64}, "invalid seed=18446744073709551616"),
    "temperature-tiny": ({"temperature": 1e-45}, "invalid temperature=1e-45"),
    "temperature-inf": ('{"prompt": "x", "temperature": 1e999}', "invalid temperature=inf"),
    "digits": ('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "an integer with more than 4300 digits"),
    "digits-in-id": ('{"id": ' + "1" * 5000 + ', "prompt": "x"}', "an integer with more than 4300 digits"),
}


def test_out_of_range_fields_are_error_rows(tiny_model_dir, tmp_path):
    rows = [change if isinstance(change, str) else {"prompt": "x", **change} for change, _ in ROW_ERRORS.values()]
    src = write_jsonl(tmp_path / "in.jsonl", [*rows, {"prompt": "fine", "seed": 2**64 - 1, "top_k": 2**31 - 1}])
    out = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", "--max-tokens", "2").to_pylist()
    for row, (name, (_, reason)) in zip(out, ROW_ERRORS.items()):
        assert row["finish_reason"] == "error" and reason in row["error"], (name, row["error"])
    assert out[-1]["error"] is None and out[-1]["completion_tokens"] >= 1


def test_parquet_int64_top_k_is_an_error_row(tiny_model_dir, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "top_k": pa.array([2**40, 5], pa.int64())}), src)
    rows = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", "--max-tokens", "2").to_pylist()
    assert "invalid top_k=1099511627776" in rows[0]["error"] and rows[1]["error"] is None


@pytest.mark.parametrize("flag,value,message", [
    ("--top-k", str(2**31), "invalid top_k=2147483648"),
    ("--max-tokens", str(2**31), "invalid max_tokens=2147483648"),
    ("--temperature", "inf", "invalid temperature=inf"),
    ("--temperature", "1e-30", "invalid temperature=1e-30"),
    ("--top-p", "0", "invalid top_p=0"),
    ("--min-p", "1.5", "invalid min_p=1.5"),
])
def test_sampling_flags_are_checked_like_rows(tiny_model_dir, tmp_path, flag, value, message):
    result = run(tiny_model_dir, write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}]), tmp_path / "o.parquet",
                 flag, value)
    one_line_failure(result, f"bad sampling defaults: {message}", exit_code=2)  # a bad flag


def test_logprobs_beyond_the_vocabulary_is_an_error_row(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    rows = ok_run(tiny_model_dir, src, tmp_path / "a.parquet", "--logprobs", "100000").to_pylist()
    assert rows[0]["error"] == "100000 logprobs asked; the vocabulary has 512 tokens"
    rows = ok_run(tiny_model_dir, src, tmp_path / "b.parquet", "--logprobs", "512", "--max-tokens", "1").to_pylist()
    assert rows[0]["error"] is None and len(rows[0]["top_logprobs"][0]) >= 512


# ---- 11: settings errors are named as settings, from flags and from job files ---------------------------------------

SETTINGS = [("seed", "-1", -1), ("backend", "tpu", '"tpu"'), ("num_kv_blocks", str(10**12), 10**12)]


@pytest.mark.parametrize("name,flag_value,toml_value", SETTINGS)
def test_settings_errors_are_not_model_errors(tiny_model_dir, tmp_path, name, flag_value, toml_value):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    flag = "--" + name.replace("_", "-")
    from_flag = run(tiny_model_dir, src, tmp_path / "o.parquet", flag, flag_value)
    assert from_flag.exit_code == 2  # a usage error: one Error line naming the flag
    assert from_flag.stderr.strip().splitlines()[-1].startswith(f"Error: Invalid value for '{flag}'")
    job = tmp_path / "job.toml"
    job.write_text(f'input = "{src}"\noutput = "{tmp_path / "o.parquet"}"\nmodel = "{tiny_model_dir}"\n'
                   f"{name} = {toml_value}\n")
    from_file = CliRunner().invoke(main, ["job", str(job), "--quiet"])
    one_line_failure(from_file, f"invalid {name}=", exit_code=2)  # a bad key, as a bad flag
    assert "cannot load model" not in from_flag.stderr + from_file.stderr


# ---- 12: ids given and row numbers are separate spaces --------------------------------------------------------------

def test_row_number_may_equal_an_earlier_id(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "1", "prompt": "a"}, {"prompt": "b"}, {"id": 1, "prompt": "c"},
                                              {"id": "x", "prompt": "d"}, {"id": "x", "prompt": "e"}])
    rows = ok_run(tiny_model_dir, src, tmp_path / "out.parquet", "--max-tokens", "2").to_pylist()
    assert [(r["row"], r["id"]) for r in rows] == [(0, "1"), (1, "1"), (2, "1"), (3, "x"), (4, "x")]
    assert [r["error"] is None for r in rows] == [True, True, False, True, False]
    assert "duplicate id '1'" in rows[2]["error"] and "duplicate id 'x'" in rows[4]["error"]


# ---- 10: `report` on a file tinyvllm did not write ------------------------------------------------------------------

def _damaged_pages(output: Path, tmp_path: Path) -> Path:
    data = bytearray(output.read_bytes())
    footer = struct.unpack("<I", data[-8:-4])[0]
    data[4:len(data) - 8 - footer] = b"\xff" * (len(data) - 12 - footer)  # every page, not the footer
    (tmp_path / "damaged.parquet").write_bytes(data)
    return tmp_path / "damaged.parquet"


def test_report_on_foreign_or_garbage_files(tiny_model_dir, tmp_path):
    (tmp_path / "garbage.parquet").write_bytes(b"\x00garbage" * 100)
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "foreign.parquet")
    pq.write_table(pa.table({"finish_reason": [1]}).replace_schema_metadata({"tinyvllm.counts": "{}"}),
                   tmp_path / "mistyped.parquet")
    output = tmp_path / "real.parquet"
    ok_run(tiny_model_dir, write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}]), output, "--max-tokens", "2")
    cases = {"garbage.parquet": "is not a Parquet file", "foreign.parquet": "no tinyvllm.counts metadata",
             "mistyped.parquet": "columns missing or mistyped: finish_reason",
             "in.jsonl": "is not a tinyvllm output (its first line is not an OpenAI batch output line)",
             _damaged_pages(output, tmp_path).name: "cannot read"}
    for name, message in cases.items():
        one_line_failure(CliRunner().invoke(main, ["report", str(tmp_path / name)]), message)
