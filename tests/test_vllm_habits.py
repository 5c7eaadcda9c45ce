"""What scripts written for vLLM do with its Python API, and get here: Logprob objects, the HF tokenizer's methods,
llm_engine.get_tokenizer(), max_logprobs, a GGUF file as the tokenizer; `tinyvllm report` on a .jsonl output."""

import json

import pytest
from click.testing import CliRunner
from test_cli import EXAMPLES, ok_run, run
from test_gguf import write_gguf
from test_validation import write_jsonl

from tinyvllm import LLM, Logprob, SamplingParams
from tinyvllm.cli import main
from tinyvllm.config import SettingError
from tinyvllm.io import output_record
from tinyvllm.model.dummy import random_weights, tiny_config
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, backend="numpy")


def engine_output(llm, prompt, params):
    """The engine's own output for one request: its logprobs as plain floats."""
    llm.llm_engine.add_request("raw", prompt, params)
    outputs = []
    while llm.llm_engine.has_unfinished_requests():
        outputs += llm.llm_engine.step()
    return outputs[0]


def test_logprobs_are_vllm_logprob_objects(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, logprobs=3, prompt_logprobs=2)
    out = llm.generate("Once upon a time", params)[0]
    raw = engine_output(llm, "Once upon a time", params)
    completion, tok = out.outputs[0], llm.get_tokenizer()
    assert completion.token_ids == raw.outputs[0].token_ids and len(completion.logprobs) == 6
    for token, entry, floats in zip(completion.token_ids, completion.logprobs, raw.outputs[0].logprobs):
        assert all(isinstance(v, Logprob) for v in entry.values())
        assert {t: v.logprob for t, v in entry.items()} == floats
        tops = sorted((t for t in entry if t != token or len(entry) == 3), key=lambda t: -entry[t].logprob)
        assert [entry[t].rank for t in tops] == [1, 2, 3]  # 1-based, most likely first
        if len(entry) == 4:  # the sampled token outside the top 3: its rank is not computed
            assert entry[token].rank is None and entry[token].logprob <= entry[tops[-1]].logprob
        assert all(v.decoded_token == tok.decode([t]) for t, v in entry.items())
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                              zip(completion.token_ids, completion.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry, floats in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], raw.prompt_logprobs[1:]):
        assert {t: v.logprob for t, v in entry.items()} == floats and token in entry
        assert sorted(v.rank for v in entry.values() if v.rank is not None) == [1, 2]


def test_logprob_text_follows_detokenize(llm):
    out = llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0, logprobs=1, detokenize=False))[0]
    entries = out.outputs[0].logprobs
    assert all(v.decoded_token is None and v.rank == 1 for e in entries for v in e.values() if v.rank is not None)
    assert out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].rank == 1  # greedy: the most likely


def test_output_record_reads_logprob_objects_and_floats_alike():
    def output(values):
        completion = CompletionOutput(0, "ab", [5, 6], -3.0, [{5: values[0], 7: values[1]}, {6: values[2]}], "length")
        return RequestOutput("0", "p", [1, 2], [completion], True, RequestMetrics(0.0),
                             prompt_logprobs=[None, {2: values[3], 9: values[4]}])

    floats = [-1.0, -0.5, -2.0, -0.25, -3.0]
    objects = [Logprob(v, rank=1) for v in floats]
    a, b = (output_record(0, "0", "p", output(v)) for v in (floats, objects))
    for name in ("logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs"):
        assert a[name] == b[name], name
    assert b["logprobs"] == [-1.0, -2.0] and b["top_logprobs"][0] == [{"token_id": 7, "logprob": -0.5},
                                                                        {"token_id": 5, "logprob": -1.0}]
    assert b["prompt_logprobs"] == [None, -0.25]


