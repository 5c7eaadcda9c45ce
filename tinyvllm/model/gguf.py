"""GGUF (llama.cpp) models (llama, qwen2, qwen3, phi3, gemma2, gemma3, and the mixture-of-experts qwen3moe and
Mixtral-style llama):
metadata -> ModelConfig, tensors -> float32 HF-named weights, vocab -> Tokenizer."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np
import tokenizers
from gguf import GGMLQuantizationType as QT

from tinyvllm.model.config import FAMILIES, ModelConfig, check_dimension, window_fields
from tinyvllm.model.dtypes import bf16_to_f32
from tinyvllm.model.gguf_file import read_gguf
from tinyvllm.model.layout import (gguf_experts, gguf_permuted_heads, hf_name_of_gguf, layout_of,
                                   layout_of_architecture, norm_names, tied_copies)
from tinyvllm.model.rope import rope_inv_freq
from tinyvllm.model.weights import LazyWeights
from tinyvllm.tokenizer import Tokenizer

# general.architecture -> HF architecture (convert_hf_to_gguf writes Mistral as "llama")
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM"}
# llama.cpp scales a Gemma's attention by hidden / heads (not head_dim) in the 27B, which it knows by its depth
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# general.architecture -> the HF architecture it is when its expert_count is set (convert_hf_to_gguf writes Mixtral
# as "llama" with experts)
GGUF_MOE_ARCHITECTURES = {"llama": "MixtralForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# tokenizer.ggml.pre -> how text is split before byte-level BPE (as in the model's own tokenizer.json).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS: dict[str, list[str]] = {
    **dict.fromkeys(["default", "gpt-2", "gpt2", "mpt", "olmo"], [_GPT2_SPLIT]),
    **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell"], [r"\p{N}", _GPT2_SPLIT]),  # digits one by one
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3"], [_LLAMA3_SPLIT]),
    **dict.fromkeys(["qwen2", "stablelm2"], [_QWEN2_SPLIT]),
}
IGNORE_MERGES_PRES = {"llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3"}  # as llama.cpp does
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4  # tokenizer.ggml.token_type
SPM_SPACE = "\u2581"  # SentencePiece writes a space as this visible character


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, GGUFWeights, Tokenizer]:
    try:
        meta, tensor_list = read_gguf(path)
    except ValueError as e:  # the gguf package's own checks ("GGUF magic invalid")
        raise ValueError(f"{path} is not a readable GGUF file: {e}"[:300]) from None
    except Exception:  # a damaged file fails deeper, as an IndexError or struct error in numpy's words
        raise ValueError(f"{path} is not a readable GGUF file: truncated or damaged") from None
    tensors = {t.name: t for t in tensor_list}
    config = config_from_gguf(meta, tensors)
    layout = layout_of(config)
    folded = (layout.gguf_rope_freqs, *layout.gguf_rope_factors)  # already in config.rope_scaling
    stacked = gguf_experts(config)  # the experts, read stacked below
    skipped = (*folded, *stacked)
    by_hf_name = {hf_name(config, name): t for name, t in tensors.items() if name not in skipped}
    for name, source in tied_copies(config).items():
        if source in by_hf_name:
            by_hf_name[name] = by_hf_name[source]
    experts = {hf: (tensors[name], e) for name, hfs in stacked.items() if name in tensors for e, hf in enumerate(hfs)}
    return config, GGUFWeights(by_hf_name, config, experts), tokenizer_from_gguf(meta)


class GGUFWeights(LazyWeights):
    """A GGUF file's tensors by HF name, each dequantized to float32 when asked for (the file stays mapped). An
    expert's tensor is its slice of the file's stacked one (`experts`: HF name -> (stacked tensor, expert)); the last
    STACKED dequantized stacked tensors are kept, as the experts are read one after another."""

    STACKED = 2  # an expert's gate and up: read in turn from two stacked tensors

    def __init__(self, tensors: dict[str, Any], config: ModelConfig,
                 experts: dict[str, tuple[Any, int]] | None = None) -> None:
        self.tensors = tensors
        self.config = config
        self.permuted_heads = gguf_permuted_heads(config)
        # convert_hf_to_gguf stores a Gemma's RMSNorm gains with its (1 + weight) offset added: taken off here
        self.norm_shift = norm_names(config) if config.norm_offset else set()
        self.experts = experts or {}
        self.stacked: OrderedDict[str, np.ndarray] = OrderedDict()

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.experts:
            return tuple(int(n) for n in reversed(self.experts[name][0].shape.tolist()))[1:]
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def expert(self, name: str) -> np.ndarray:
        tensor, e = self.experts[name]
        if tensor.name not in self.stacked:
            self.stacked[tensor.name] = dequantize(tensor)
            while len(self.stacked) > self.STACKED:
                self.stacked.popitem(last=False)
        return np.array(self.stacked[tensor.name][e])

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.experts:
            return self.expert(name)
        w = dequantize(self.tensors[name])
        # llama.cpp stores a Llama's Q/K rows interleaved per head (rotate-pairs RoPE); undone for the rotate-half
        # layout. Qwen's it keeps as HF has them (llama.cpp runs those with rotate-half "NEOX" RoPE).
        heads = self.permuted_heads.get(name)
        if name in self.norm_shift:
            w -= np.float32(self.config.norm_offset)
        return w if heads is None else unpermute_qk(w, heads)

    def __iter__(self) -> Iterator[str]:
        return iter([*self.tensors, *self.experts])

    def __len__(self) -> int:
        return len(self.tensors) + len(self.experts)


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r:.40}: supported are {', '.join(GGUF_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    for key in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count"):
        if get(key) is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
    if not isinstance(meta.get("tokenizer.ggml.tokens"), list):
        raise ValueError("GGUF metadata is missing tokenizer.ggml.tokens (the vocabulary)")
    architecture = (GGUF_MOE_ARCHITECTURES.get(arch) if get("expert_count") else None) or GGUF_ARCHITECTURES[arch]
    layout = layout_of_architecture(architecture)
    hidden, heads = get("embedding_length"), get("attention.head_count")
    check_dimension("hidden_size", hidden)  # both checked before head_dim is computed from them
    check_dimension("num_attention_heads", heads)
    # Phi-3's rope.dimension_count is the rotated part of a head (partial rotary), not all of it
    rotated = get("rope.dimension_count") if arch == "phi3" else None
    head_dim = get("attention.key_length") or (None if rotated else get("rope.dimension_count")) or hidden // heads
    theta = _round32(get("rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling_from_gguf(get, tensors, layout, head_dim, theta)
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    return ModelConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=_round32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings=not any(part.gguf in tensors for part in layout.packed("lm_head").parts),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        torch_dtype=_storage_dtype(tensors),
        architecture=architecture,
        partial_rotary_factor=rotated / head_dim if rotated else 1.0,
        **_family_fields_from_gguf(arch, get, head_dim, hidden // heads),
        **_experts_from_gguf(get),
    )


def _rope_scaling_from_gguf(get: Callable[..., Any], tensors: dict[str, Any], layout, head_dim: int,
                            theta: float) -> dict | None:
    """rope_scaling from a GGUF: linear (rope.scaling.*), LongRoPE (Phi-3's factor tensors) or Llama 3's (the
    rope_freqs tensor)."""
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if kind != "none":
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
    long, short = layout.gguf_rope_factors
    if long in tensors and short in tensors:
        out = {"rope_type": "longrope", "long_factor": dequantize(tensors[long]).tolist(),
               "short_factor": dequantize(tensors[short]).tolist(),
               "original_max_position_embeddings": get("rope.scaling.original_context_length")}
        return out | ({"attention_factor": _round32(get("rope.scaling.attn_factor"))}
                      if get("rope.scaling.attn_factor") is not None else {})
    if layout.gguf_rope_freqs in tensors:
        return _llama3_scaling_from_freqs(dequantize(tensors[layout.gguf_rope_freqs]), head_dim, theta)
    return None


def _family_fields_from_gguf(arch: str, get: Callable[..., Any], head_dim: int, hidden_per_head: int) -> dict:
    """The sliding window and Gemma's fields, as llama.cpp reads (or assumes) them."""
    family = FAMILIES[GGUF_ARCHITECTURES[arch]]
    n, window = get("block_count"), get("attention.sliding_window")
    fields = window_fields({"sliding_window": window, "num_hidden_layers": n}, family)
    if not family.norm_offset:
        return fields
    softcaps = {k: None if get(k) is None else _round32(get(k))
                for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return fields | softcaps | {
        "activation": dict(family.defaults)["hidden_activation"],
        "query_pre_attn_scalar": hidden_per_head if n == GEMMA_27B_LAYERS.get(arch) else head_dim,
        "local_rope_theta": _round32(get("rope.freq_base_swa", dict(family.defaults)["rope_local_base_freq"]))
        if "rope_local_base_freq" in dict(family.defaults) else None}


def _experts_from_gguf(get) -> dict:
    """The ModelConfig MoE fields of a GGUF's metadata (none without expert_count). llama.cpp renormalizes the
    chosen experts' weights of these architectures unless expert_weights_norm says otherwise; every layer is sparse."""
    if not get("expert_count"):
        return {}
    return {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length") or get("feed_forward_length"),
            "norm_topk_prob": bool(get("expert_weights_norm", True))}


def hf_name(config: ModelConfig, name: str) -> str:
    """The HF name of a GGUF tensor; ValueError for one the family's layout does not know."""
    hf = hf_name_of_gguf(config, name)
    if hf is None:
        raise ValueError(f"unsupported GGUF tensor {name!r:.80} (a variant of the architecture tinyvllm does not run?)")
    return hf


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's permute: per head, rows (d/2, 2) back to (2, d/2)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def dequantize(t: Any) -> np.ndarray:
    """A GGUFTensor (or gguf's ReaderTensor) as float32 with the numpy shape (GGUF lists dims fastest-first, so
    reversed)."""
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    data, kind = t.data, t.tensor_type
    if kind in (QT.F32, QT.F16):
        out = data.astype(np.float32)
    elif kind == QT.BF16:
        out = bf16_to_f32(data.view(np.uint16))
    elif kind in DEQUANTIZERS:
        block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
        out = DEQUANTIZERS[kind](np.ascontiguousarray(data).reshape(-1, block_bytes))
    else:
        try:  # rarer formats (K-quants, IQ*): gguf's own numpy reference
            out = gguf.quants.dequantize(data, kind)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name}: cannot dequantize type {kind.name}") from e
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


# Block layouts (ggml-common.h): 32 weights per block, a float16 scale d first. Each writes one float32 array and
# works in place on it: whole-model temporaries cost more in page faults than in arithmetic.
def _dequant_q8_0(b: np.ndarray) -> np.ndarray:  # d, int8 q[32]: w = d * q
    w = b[:, 2:].view(np.int8).astype(np.float32)
    w *= b[:, :2].view(np.float16).astype(np.float32)
    return w


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # byte j holds weight j in its low nibble and weight j + 16 in its high nibble
    half = qs.shape[1]
    w = np.empty((len(qs), 2 * half), np.float32)
    np.bitwise_and(qs, 0x0F, out=w[:, :half], casting="unsafe")
    np.right_shift(qs, 4, out=w[:, half:], casting="unsafe")
    return w


def _dequant_q4_0(b: np.ndarray) -> np.ndarray:  # d, q[16 bytes]: w = d * (q - 8)
    w = _nibbles(b[:, 2:])
    w -= 8
    w *= b[:, :2].view(np.float16).astype(np.float32)
    return w


def _dequant_q4_1(b: np.ndarray) -> np.ndarray:  # d, m, q[16 bytes]: w = d * q + m
    w = _nibbles(b[:, 4:])
    w *= b[:, :2].view(np.float16).astype(np.float32)
    w += b[:, 2:4].view(np.float16).astype(np.float32)
    return w


DEQUANTIZERS = {QT.Q8_0: _dequant_q8_0, QT.Q4_0: _dequant_q4_0, QT.Q4_1: _dequant_q4_1}


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """The Tokenizer described by tokenizer.ggml.* metadata: byte-level BPE ('gpt2': Llama 3, SmolLM2, ...) or
    SentencePiece BPE ('llama': Llama 2, Mistral, TinyLlama, ...)."""
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [])
    if model == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
    elif model == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}: 'gpt2' (byte-level BPE) and 'llama' "
                         "(SentencePiece BPE) are implemented")
    # Control tokens (<|im_start|>, ...) are special: matched whole in text and dropped by skip_special_tokens.
    # User-defined ones are matched whole too but decode as text, as llama.cpp does.
    added = [
        tokenizers.AddedToken(tok, special=kind == TOKEN_CONTROL, normalized=False)
        for tok, kind in zip(tokens, types)
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])

    def token(key: str) -> str | None:
        i = meta.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    eos = [token(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                              "tokenizer.ggml.eom_token_id")]
    return Tokenizer(
        backend,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_tokens=[t for t in dict.fromkeys(eos) if t is not None],
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),  # llama.cpp's default when absent
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (known: {sorted(PRE_SPLITS)})")
    # A merge is "left right"; split at the first space after position 0 like llama.cpp.
    merges = [(m[: m.index(" ", 1)], m[m.index(" ", 1) + 1 :]) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(_vocab(tokens), merges,
                                                         ignore_merges=pre in IGNORE_MERGES_PRES))
    splits = [tokenizers.pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        splits + [tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = tokenizers.decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: spaces become U+2581 (and one is put in front of the text), then the
    adjacent pair whose union is the best-scored normal piece is merged until none is left; a character outside the
    vocabulary falls back to its UTF-8 bytes as <0xXX> pieces. As an HF BPE (what transformers' LlamaConverter
    builds): the merges are every split of a normal piece into two normal pieces, ranked by the piece's score."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("a SentencePiece GGUF needs tokenizer.ggml.scores, one per token")
    vocab = _vocab(tokens)
    normal = {tok for i, tok in enumerate(tokens) if (types[i] if types else TOKEN_NORMAL) == TOKEN_NORMAL}
    ranked = sorted((-scores[vocab[piece]], vocab[piece], piece[:cut], piece[cut:])
                    for piece in normal for cut in range(1, len(piece))
                    if piece[:cut] in normal and piece[cut:] in normal)
    unknown = next((tok for tok, kind in zip(tokens, types) if kind == TOKEN_UNKNOWN), None)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab, [(left, right) for _, _, left, right in ranked], unk_token=unknown, fuse_unk=True,
        byte_fallback=True))
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    normalizers = [tokenizers.normalizers.Prepend(SPM_SPACE)] if space_prefix else []
    backend.normalizer = tokenizers.normalizers.Sequence(
        normalizers + [tokenizers.normalizers.Replace(" ", SPM_SPACE)])
    decoders = [tokenizers.decoders.Replace(SPM_SPACE, " "), tokenizers.decoders.ByteFallback(),
                tokenizers.decoders.Fuse()]
    backend.decoder = tokenizers.decoders.Sequence(
        decoders + ([tokenizers.decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return backend


def _llama3_scaling_from_freqs(freqs: np.ndarray, head_dim: int, theta: float) -> dict:
    """Recover rope_scaling from the rope_freqs tensor convert_hf_to_gguf writes for Llama 3.1+ (divisors of
    inv_freq). Only the published Llama 3.x parameters are tried, with the factor read off the tensor."""
    candidate = {"rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base = rope_inv_freq(head_dim, theta, None)
    if np.allclose(base / freqs, rope_inv_freq(head_dim, theta, candidate), rtol=1e-4):
        return candidate
    raise ValueError("unsupported GGUF rope_freqs tensor: not Llama 3 rope scaling (factor, 1, 4, 8192)")


def _storage_dtype(tensors: dict[str, Any]) -> str:
    # What the weights were stored as, for a backend choosing its compute dtype: quantized blocks scale in f16.
    kinds = {t.tensor_type for t in tensors.values() if len(t.shape) == 2}
    if kinds <= {QT.F32}:
        return "float32"
    return "bfloat16" if QT.BF16 in kinds else "float16"


def _round32(x: float) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06; restore the decimal the config had.
    return float(f"{x:.7g}")
