import json
import shutil

import pytest
import tokenizers

from tinyvllm.model.dummy import CORPUS
from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer, decode_continuations

TEXTS = [
    "Hello, world! The quick brown fox.",
    "Emoji: 😀🚀 family 👨‍👩‍👧 thumbs 👍🏽 heart ❤️ flag 🇫🇷",
    "日本語のテキスト、中文文本和한국어 텍스트",
    "Accents: café, naïve, Ångström, façade, œuvre, Straße, ñandú",
    "  leading spaces, tabs\tand\nnew lines\n\n  ",
    "mixed 東京😀é 123 <tag> end",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def sentencepiece_like() -> Tokenizer:
    """Llama-2 style: Metaspace + byte fallback; its decoder drops the space a decode starts with."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse(),
        tokenizers.decoders.Strip(content=" ", left=1),
    ])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + bytes_,
                                             show_progress=False)
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return Tokenizer(backend, bos_token="<s>", eos_tokens=["</s>"], add_bos=True)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def _stream(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detok.add(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text)
    for prompt in ([], tok.encode("Prompt: say something. ")):
        pieces = _stream(tok, prompt, ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in p for p in pieces)
    # multi-byte characters split across byte tokens really occur here, so the holding back is exercised
    if any(ord(c) > 127 for c in text):
        assert "" in _stream(tok, [], ids)


def test_batched_encode_and_decode_equal_one_at_a_time(tok, llama3_style_dir):
    """The job's worker tokenizes in batches and the engine detokenizes the requests a step ends in one batch: the
    same ids and text as one at a time, BOS rules included. The text continues the prompt's last 5 tokens, as
    IncrementalDetokenizer's window does."""
    for t in (tok, Tokenizer.from_dir(llama3_style_dir), sentencepiece_like()):
        prompts = [(text, templated) for text in TEXTS for templated in (False, True)]
        if t.chat_template:
            prompts.append((t.apply_chat_template([{"role": "user", "content": TEXTS[1]}]), True))
        prompts += [("<|endoftext|>hi", False), ("<s>hi", False)]
        ids = t.encode_prompts(prompts)
        assert ids == [t.encode_prompt(text, templated) for text, templated in prompts]
        requests = [(ids[i], ids[i + 1][:40], skip) for i in range(0, len(ids) - 1, 2) for skip in (True, False)]
        texts = decode_continuations(t, requests)
        for (prompt, output, skip), text in zip(requests, texts):
            window = prompt[-5:]
            assert text == t.decode(window + output, skip)[len(t.decode(window, skip)):].rstrip("\ufffd")
    assert tok.encode_prompts([]) == [] and decode_continuations(tok, []) == []


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_keeps_sentencepiece_spaces(text):
    spm = sentencepiece_like()
    prompt = spm.encode("Once upon a time")
    ids = spm.encode(" " + text, add_special_tokens=False)
    skip = True  # the detokenizer's default, as SamplingParams'
    full = spm.decode(prompt + ids, skip)[len(spm.decode(prompt, skip)):]
    assert "".join(_stream(spm, prompt, ids)) == full
    assert full.startswith(" ")  # a lone decode of ids would lose this space


def test_incremental_skips_special_tokens(tok):
    ids = tok.encode("Hi there") + [tok.eos_token_ids[0]]
    assert "".join(_stream(tok, [], ids)) == "Hi there"


def test_special_tokens_are_single_ids(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.bos_token_id == 1 and 2 in ids and tok.eos_token_ids == [2]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi 😀<|im_end|>\n")


@pytest.mark.parametrize("messages", [
    [], "hello", [{"content": "no role"}], [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"],
])
def test_malformed_messages(tok, messages):
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages)


def test_template_features_and_errors(tok):
    t = Tokenizer(tok.backend, bos_token="<|im_start|>", eos_tokens=["<|im_end|>"], chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ bos_token }}[{{ strftime_now('%Y') | length }}]{{ messages | tojson }}{{ eos_token }}"
    ))
    out = t.apply_chat_template([{"role": "user", "content": "é"}])
    assert out == '<|im_start|>[4][{"role": "user", "content": "é"}]<|im_end|>'
    with pytest.raises(ValueError, match="first message must be from the user"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.fixture
def llama3_style_dir(tiny_model_dir, tmp_path):
    """A dir whose tokenizer.json post-processor adds BOS (like Llama 3) and whose template also writes it."""
    path = shutil.copytree(tiny_model_dir, tmp_path / "llama3_style")
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    backend.save(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg |= {"bos_token": "<|endoftext|>", "add_bos_token": True,
            "chat_template": "{{ bos_token }}" + cfg["chat_template"]}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_bos_not_doubled(llama3_style_dir):
    t = Tokenizer.from_dir(llama3_style_dir)
    assert t.bos_token_id == 0
    assert t.encode("hi")[:2] != [0, 0] and t.encode("hi")[0] == 0
    assert 0 not in t.encode("hi", add_special_tokens=False)
    templated = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert templated.startswith("<|endoftext|><|im_start|>")
    for text, is_templated in ((templated, True), ("hi", False), ("<|endoftext|>hi", False)):
        ids = t.encode_prompt(text, templated=is_templated)
        assert ids[0] == 0 and ids.count(0) == 1, (text, ids)


def test_add_bos_flag_without_post_processor(tok):
    with_bos = Tokenizer(tok.backend, bos_token="<|endoftext|>", add_bos=True)
    assert with_bos.encode("hi") == [0] + tok.encode("hi")
    assert with_bos.encode_prompt("<|endoftext|>hi", templated=False) == [0] + tok.encode("hi")
    assert with_bos.encode_prompt("hi", templated=True) == tok.encode("hi")
    assert Tokenizer(tok.backend, bos_token="<|endoftext|>").encode("hi") == tok.encode("hi")
