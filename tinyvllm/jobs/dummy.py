"""Random-weight models of known shapes, which a job names as `--model dummy:PRESET` (no download): benchmarks run
the CLI on them (J1, tinyvllm/benchmark.py).

A job's dummy model gets a tokenizer for text (`text_tokenizer`): a byte-level BPE, as Llama 3's is, whose ids cover
the model's whole vocabulary, with Llama 3's special tokens at the top and its chat template. No Llama 3 tokenizer is
at hand (no hub), and a real tokenizer of another vocabulary would leave most generated ids without text. Its merges
are learnt from `english_text`, so common words are one token each, as in Llama 3; the ids beyond the learnt ones are
filler words of 2-7 letters that encode never produces but decode does, so a random model's output decodes to text of
about Llama 3's length per token and the job's detokenization and stop-string costs are those of real text.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tinyvllm.model.loader import LoadedModel
    from tinyvllm.tokenizer import Tokenizer

DUMMY_PREFIX = "dummy:"
# Llama 3's special tokens and their offsets above the regular vocabulary (128000 + offset in Llama 3).
SPECIAL_OFFSETS = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|start_header_id|>": 6, "<|end_header_id|>": 7,
                   "<|eom_id|>": 8, "<|eot_id|>": 9}
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
WORDS = """the of and to a in is that for it as was with be by on not he this are or his from at which but have an
they you were her she there one all we their been has would when more will who if no out so said what up its about
into than them can only other new some could time these two may then do first any my now such like our over man me
even most made after also did many before must through back years where much your way well down should because each
just those people how too little state good very make world still own see men work long get here between both life
being under never day same another know while last might us great old year off come since against go came right used
take three states himself few house use during without again place american around however home small found thought
went say part once general high upon school every does got united left number course war until always away something
fact though water less public put think almost hand enough far took head yet government system better set told
nothing night end why called didn't eyes find going look asked later knew point next program city business give group
toward young days let room president side social given present several order national possible rather second face
per among form important often things looking early white case john become large big need four within felt children
along saw best church ever least power development light thing seemed family interest want members mind country area
others done turned although open god service certain kind problem began different door thus help sense means whole
matter perhaps itself york it's times law human line above name example action company hands local show whether five
history gave today either act feet across taken past quite anything seen having death week experience body word half
really field am car words already themselves information tell college shall money period held keep sure probably free
seems political real behind cannot miss question air office making brought whose special major heard problems ago
became federal study available known result street economic boy position reason change south board individual job
society areas west close turn love community true court force full seem am market policy summary model answer data
""".split()


def is_dummy(model: object) -> bool:
    return str(model).startswith(DUMMY_PREFIX)


def dummy_model(preset: str, seed: int = 0, text: bool = False) -> LoadedModel:
    """A LoadedModel with random weights of a known model's shapes (no download). Its tokenizer: `text_tokenizer`
    (text=True: what a job uses), else a small stand-in of 1024 tokens (the token-id workloads W1-W6)."""
    from tinyvllm.model import dummy
    from tinyvllm.model.loader import LoadedModel
    from tinyvllm.tokenizer import Tokenizer

    if preset not in dummy.PRESETS:
        raise ValueError(f"unknown dummy model {preset!r}: choose from {', '.join(dummy.PRESETS)}")
    config = dummy.PRESETS[preset]()
    tokenizer = (text_tokenizer(config.vocab_size) if text
                 else Tokenizer(dummy.build_tokenizer(min(config.vocab_size, 1024)), eos_tokens=[]))
    # bf16 made when a backend asks for each tensor: no float32 copy of an 8B model
    return LoadedModel(config, dummy.RandomBf16Weights(config, seed), tokenizer, f"{DUMMY_PREFIX}{preset}")


def load_dummy(spec: str) -> LoadedModel:
    """The model a job names as `dummy:PRESET`; ValueError names the presets if there is no such one."""
    return dummy_model(spec[len(DUMMY_PREFIX):], text=True)


def english_text(rng: np.random.Generator, num_words: int) -> str:
    """Sentences of common English words (with commas and numbers), about num_words words long."""
    sentences, count = [], 0
    while count < num_words:
        length = int(rng.integers(6, 19))
        words = [str(w) for w in rng.choice(WORDS, length)]
        if rng.random() < 0.3:
            words[int(rng.integers(1, length))] = str(int(rng.integers(2, 2030)))
        if rng.random() < 0.4:
            words[int(rng.integers(1, length - 1))] += ","
        sentences.append(" ".join(words).capitalize() + str(rng.choice([".", ".", ".", "?", "!"])))
        count += length
    return " ".join(sentences)


def text_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly vocab_size ids: the 256 bytes, merges learnt from english_text, filler words up
    to the special tokens, which take the top ids (256 of them as in Llama 3, fewer in a small vocabulary)."""
    import tokenizers

    from tinyvllm.tokenizer import Tokenizer

    num_special = 256 if vocab_size >= 65536 else 16
    regular = vocab_size - num_special
    if regular < 256 + 16:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer with special tokens")
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=regular, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    learner = tokenizers.Tokenizer(tokenizers.models.BPE())
    learner.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.decoder = tokenizers.decoders.ByteLevel()
    rng = np.random.default_rng(1234)
    learner.train_from_iterator((english_text(rng, 200) for _ in range(200)), trainer=trainer)
    spec = json.loads(learner.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    while len(vocab) < regular:  # filler: decodes to text; never produced by encode (no merge makes it)
        need = regular - len(vocab)
        letters = rng.integers(ord("a"), ord("z") + 1, (need, 7), np.uint8).tobytes().decode()
        for i, (length, spaced) in enumerate(zip(rng.integers(2, 8, need), rng.random(need) < 0.7)):
            vocab.setdefault(("Ġ" if spaced else "") + letters[7 * i: 7 * i + length], len(vocab))
    names = {offset: name for name, offset in SPECIAL_OFFSETS.items()}
    specials = [names.get(i, f"<|reserved_special_token_{i}|>") for i in range(num_special)]
    spec["added_tokens"] = [{"id": regular + i, "content": name, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True} for i, name in enumerate(specials)]
    vocab.update({name: regular + i for i, name in enumerate(specials)})
    backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    return Tokenizer(backend, bos_token="<|begin_of_text|>", eos_tokens=["<|eot_id|>"], add_bos=True,
                     chat_template=LLAMA3_CHAT_TEMPLATE)

