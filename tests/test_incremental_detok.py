"""The incremental detokenizer against the tokenizer's own decode: at every step its text so far is the full decode
of the prefix, less only a held-back tail that ends in U+FFFD (an incomplete character), and token for token it
gives what the window scheme, decoding with the tokenizer each time, gives. Byte-level BPE (the dummy tokenizer,
a Llama 3 style one, the real SmolLM2 GGUF one when fetched) and SentencePiece (tokenizers' Metaspace with byte
fallback, and one trained with sentencepiece, read from GGUF metadata)."""

import numpy as np
import pytest

from helpers import llm_for
from test_gguf import sentencepiece_model  # noqa: F401 (the fixture)
from test_tokenizer import TEXTS, sentencepiece_like
from tinyvllm import SamplingParams
from tinyvllm.jobs.dummy import dummy_model, text_tokenizer
from tinyvllm.tokenizer import IncrementalDetokenizer, _ByteDetokenizer, _WindowDetokenizer, detok_table


def _reference(tokenizer, prompt, skip):
    """The window scheme with a tokenizer decode for every token (no table)."""
    detok = _WindowDetokenizer(tokenizer, prompt, skip)
    detok._texts = None
    return detok


def _check_stream(tokenizer, prompt: list[int], out: list[int], skip: bool, full_decode: bool = True,
                  byte_level: bool = True) -> None:
    """Token for token as the reference; and (full_decode) the full decode of each prefix wherever it does not end
    in U+FFFD, or (byte_level) the full decode of each prefix less a held-back tail."""
    detok, reference = IncrementalDetokenizer(tokenizer, prompt, skip), _reference(tokenizer, prompt, skip)
    before = tokenizer.decode(prompt, skip)
    text = ""
    for j, token in enumerate(out, 1):
        delta = detok.add(token)
        assert delta == reference.add(token), (prompt, out[:j], skip)
        text += delta
        if not full_decode:
            continue
        full = tokenizer.decode(prompt + out[:j], skip)[len(before):]
        assert full.startswith(text) or not byte_level, (prompt, out[:j], skip, text, full)
        assert full == text or full.endswith("\ufffd"), (prompt, out[:j], skip, text, full)


def _random_streams(tokenizer, trials: int, seed: int = 0, length: int = 48):
    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab_size
    for trial in range(trials):
        high = vocab if trial % 3 else min(vocab, 400)  # the low ids: single bytes, specials, short merges
        prompt = rng.integers(0, high, int(rng.integers(1, 10))).tolist()
        yield prompt, rng.integers(0, high, length).tolist(), bool(trial % 2)


def _check_tokenizer(tokenizer, trials: int = 150, byte_level: bool = True) -> None:
    """Random streams and real text. SentencePiece's byte fallback decodes a run of byte pieces that is no UTF-8 as
    one U+FFFD each, so a window that starts inside such a run differs from the full decode, and a character held
    back shows as U+FFFDs of all the run's bytes: its random streams are checked against the reference alone."""
    for prompt, out, skip in _random_streams(tokenizer, trials):
        _check_stream(tokenizer, prompt, out, skip, full_decode=byte_level)
    for text in TEXTS:  # real text: characters split across byte tokens, spaces, several scripts
        ids = tokenizer.encode(text, add_special_tokens=False)
        for prompt in (tokenizer.encode("Once upon a time"), ids[:1], ids[:3]):
            for skip in (True, False):
                _check_stream(tokenizer, prompt, ids, skip, byte_level=byte_level)


def test_dummy_byte_level_tokenizer():
    tokenizer = dummy_model("tiny").tokenizer
    assert isinstance(IncrementalDetokenizer(tokenizer, [5]), _ByteDetokenizer)
    _check_tokenizer(tokenizer)


def test_llama3_style_byte_level_tokenizer():
    tokenizer = text_tokenizer(4096)  # Llama 3's special tokens at the top of the vocabulary
    assert isinstance(IncrementalDetokenizer(tokenizer, [5], False), _ByteDetokenizer)
    _check_tokenizer(tokenizer)


