"""Random models (real shapes or tiny ones) saved as HF dirs, for tests and benchmarks without downloads."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import tokenizers

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.loader import weight_shapes, write_safetensors

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Enough varied text for the BPE trainer to learn a few hundred merges (ASCII, accents, CJK, emoji).
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital of France.",
    "Once upon a time there was a little model that generated tokens one at a time, and it was happy.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 3\n",
    "Il était une fois un café près de la rivière; l'été, les élèves y mangeaient des crêpes.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Straße, Größe, schön.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 😀 🚀 🎉 👍🏽 ❤️ — and numbers 0123456789, 3.14159, 2024-06-01.",
    "user: hello there! assistant: Hi! How can I help you today? user: tell me a story about a dragon.",
]


def tiny_config(**overrides) -> ModelConfig:
    base = ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=[2],
    )
    return replace(base, **overrides)


def llama_3_2_1b_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_ids=[128001, 128008, 128009], torch_dtype="bfloat16",
    )


def smollm2_135m_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], torch_dtype="bfloat16",
    )


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights, std 1/sqrt(fan_in) so activations and logits stay O(1); norm gains 1 + small noise."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith(".bias"):  # Qwen2's Q/K/V biases: as large as the projections' outputs
            w *= np.float32(0.5)
        elif len(shape) == 1:
            w = 1.0 + 0.1 * w
        else:
            w *= np.float32(1.0 / math.sqrt(shape[1]))
        weights[name] = w
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def save_hf_model_dir(
    path: str | os.PathLike, config: ModelConfig, weights: dict, dtype: str = "float32", shards: int = 1
) -> Path:
    """Write an HF-style model dir (config, safetensors, byte-level BPE tokenizer, ChatML template).

    `dtype` is the storage dtype of the safetensors; `shards` > 1 writes model-0000i-of-0000n files + index.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = replace(config, torch_dtype=dtype)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))

    tensors = {k: v for k, v in weights.items() if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    if shards == 1:
        write_safetensors(path / "model.safetensors", tensors, dtype)
    else:
        names = list(tensors)
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            write_safetensors(path / file, {k: tensors[k] for k in part}, dtype)
            weight_map |= dict.fromkeys(part, file)
        index = {"metadata": {"total_size": sum(v.size for v in tensors.values())}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    build_tokenizer(config.vocab_size).save(str(path / "tokenizer.json"))
    tok_config = {"bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "add_bos_token": False,
                  "chat_template": CHATML_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return path


def build_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on CORPUS with at most vocab_size tokens: specials, 256 bytes, then merges."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (>= 259)")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok
