"""Tokenizer: a `tokenizers.Tokenizer` plus BOS policy, chat template and incremental detokenization.

It also offers the subset of an HF tokenizer that evaluation tools call (lm-eval, scripts written for vLLM's
`llm.get_tokenizer()`): `bos_token_id`, `eos_token_id`, `pad_token_id`, `tokenizer(texts).input_ids`, `len()`,
`encode`, `decode` of one id or a list and `batch_decode` (special tokens kept unless skip_special_tokens=True, as
HF), `convert_ids_to_tokens`, `convert_tokens_to_ids`,
`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`.
"""

from __future__ import annotations

import codecs
import functools
import json
import numbers
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import numpy as np
import tokenizers
from jinja2 import nodes
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

# Bounds on one chat-template rendering: the sandbox stops code execution, these stop a template from hanging the job
# or filling memory (nested loops, 'a' * 400000000). Real templates stay far below all three.
TEMPLATE_SECONDS = 5.0
TEMPLATE_MAX_CHARS = 1 << 22  # any string or list the template builds, and its output
TEMPLATE_MAX_LOOP_STEPS = 1_000_000  # loop iterations in all
FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\*|\d{7,}|\.\*|\.\d{7,})")  # '%0400000000d' % 1 is 400 MB


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: list[str] | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        unk_token: str | None = None,
    ) -> None:
        self.backend = backend
        self.unk_token = unk_token
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids = [i for i in map(backend.token_to_id, eos_tokens or []) if i is not None]
        # add_bos: prepend BOS on encode unless the backend's post-processor already did (Llama 3's does).
        self.add_bos = add_bos and self.bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._detok_tables: dict[bool, DetokTable | None] = {}  # per skip_special_tokens, built when first asked

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer of an HF folder (tokenizer.json, tokenizer_config.json, chat_template.jinja); ValueError
        naming the file when one is damaged."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        cfg_file = path / "tokenizer_config.json"
        cfg = _read_json_object(cfg_file) if cfg_file.is_file() else {}
        template = _named_template(cfg.get("chat_template"), cfg_file)
        jinja_file = path / "chat_template.jinja"  # transformers>=4.43 may save it on its own
        if template is None and jinja_file.is_file():
            try:
                template = jinja_file.read_text()
            except UnicodeDecodeError:
                raise ValueError(f"{jinja_file} is not UTF-8 text") from None
        eos = _token_content(cfg.get("eos_token"))
        return cls(
            _read_backend(tok_file),
            bos_token=_token_content(cfg.get("bos_token")),
            eos_tokens=[eos] if eos else [],
            add_bos=bool(cfg.get("add_bos_token", False)),
            chat_template=template,
            unk_token=_token_content(cfg.get("unk_token")),
        )

    def __len__(self) -> int:
        """The vocabulary's size, added tokens included (HF's len(tokenizer))."""
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._with_bos(self.backend.encode(text, add_special_tokens=add_special_tokens).ids, add_special_tokens)

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        """The text of one id or a list; special tokens (<|im_end|>) are kept unless skip_special_tokens, as HF."""
        ids = [ids] if isinstance(ids, numbers.Integral) else ids
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        """decode() of each list of ids (HF's batch_decode)."""
        return self.backend.decode_batch([[int(i) for i in ids] for ids in sequences],
                                         skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int],
                              skip_special_tokens: bool = False) -> str | None | list[str | None]:
        """The vocabulary's token string of an id (None outside it), or of each id of a list, as HF's (e.g.
        'Ġworld': the stored form, not the text); skip_special_tokens leaves special ones out of a list."""
        if isinstance(ids, numbers.Integral):
            return self.backend.id_to_token(int(ids))
        special = self._special_ids() if skip_special_tokens else set()
        return [self.backend.id_to_token(int(i)) for i in ids if int(i) not in special]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """The id of a token string (the unknown token's, else None, for one outside the vocabulary), or of each
        string of a list, as HF's."""
        if isinstance(tokens, str):
            found = self.backend.token_to_id(tokens)
            return found if found is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(token) for token in tokens]

    @property
    def unk_token_id(self) -> int | None:
        return self.backend.token_to_id(self.unk_token) if self.unk_token else None

    def _special_ids(self) -> set[int]:
        return {i for i, token in self.backend.get_added_tokens_decoder().items() if token.special}

    def __call__(self, text: str | list[str], add_special_tokens: bool = True,
                 return_attention_mask: bool = True) -> BatchEncoding:
        """HF's call: `input_ids` (and `attention_mask`, all ones: nothing is padded) of one text or a list."""
        ids = ([self.encode(t, add_special_tokens) for t in text] if isinstance(text, list)
               else self.encode(text, add_special_tokens))
        encoding = BatchEncoding(input_ids=ids)
        if return_attention_mask:
            encoding["attention_mask"] = ([[1] * len(i) for i in ids] if isinstance(text, list) else [1] * len(ids))
        return encoding

    @property
    def eos_token_id(self) -> int | None:
        """The id of the tokenizer's EOS token (HF's name); the model's first stop token when it names none."""
        own = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        return own if own is not None else next(iter(self.eos_token_ids), None)

    @property
    def pad_token_id(self) -> int | None:
        """tinyvllm never pads; tools that want a pad id get the EOS id, as HF tools fall back to."""
        return self.eos_token_id

    def encode_prompt(self, text: str, templated: bool) -> list[int]:
        """Token ids of a prompt; chat-templated text carries its own BOS (when the model wants one)."""
        return self._one_bos(self.encode(text, add_special_tokens=not templated))

    def encode_prompts(self, prompts: list[tuple[str, bool]]) -> list[list[int]]:
        """encode_prompt of each (text, templated), in batches: the tokenizer works on them without holding the
        GIL (its one-text encode holds it), so a job's worker thread tokenizes while the engine's thread runs."""
        out: list[list[int]] = [[] for _ in prompts]
        for templated in (False, True):
            where = [i for i, (_, t) in enumerate(prompts) if t == templated]
            if where:
                encodings = self.backend.encode_batch([prompts[i][0] for i in where], add_special_tokens=not templated)
                for i, encoding in zip(where, encodings):
                    out[i] = self._one_bos(self._with_bos(encoding.ids, not templated))
        return out

    def _one_bos(self, ids: list[int]) -> list[int]:
        if self.bos_token_id is not None and ids[:2] == [self.bos_token_id] * 2:
            ids.pop(0)  # raw text that starts with the BOS string itself
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tokenize: bool = False, chat_template: str | None = None,
                            continue_final_message: bool = False, **kwargs) -> str | list[int]:
        """The conversation rendered with the model's chat template (or `chat_template`, a template's source): text,
        or its token ids when tokenize=True. Unlike HF's, the defaults give text ready to generate from
        (tokenize=False, add_generation_prompt=True). continue_final_message: the text ends with the last message's
        content, for the model to continue it (as in HF and vLLM; not with add_generation_prompt). Other keyword
        arguments are template variables (chat_template_kwargs, e.g. enable_thinking=False).
        ValueError says why it cannot be rendered: the reason alone (a job prefixes it with "chat template
        failed")."""
        if tokenize:
            text = self.apply_chat_template(messages, add_generation_prompt, chat_template=chat_template,
                                            continue_final_message=continue_final_message, **kwargs)
            return self.encode_prompt(text, templated=True)
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template; pass plain prompts instead of messages")
        _check_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: it needs add_generation_prompt "
                             "false")
        reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt", "bos_token", "eos_token"})
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {reserved[0]!r}")
        try:
            compiled = _compile(template)
            messages = _check_roles(messages, template)
            text = _render(compiled, **{
                **kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})
        except Exception as e:  # a template may raise anything: raise_exception(), 1/0, content of the wrong type
            raise ValueError(str(e) or type(e).__name__) from e
        return _up_to_final_message(text, messages[-1]) if continue_final_message else text


def _up_to_final_message(text: str, final: dict) -> str:
    """The rendered chat cut right after the last message's content (what follows closes the turn)."""
    content = final["content"]
    if isinstance(content, list):  # content parts: the text ones, joined
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    for needle in (content, content.strip()):
        at = text.rfind(needle) if needle else -1
        if at >= 0:
            return text[: at + len(needle)]
    raise ValueError("continue_final_message: the template does not show the last message's content")


class IncrementalDetokenizer:
    """Decodes generated ids one at a time, with vLLM's prefix_offset/read_offset scheme: a token's text is what the
    decode of a short window (from a few prompt tokens back, so that SentencePiece's dropped leading space is kept)
    grows by, emitted once it no longer ends in U+FFFD (an incomplete UTF-8 sequence).

    Where the tokenizer's table of token texts is exact (`DetokTable`) the text comes without a tokenizer call: a
    byte-level BPE's tokens are fixed byte strings, joined in a byte buffer while they end in an incomplete character
    (`_ByteDetokenizer`); a SentencePiece token of plain text adds its text when nothing is held back. Anything else
    (SentencePiece's byte pieces, special tokens, other decoders) decodes the window twice with the tokenizer."""

    def __new__(cls, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        if cls is IncrementalDetokenizer:
            table = detok_table(tokenizer, skip_special_tokens)
            cls = _ByteDetokenizer if table is not None and table.pieces is not None else _WindowDetokenizer
        return super().__new__(cls)

    def add(self, token_id: int) -> str:
        raise NotImplementedError


class _WindowDetokenizer(IncrementalDetokenizer):
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        # the ids are Python ints: the tokenizers library's decode takes them as they are (Tokenizer.decode's
        # conversion would cost as much as the decodes)
        backend = getattr(tokenizer, "backend", None)
        self._decode = tokenizer.decode if backend is None else backend.decode
        table = detok_table(tokenizer, skip_special_tokens)
        self._texts = None if table is None else table.texts
        # whether the window before read_offset decodes to some text before SentencePiece's strip: then a plain
        # token's text is what the window grows by (true once a text was emitted)
        self._grown = False

    def add(self, token_id: int) -> str:
        ids = self.ids
        if self._grown and self.read_offset == len(ids) and self._texts is not None:
            text = self._texts[token_id] if token_id < len(self._texts) else None
            if text:
                ids.append(token_id)
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                return text
        ids.append(token_id)
        decode, skip = self._decode, self.skip_special_tokens
        prefix_text = decode(ids[self.prefix_offset : self.read_offset], skip)
        new_text = decode(ids[self.prefix_offset :], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self._grown = True
        return delta


class _ByteDetokenizer(IncrementalDetokenizer):
    """The window scheme on bytes: the window's decode grows by the decode of the bytes after its last complete
    character (`pending`: an incomplete one, or tokens whose text ends in U+FFFD), less the `skip` characters
    that the prompt's incomplete tail decoded to."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        table = detok_table(tokenizer, skip_special_tokens)
        self.pieces, self._texts = table.pieces, table.texts
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(b"".join(map(self._piece, prompt_ids[-5:])))
        self.pending = decoder.getstate()[0]  # the window's incomplete last character
        self.skip = len(self.pending.decode("utf-8", "replace"))

    def _piece(self, token_id: int) -> bytes:
        return self.pieces[token_id] if token_id < len(self.pieces) else b""  # no such token: no text

    def add(self, token_id: int) -> str:
        if not self.pending:
            try:
                text = self._texts[token_id]
            except IndexError:  # no such token: no text
                return ""
            if text is not None:
                return text
        buf = self.pending + self._piece(token_id)
        text = buf.decode("utf-8", "replace")
        if len(text) <= self.skip or text.endswith("\ufffd"):
            self.pending = buf
            return ""
        skip, self.pending, self.skip = self.skip, b"", 0
        return text[skip:]

    def extend(self, token_ids: list[int]) -> str:
        """What add() of each token in turn gives, joined, in one decode: the text up to the last token after which
        the bytes decode to complete characters (where add() last emitted)."""
        pieces = list(map(self._piece, token_ids))
        buf = self.pending + b"".join(pieces)
        end = len(buf)
        for piece in reversed(pieces):
            text = buf[:end].decode("utf-8", "replace")
            if len(text) > self.skip and not text.endswith("\ufffd"):
                skip, self.pending, self.skip = self.skip, buf[end:], 0
                return text[skip:]
            end -= len(piece)
        self.pending = buf
        return ""


@dataclass
class DetokTable:
    """Each token's text as the detokenizer may add it: `texts[id]` its text wherever nothing is held back before
    it (None: not known alone: part of a character, U+FFFD at its end, a SentencePiece byte or special token);
    `pieces[id]` a byte-level BPE's bytes of each token (None for other tokenizers)."""

    texts: list[str | None]
    pieces: list[bytes] | None = None


def detok_table(tokenizer, skip_special_tokens: bool) -> DetokTable | None:
    """The tokenizer's DetokTable (built once; None where no table is exact: it then decodes every token)."""
    tables = getattr(tokenizer, "_detok_tables", None)
    if tables is None:
        return None  # a tokenizer of another kind
    if skip_special_tokens not in tables:
        tables[skip_special_tokens] = _build_detok_table(tokenizer.backend, skip_special_tokens)
    return tables[skip_special_tokens]


def _build_detok_table(backend: tokenizers.Tokenizer, skip_special_tokens: bool) -> DetokTable | None:
    """The table, checked against the tokenizer: every id's decode alone (and, for SentencePiece, after a plain
    token), and for byte-level BPE random runs of ids (the decode joins the bytes)."""
    kind = _decoder_kind(backend)
    special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    tokens = [backend.id_to_token(i) for i in range(backend.get_vocab_size(with_added_tokens=True))]
    if kind == "byte-level":
        return _byte_level_table(backend, tokens, special if skip_special_tokens else set())
    if kind == "sentencepiece":
        return _sentencepiece_table(backend, tokens, set(backend.get_added_tokens_decoder()))
    return None


SPM_DECODERS = ["Replace", "ByteFallback", "Fuse"]  # then, optionally, Strip of the decode's leading space
SPM_BYTE = re.compile(r"<0x([0-9A-F]{2})>")  # a SentencePiece byte-fallback token


def _decoder_kind(backend: tokenizers.Tokenizer) -> str | None:
    """'byte-level' (GPT-2's bytes as characters), 'sentencepiece' (U+2581 for spaces, byte fallback) or None."""
    kind = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    if kind.get("type") == "ByteLevel":
        return "byte-level"
    if kind.get("type") == "Sequence" and [d.get("type") for d in kind["decoders"]][:3] == SPM_DECODERS \
            and kind["decoders"][0] == {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}:
        return "sentencepiece"
    return None


class TokenNames:
    """Each token as OpenAI's logprobs name it: (its text, its bytes), what the token adds to the output wherever it
    stands (a SentencePiece token's leading space kept, which a decode of the token alone strips). A token that is
    part of a character (a byte-level BPE piece, a byte-fallback token) has its exact bytes, and as text those
    bytes decoded with U+FFFD for the incomplete character, as OpenAI's API gives it. Special tokens by their
    text (<|im_end|>). Names are made on first use."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._kind = _decoder_kind(tokenizer.backend)
        table = detok_table(tokenizer, False) if self._kind == "byte-level" else None
        self._pieces = table.pieces if table is not None else None
        self._added = set(tokenizer.backend.get_added_tokens_decoder())
        self._names: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        name = self._names.get(token_id)
        if name is None:
            data = self._bytes(token_id)
            name = self._names[token_id] = (data.decode("utf-8", "replace"), list(data))
        return name

    def _bytes(self, token_id: int) -> bytes:
        if self._pieces is not None:  # the table checked the pieces against the tokenizer's decode
            return self._pieces[token_id] if 0 <= token_id < len(self._pieces) else b""
        token = self.tokenizer.backend.id_to_token(token_id)
        if token is None:
            return b""  # no such token
        if self._kind == "sentencepiece":
            byte = SPM_BYTE.fullmatch(token)  # a byte-fallback token (an added token in some vocabularies)
            if byte:
                return bytes([int(byte.group(1), 16)])
            if token_id not in self._added:
                return token.replace("\u2581", " ").encode()
        return self.tokenizer.decode(token_id).encode()


def _byte_level_table(backend: tokenizers.Tokenizer, tokens: list[str | None], skipped: set[int]) -> DetokTable | None:
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    pieces = [b"" if token is None or i in skipped else
              bytes(map(to_byte.__getitem__, token)) if all(c in to_byte for c in token) else token.encode()
              for i, token in enumerate(tokens)]
    rng = np.random.default_rng(0)
    runs = [rng.integers(0, len(tokens), 8).tolist() for _ in range(256)] if tokens else []
    singles = backend.decode_batch([[i] for i in range(len(tokens))], skip_special_tokens=bool(skipped))
    joined = backend.decode_batch(runs, skip_special_tokens=bool(skipped))
    if any(text != piece.decode("utf-8", "replace") for piece, text in zip(pieces, singles)) or any(
            text != b"".join(pieces[i] for i in ids).decode("utf-8", "replace") for ids, text in zip(runs, joined)):
        return None
    # a decode without U+FFFD is the piece's whole text (one with it: a piece that is no UTF-8, or ends in U+FFFD)
    return DetokTable([text if "\ufffd" not in text else _whole_text(piece) for piece, text in zip(pieces, singles)],
                      pieces)


def _whole_text(piece: bytes) -> str | None:
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if text.endswith("\ufffd") else text


def _sentencepiece_table(backend: tokenizers.Tokenizer, tokens: list[str | None], added: set[int]) -> DetokTable:
    texts = [None if token is None or i in added or re.fullmatch(r"<0x[0-9A-F]{2}>", token)
             else token.replace("\u2581", " ") for i, token in enumerate(tokens)]
    anchor = next((i for i, t in enumerate(texts) if t and t.isalpha()), None)
    if anchor is None:
        return DetokTable([None] * len(tokens))
    base = backend.decode([anchor])
    decoded = backend.decode_batch([[anchor, i] for i in range(len(tokens))])
    return DetokTable([text if text and not text.endswith("\ufffd") and whole == base + text else None
                       for text, whole in zip(texts, decoded)])


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of each byte to the character a byte-level BPE token writes it as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def decode_continuations(tokenizer: Tokenizer, requests: list[tuple[list[int], list[int], bool]]) -> list[str]:
    """For each (prompt_ids, output_ids, skip_special_tokens), the text of output_ids as a continuation of the
    prompt, in one decode: what IncrementalDetokenizer would have built token by token (same window), minus an
    incomplete UTF-8 sequence at the very end. In batches: the tokenizer decodes a batch in parallel and without
    holding the GIL. The ids are Python ints (the engine's are)."""
    texts = [""] * len(requests)
    for skip in (True, False):
        where = [i for i, request in enumerate(requests) if request[2] == skip]
        if not where:
            continue
        windows = [list(requests[i][0][-5:]) for i in where]
        prefixes = tokenizer.backend.decode_batch(windows, skip_special_tokens=skip)
        wholes = tokenizer.backend.decode_batch([window + list(requests[i][1]) for i, window in zip(where, windows)],
                                                skip_special_tokens=skip)
        for i, prefix, whole in zip(where, prefixes, wholes):
            texts[i] = whole[len(prefix):].rstrip("\ufffd")
    return texts


class BatchEncoding(dict):
    """What HF tokenizers return: a dict whose keys also read as attributes (`encoding.input_ids`)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _read_json_object(path: Path) -> dict:
    """A JSON file holding an object; ValueError naming the file otherwise."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _read_backend(tok_file: Path) -> tokenizers.Tokenizer:
    """tokenizer.json as a `tokenizers.Tokenizer`; ValueError naming the file when the library cannot read it (it
    raises a plain Exception for text that is not JSON, or JSON that is no tokenizer)."""
    try:
        return tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"{tok_file} is not a readable tokenizer: {reason}") from None


def _named_template(template: object, cfg_file: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates ([{"name": "default", "template":
    ...}, ...]: the default one); ValueError naming the file for anything else."""
    if template is None or isinstance(template, str):
        return template
    if not isinstance(template, list) or not all(isinstance(t, dict) for t in template):
        raise ValueError(f"{cfg_file}: chat_template must be a string or a list of {{\"name\": ..., "
                         "\"template\": ...} objects")
    default = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if default is not None and not isinstance(default, str):
        raise ValueError(f"{cfg_file}: the default chat_template's \"template\" must be a string")
    return default


def _token_content(tok: str | dict | None) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    return tok.get("content") if isinstance(tok, dict) else tok


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role': {m!r}")
        if not isinstance(m.get("content"), (str, list)):
            raise ValueError(f"message {i} must have 'content' (a string or a list of parts): {m!r}")
        parts = m["content"] if isinstance(m["content"], list) else []
        kinds = sorted({str(p.get("type")) for p in parts if isinstance(p, dict)} - {"text", "None"})
        if kinds:  # a multimodal template would render a placeholder for it, with no image behind
            raise ValueError(f"message {i} has a content part of type {kinds[0]!r}: tinyvllm takes text only "
                             "(image inputs are not supported)")


# The roles every conversation may use; a template may know more (Llama 3.1's 'ipython'), found in its source.
STANDARD_ROLES = ("system", "user", "assistant", "tool")


def _check_roles(messages: list[dict], template: str) -> list[dict]:
    """The messages to render: ValueError for a message whose role is neither a standard one nor one the template
    compares a role with (a misspelt 'usr' would otherwise be rendered as a role of its own). OpenAI's 'developer'
    messages (its name for system instructions since o1) are rendered as 'system' where the template has no
    'developer' of its own."""
    known = None
    for i, message in enumerate(messages):
        if message["role"] not in STANDARD_ROLES:
            known = _template_roles(template) if known is None else known
            if message["role"] == "developer" and "developer" not in known:
                messages = [*messages[:i], {**message, "role": "system"}, *messages[i + 1:]]
            elif message["role"] not in known:
                raise ValueError(f"message {i} has role {message['role']!r}: the chat template knows "
                                 f"{', '.join(sorted(known))}")
    return messages


@functools.lru_cache(maxsize=64)
def _template_roles(source: str) -> frozenset[str]:
    """The standard roles plus the strings the template compares a role with (`message['role'] == 'ipython'`,
    `message.role in ['tool', 'ipython']`, `role == ...` after `set role = message['role']`)."""
    roles = set(STANDARD_ROLES)
    tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    for compare in tree.find_all(nodes.Compare):
        sides = [compare.expr, *(operand.expr for operand in compare.ops)]
        if any(_names_a_role(side) for side in sides):
            for side in sides:
                items = side.items if isinstance(side, (nodes.List, nodes.Tuple)) else [side]
                roles.update(item.value for item in items if isinstance(item, nodes.Const)
                             and isinstance(item.value, str))
    return frozenset(roles)


def _names_a_role(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Getattr):
        return node.attr == "role"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "role"
    return isinstance(node, nodes.Name) and "role" in node.name


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class TemplateLimitError(jinja2.TemplateError):
    pass


class _Budget(threading.local):
    deadline: float | None = None  # None: not rendering (compiling: Jinja folds constant expressions then)
    loop_steps: int = 0


_budget = _Budget()


def _tick() -> None:
    if _budget.deadline is not None and time.monotonic() > _budget.deadline:
        raise TemplateLimitError(f"rendering took more than {TEMPLATE_SECONDS:g} s")


def _checked(value):
    """value, unless it is a string or collection over the size bound (or rendering is out of time)."""
    _tick()
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > TEMPLATE_MAX_CHARS:
        raise TemplateLimitError(f"rendering built a value of more than {TEMPLATE_MAX_CHARS} characters or items")
    return value


def _check_size(size: int) -> None:
    if size > TEMPLATE_MAX_CHARS:
        raise TemplateLimitError(f"rendering would build a value of {size} characters or items "
                                 f"(the limit is {TEMPLATE_MAX_CHARS})")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with every operator, call, attribute, filter, loop step and concatenation checked against the
    time and size bounds; the operators that can multiply a size are checked before they run."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call_binop(self, context, operator: str, left, right):
        numbers = isinstance(left, int) and isinstance(right, int)
        if operator == "*" and numbers:  # a number's size in bytes: 2 ** 1000000000 would compute for minutes
            _check_size((left.bit_length() + right.bit_length()) // 8)
        elif operator == "**" and numbers:
            _check_size(left.bit_length() * right // 8)
        elif operator == "*" and isinstance(right, int) and hasattr(left, "__len__"):
            _check_size(len(left) * right)
        elif operator == "*" and isinstance(left, int) and hasattr(right, "__len__"):
            _check_size(left * len(right))
        elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
            _check_size(len(left) + len(right))
        elif operator == "%" and isinstance(left, str) and FORMAT_WIDTH.search(left):
            raise TemplateLimitError("a %-format width or precision over 6 digits (or *) is not allowed")
        return _checked(super().call_binop(context, operator, left, right))

    def getattr(self, obj, attribute):
        return _checked(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        return _checked(super().getitem(obj, argument))

    def call(__self, __context, __obj, *args, **kwargs):  # jinja's odd names: kwargs may hold any other name
        _check_arguments(args, kwargs)
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def loop_steps(self, iterable):
        """Every for loop iterates through this (see _BoundLoops)."""
        for item in iterable:
            _budget.loop_steps += 1
            if _budget.loop_steps > TEMPLATE_MAX_LOOP_STEPS:
                raise TemplateLimitError(f"rendering ran more than {TEMPLATE_MAX_LOOP_STEPS} loop steps")
            _tick()
            yield item

    def concat(self, *parts) -> str:
        """`a ~ b`."""
        parts = [str(_checked(p)) for p in parts]
        _check_size(sum(map(len, parts)))
        return "".join(parts)


def _check_arguments(args: tuple, kwargs: dict) -> None:
    # An integer argument sizes what a call or filter builds (center(400000000), lipsum(n=...)): bound it the way
    # Jinja's sandbox bounds range().
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and abs(value) > MAX_RANGE:
            raise TemplateLimitError(f"argument {value} is too large (the limit is {MAX_RANGE})")


def _bounded_filter(f):
    # The value filtered comes first, after the context a @pass_context (or eval_ctx, environment) filter takes.
    first_argument = 2 if hasattr(f, "jinja_pass_arg") else 1

    @functools.wraps(f)  # keeps that jinja_pass_arg mark
    def bounded(*args, **kwargs):
        _check_arguments(args[first_argument:], kwargs)
        return _checked(f(*args, **kwargs))

    return bounded


class _BoundLoops(NodeTransformer):
    """Routes every for loop's iterable through environment.loop_steps and every `~` through environment.concat:
    loops and concatenation are the two things a template does with no call the sandbox sees."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("loop_steps"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("concat"), node.nodes, [], None, None, lineno=node.lineno)


def _render(template: jinja2.Template, **variables) -> str:
    _budget.deadline, _budget.loop_steps = time.monotonic() + TEMPLATE_SECONDS, 0
    chunks, size = [], 0
    pieces = template.generate(**variables)
    try:
        for chunk in pieces:
            size += len(chunk)
            _check_size(size)
            _tick()
            chunks.append(chunk)
    finally:
        pieces.close()
        _budget.deadline = None
    return "".join(chunks)


_templates: dict[str, jinja2.Template] = {}


def check_chat_template(source: str) -> None:
    """ValueError unless `source` compiles as a chat template (in the bounded sandbox)."""
    try:
        _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"line {e.lineno}: {e.message}") from None


def _compile(source: str) -> jinja2.Template:
    # Same environment as transformers' apply_chat_template, so hub templates render identically.
    if source not in _templates:
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _templates[source] = env.from_string(_BoundLoops().visit(env.parse(source)))
    return _templates[source]