def test_smollm2_gguf_tokenizer(default_model_path):
    from tinyvllm.model.gguf import read_gguf, tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(read_gguf(default_model_path)[0])
    assert isinstance(IncrementalDetokenizer(tokenizer, [5]), _ByteDetokenizer)
    _check_tokenizer(tokenizer, trials=60)


def test_sentencepiece_tokenizers():
    tokenizer = sentencepiece_like()
    assert isinstance(IncrementalDetokenizer(tokenizer, [5]), _WindowDetokenizer)
    texts = detok_table(tokenizer, True).texts
    assert sum(t is not None for t in texts) > 100  # plain pieces come from the table, "▁" as a space
    assert any(t is not None and t.startswith(" ") for t in texts)
    _check_tokenizer(tokenizer, byte_level=False)


def test_sentencepiece_trained_gguf_tokenizer(sentencepiece_model):
    from tinyvllm.model.gguf import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(sentencepiece_model[1])
    assert detok_table(tokenizer, True) is not None
    _check_tokenizer(tokenizer, byte_level=False)


def test_a_table_that_does_not_round_trip_is_not_used():
    """A decoder the table cannot follow (here: WordPiece's, which joins pieces with spaces) keeps every token on
    the tokenizer's decode."""
    import tokenizers

    from tinyvllm.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(tokenizers.models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2, "c": 3}))
    backend.decoder = tokenizers.decoders.WordPiece()
    tokenizer = Tokenizer(backend)
    assert detok_table(tokenizer, True) is None
    assert isinstance(IncrementalDetokenizer(tokenizer, [1]), _WindowDetokenizer)
    _check_stream(tokenizer, [1], [3, 2, 1, 3], True)


PROMPTS = ["Emoji: 😀🚀 family, café 東京 and", "The quick brown fox", "日本語のテキスト", "a b c d e f g",
           "Accents: naïve Ångström", "  leading spaces\tand\nnew lines"]


@pytest.fixture(scope="module")
def text_llm():
    return llm_for(dummy_model("tiny", text=True))


def _free(llm, max_tokens=40):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [out.outputs[0] for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_spanning_tokens_and_characters(text_llm, include):
    """Stop strings cut from greedy outputs' texts (across token boundaries, at multi-byte characters, two per
    request) end the same batch there: the text up to the first stop string (with it, include_stop_str_in_output),
    its tokens a prefix. The rows decode together, each token's text added at once or later (when its bytes hold no
    stop string's last character)."""
    free = _free(text_llm)
    assert all(len(out.text) > 12 for out in free)
    for pick in (lambda n: 3, lambda n: n // 2, lambda n: n - 4):
        stops = [[out.text[pick(len(out.text)):pick(len(out.text)) + 3], "\x00never"] for out in free]
        params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stop,
                                 include_stop_str_in_output=include) for stop in stops]
        for out, ref, stop in zip(text_llm.generate(PROMPTS, params), free, stops):
            out = out.outputs[0]
            cut = ref.text.find(stop[0])
            assert out.finish_reason == "stop" and out.stop_reason == stop[0]
            assert out.text == ref.text[:cut + len(stop[0]) if include else cut]
            assert out.token_ids == ref.token_ids[:len(out.token_ids)]


@pytest.mark.parametrize("min_tokens", [0, 5])
def test_stop_strings_that_never_match_keep_the_whole_text(text_llm, min_tokens):
    """Rows whose stop strings never match end at their length limit with the text decoded at the end without
    stop strings (their text partly added after the token, when the row leaves)."""
    free = _free(text_llm, 60)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop=["\x00never", "zz\x01"],
                            min_tokens=min_tokens, logprobs=1)
    for out, ref in zip(text_llm.generate(PROMPTS, params), free):
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == ref.text and out.outputs[0].token_ids == ref.token_ids
        assert len(out.outputs[0].logprobs) == 60
