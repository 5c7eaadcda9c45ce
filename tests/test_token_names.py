"""How the OpenAI output names logprobs' tokens (TokenNames): each token's bytes are what it adds to the text, so a
completion's tokens joined are the tokenizer's decode of them, for byte-level BPE (random ids too: pieces of
characters) and SentencePiece (whose decode drops the space a text starts with); each name's text is its bytes
decoded. Then the job: names by text and bytes, or token_id:N with --return-tokens-as-token-ids."""

import json

import numpy as np
import pytest

from helpers import ok_result, write_jsonl
from test_gguf import sentencepiece_model  # noqa: F401 (the fixture)
from test_tokenizer import TEXTS, sentencepiece_like
from tinyvllm.jobs.dummy import dummy_model, text_tokenizer
from tinyvllm.tokenizer import TokenNames


def _joined(names: TokenNames, ids: list[int]) -> str:
    return b"".join(bytes(names(i)[1]) for i in ids).decode("utf-8", "replace")


def _check_names(tokenizer, random_ids: bool) -> None:
    names = TokenNames(tokenizer)
    for i in range(tokenizer.vocab_size):
        text, data = names(i)
        assert text == bytes(data).decode("utf-8", "replace")
    streams = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    if random_ids:
        rng = np.random.default_rng(0)
        streams += [rng.integers(0, tokenizer.vocab_size, 24).tolist() for _ in range(200)]
    for ids in streams:
        joined, decoded = _joined(names, ids), tokenizer.decode(ids)
        assert joined == decoded or joined == " " + decoded, (ids, joined, decoded)


@pytest.mark.parametrize("make", [lambda: dummy_model("tiny").tokenizer, lambda: text_tokenizer(4096)],
                         ids=["dummy", "llama3-style"])
def test_byte_level_tokens_are_their_bytes(make):
    _check_names(make(), random_ids=True)


def test_smollm2_gguf_tokens(default_model_path):
    from tinyvllm.model.gguf import read_gguf, tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(read_gguf(default_model_path)[0])
    names = TokenNames(tokenizer)
    ids = tokenizer.encode("Hello world: café 東京 😀", add_special_tokens=False)
    assert _joined(names, ids) == "Hello world: café 東京 😀"
    assert names(tokenizer.encode(" world", add_special_tokens=False)[0]) == (" world", list(b" world"))
    _check_names(tokenizer, random_ids=True)


def test_sentencepiece_tokens_keep_their_space():
    tokenizer = sentencepiece_like()
    names = TokenNames(tokenizer)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert _joined(names, ids) == " hello world"  # the decode strips the first space; the tokens hold it
    assert any(names(i)[0].startswith(" ") for i in ids[1:])
    byte = tokenizer.convert_tokens_to_ids("<0xE2>")
    assert names(byte) == ("\ufffd", [0xE2])  # a byte-fallback token: its byte
    _check_names(tokenizer, random_ids=False)


def test_sentencepiece_trained_gguf_tokens(sentencepiece_model):
    from tinyvllm.model.gguf import tokenizer_from_gguf

    _check_names(tokenizer_from_gguf(sentencepiece_model[1]), random_ids=False)


def test_openai_output_names_tokens_by_text_or_id(tiny_model_dir, tmp_path):
    from test_request_surface import openai

    rows = [openai("/v1/chat/completions", "chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                   logprobs=True, top_logprobs=2, temperature=0, ignore_eos=True),
            openai("/v1/chat/completions", "plain", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                   logprobs=True),
            openai("/v1/completions", "text", prompt="one two", max_tokens=4, logprobs=2, temperature=0,
                   ignore_eos=True)]
    src, out = write_jsonl(tmp_path / "batch.jsonl", rows), tmp_path / "results.jsonl"
    ok_result(tiny_model_dir, src, out)
    by_id = {line["custom_id"]: line["response"]["body"] for line in map(json.loads, out.read_text().splitlines())}
    chat = by_id["chat"]["choices"][0]
    content = chat["logprobs"]["content"]
    assert len(content) == 4 and all(isinstance(c["bytes"], list) for c in content)
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8", "replace") == chat["message"]["content"]
    assert all(e["token"] == bytes(e["bytes"]).decode("utf-8", "replace") for c in content for e in c["top_logprobs"])
    # OpenAI's top_logprobs: exactly the top 2, in rank order (greedy: the sampled token first)
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"]
               and c["top_logprobs"][0]["token"] == c["token"] for c in content)
    plain = by_id["plain"]["choices"][0]["logprobs"]["content"]
    assert plain and all(c["top_logprobs"] == [] for c in plain)  # logprobs: true without top_logprobs
    text = by_id["text"]["choices"][0]
    assert "".join(text["logprobs"]["tokens"]) == text["text"]
    assert all(set(top) for top in text["logprobs"]["top_logprobs"])

    ok_result(tiny_model_dir, src, out, "--return-tokens-as-token-ids", "--overwrite")
    by_id = {line["custom_id"]: line["response"]["body"] for line in map(json.loads, out.read_text().splitlines())}
    chat = by_id["chat"]["choices"][0]
    ids = chat["token_ids"]
    assert [c["token"] for c in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]
    assert all(c["bytes"] is None for c in chat["logprobs"]["content"])
    assert by_id["text"]["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}"
                                                                  for t in by_id["text"]["choices"][0]["token_ids"]]


def test_return_tokens_as_token_ids_is_a_bool(tmp_path):
    from tinyvllm.errors import JobUsageError
    from tinyvllm.jobs.file import load_job_file

    job = tmp_path / "job.toml"
    job.write_text('input = "in.jsonl"\noutput = "out.jsonl"\nreturn_tokens_as_token_ids = "yes"\n')
    with pytest.raises(JobUsageError, match="return_tokens_as_token_ids = 'yes' has the wrong type"):
        load_job_file(job, {}, {})