def test_tokenizer_methods_as_hf(tiny_model_dir, llm):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok = llm.get_tokenizer()
    assert llm.llm_engine.get_tokenizer() is tok
    assert len(tok) == len(hf) == 512
    eos = tok.eos_token_id
    assert tok.decode([eos]) == hf.decode([eos]) == "<|im_end|>"  # HF keeps special tokens by default
    assert tok.decode([eos], skip_special_tokens=True) == hf.decode([eos], skip_special_tokens=True) == ""
    batch = [hf.encode("Hello there") + [eos], hf.encode("émoji 🙂"), [1, 300, 2]]
    for skip in (False, True):
        assert tok.batch_decode(batch, skip_special_tokens=skip) == hf.batch_decode(batch, skip_special_tokens=skip)
        assert tok.convert_ids_to_tokens(batch[2], skip_special_tokens=skip) == \
            hf.convert_ids_to_tokens(batch[2], skip_special_tokens=skip)
    assert tok.batch_decode(batch) == hf.batch_decode(batch)
    assert tok.convert_ids_to_tokens(300) == hf.convert_ids_to_tokens(300)
    tokens = hf.convert_ids_to_tokens(batch[0]) + ["surely-not-a-token"]
    assert tok.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert tok.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>") == eos


def test_max_logprobs_caps_what_a_request_asks(tiny_model_dir):
    llm = LLM(tiny_model_dir, backend="numpy", max_logprobs=2)
    assert llm.engine_config.max_logprobs == 2
    assert len(llm.generate("x", SamplingParams(max_tokens=1, logprobs=2))[0].outputs[0].logprobs[0]) >= 2
    for asked in ({"logprobs": 3}, {"prompt_logprobs": 3}):
        with pytest.raises(ValueError, match="3 logprobs asked; max_logprobs is 2"):
            llm.generate("x", SamplingParams(max_tokens=1, **asked))
    unlimited = LLM(tiny_model_dir, backend="numpy", max_logprobs=-1)
    assert len(unlimited.generate("x", SamplingParams(max_tokens=1, logprobs=40))[0].outputs[0].logprobs[0]) >= 40
    with pytest.raises(SettingError, match="invalid max_logprobs=-2"):
        LLM(tiny_model_dir, backend="numpy", max_logprobs=-2)


def test_max_logprobs_flag_makes_an_error_row(tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "logprobs": 3}, {"prompt": "y", "logprobs": 1}])
    rows = ok_run(tiny_model_dir, src, tmp_path / "o.parquet", "--max-logprobs", "2", "--max-tokens", "1").to_pylist()
    assert rows[0]["error"] == "3 logprobs asked; max_logprobs is 2" and rows[1]["error"] is None


def test_a_gguf_file_as_the_tokenizer(tiny_model_dir, tmp_path):
    config = tiny_config()
    gguf = write_gguf(tmp_path / "m.gguf", config, random_weights(config))
    own, from_gguf = LLM(tiny_model_dir, backend="numpy"), LLM(tiny_model_dir, tokenizer=gguf, backend="numpy")
    text = "Hello there, émoji 🙂"
    assert from_gguf.get_tokenizer().encode(text) == own.get_tokenizer().encode(text)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    assert from_gguf.generate(text, greedy)[0].outputs[0].text == own.generate(text, greedy)[0].outputs[0].text


def test_report_reads_the_jsonl_output(tiny_model_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    result = run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["rows"] == 16 and summary == json.loads((tmp_path / "r.summary.json").read_text())
    assert (tmp_path / "r.latency.png").stat().st_size > 0 and (tmp_path / "r.tokens.png").stat().st_size > 0


@pytest.mark.parametrize("content", ['{"prompt": "not an output"}\n', "not json\n", "\xff\n"])
def test_report_refuses_a_jsonl_that_is_no_tinyvllm_output(tmp_path, content):
    path = tmp_path / "x.jsonl"
    path.write_text(content, encoding="latin-1")
    result = CliRunner().invoke(main, ["report", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [f"Error: {path} is not a tinyvllm output (its first line is not "
                                                  "an OpenAI batch output line)"]


def test_report_names_the_missing_summary_of_a_jsonl_output(tiny_model_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    assert run(tiny_model_dir, EXAMPLES / "prompts.jsonl", out, "--max-tokens", "2").exit_code == 0
    (tmp_path / "r.summary.json").unlink()
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert f"has no summary file {tmp_path / 'r.summary.json'}" in result.stderr
