"""Random models (real shapes or tiny ones) saved as HF dirs, for tests and benchmarks without downloads."""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import tokenizers

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16
from tinyvllm.model.layout import tied_copies, weight_shapes
from tinyvllm.model.loader import write_safetensors
from tinyvllm.model.weights import LazyWeights

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


def llama_3_1_8b_config() -> ModelConfig:
    """The 1B's family (vocabulary, RoPE, special tokens), wider and deeper, with its own LM head."""
    small = llama_3_2_1b_config()
    return replace(small, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128,
                   rope_scaling={**small.rope_scaling, "factor": 8.0}, tie_word_embeddings=False)


def qwen2_5_7b_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_ids=[151645, 151643], torch_dtype="bfloat16",
        architecture="Qwen2ForCausalLM",
    )


def gemma_2_2b_config() -> ModelConfig:
    """google/gemma-2-2b's config.json (in bf16; the hub's says float32)."""
    return ModelConfig.from_hf_dict({
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True, "bos_token_id": 2,
        "eos_token_id": [1, 107], "torch_dtype": "bfloat16"})


def gemma_3_1b_config() -> ModelConfig:
    """google/gemma-3-1b-it's config.json: 5 sliding layers of 512 tokens to each global one."""
    return ModelConfig.from_hf_dict({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106], "torch_dtype": "bfloat16"})


# microsoft/Phi-3.5-mini-instruct's LongRoPE factors (its config.json holds these as float32 values)
PHI_3_5_SHORT_FACTOR = [1.0, 1.02, 1.03, 1.03, *[1.05] * 5, 1.07, 1.1, 1.11, 1.16, 1.16, 1.17, 1.29, 1.34, 1.68, 1.79,
                        1.82, 1.85, 1.88, 1.91, 1.94, 1.99, *[2.02] * 6, *[2.03] * 9, 2.08, 2.09, 2.19, 2.22, 2.59,
                        2.73, 2.75, 2.84]
PHI_3_5_LONG_FACTOR = [1.08, 1.11, 1.14, 1.34, 1.59, 1.6, 1.62, 2.62, 3.23, 3.23, 4.79, 7.4, 7.7, 9.09, 12.2, 17.67,
                       24.46, 28.57, 30.42, 30.84, 32.59, 32.93, 42.32, 44.96, 50.34, 50.45, 57.55, 57.93, 58.21, 60.14,
                       62.61, 62.62, 62.71, 63.14, 63.14, 63.77, 63.93, 63.96, 63.97, 64.03, 64.07, 64.08, 64.12, 64.41,
                       64.48, 64.51, 64.53, 64.84]


def phi_3_5_mini_config() -> ModelConfig:
    """microsoft/Phi-3.5-mini-instruct's config.json: fused Q/K/V and gate/up checkpoint tensors, head_dim 96,
    LongRoPE."""
    return ModelConfig.from_hf_dict({
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_act": "silu", "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False,
        "rope_scaling": {"type": "longrope", "short_factor": PHI_3_5_SHORT_FACTOR,
                         "long_factor": PHI_3_5_LONG_FACTOR},
        "bos_token_id": 1, "eos_token_id": [32007, 32001, 32000], "torch_dtype": "bfloat16"})
def qwen3_30b_a3b_config() -> ModelConfig:
    """Qwen3-30B-A3B's config.json: 48 expert layers of 128 experts (moe_intermediate 768), 8 per token."""
    return ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_ids=[151645, 151643], torch_dtype="bfloat16",
        architecture="Qwen3MoeForCausalLM", num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        moe_intermediate_size=768,
    )


def mixtral_8x7b_config() -> ModelConfig:
    """Mixtral-8x7B-v0.1's config.json: 32 layers of 8 experts (intermediate 14336), 2 per token."""
    return ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=[2], torch_dtype="bfloat16",
        architecture="MixtralForCausalLM", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        moe_intermediate_size=14336,
    )


def olmoe_1b_7b_config() -> ModelConfig:
    """allenai/OLMoE-1B-7B-0924's config.json: 16 layers of 64 experts (intermediate 1024), 8 per token, not
    renormalized; q/k norms over each token's whole Q and K."""
    return ModelConfig(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=None, eos_token_ids=[50279], torch_dtype="bfloat16",
        architecture="OlmoeForCausalLM", num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        moe_intermediate_size=1024,
    )


# --dummy-weights names -> the config of that model's shapes
PRESETS = {"llama-3.1-8b": llama_3_1_8b_config, "qwen2.5-7b": qwen2_5_7b_config, "llama-3.2-1b": llama_3_2_1b_config,
           "smollm2-135m": smollm2_135m_config, "gemma-2-2b": gemma_2_2b_config, "gemma-3-1b": gemma_3_1b_config,
           "phi-3.5-mini": phi_3_5_mini_config, "qwen3-30b-a3b": qwen3_30b_a3b_config,
           "mixtral-8x7b": mixtral_8x7b_config, "olmoe-1b-7b": olmoe_1b_7b_config, "tiny": tiny_config}


def _init_scale(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a random tensor: std 1/sqrt(fan_in) so activations and logits stay O(1); norm gains 1 + small
    noise; Qwen2's Q/K/V biases as large as the projections' outputs."""
    if name.endswith(".bias"):
        return 0.0, 0.5
    if len(shape) == 1:
        return 1.0, 0.1
    return 0.0, 1.0 / math.sqrt(shape[1])


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights, std 1/sqrt(fan_in) so activations and logits stay O(1); norm gains 1 + small noise."""
    rng = np.random.default_rng(seed)
    weights, tied = {}, tied_copies(config)
    for name, shape in weight_shapes(config).items():
        if name in tied:
            continue
        mean, std = _init_scale(name, shape)
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= np.float32(std)
        weights[name] = w + np.float32(mean) if mean else w
    for name, source in tied.items():
        weights[name] = weights[source]
    return weights


def lowbias32(x: np.ndarray) -> np.ndarray:
    """Chris Wellons' lowbias32 integer hash of uint32 values, in place (and returned). Twin: cuda/random.cu."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def _hash32(value: int) -> int:
    return int(lowbias32(np.array([value & 0xFFFFFFFF], np.uint32))[0])


@dataclass(frozen=True)
class RandomRecipe:
    """How one tensor of RandomBf16Weights is made, value i of its flattened `size`: table[bits(i) >> 16] with
    bits(i) = lowbias32(lowbias32(i + k1) ^ k2) (uint32 arithmetic), table 2^16 bf16 bit patterns. A counter-based
    hash: any range of a tensor is made alone, the same on the host, by the GPU (cuda/random.cu) and by torch
    (bench/hf_peers.py)."""

    table: np.ndarray
    k1: int
    k2: int
    size: int


class RandomBf16Weights(LazyWeights):
    """Random bf16 weights of a config's shapes, each tensor made when asked for (`stored`: bit patterns, what the
    CUDA backend uploads as they are; `[name]`: float32), so that an 8B model costs no float32 copy and no host copy
    of the whole model. A tensor is the same on every call and in every process (its hash keys come from `seed` and
    its name): bench/hf_peers.py rebuilds the model tinyvllm runs.

    Each value is a pick among 2^16 normal samples scaled as random_weights scales them (_init_scale), by a hash of
    its index (recipe): a table lookup per value, on the host in parallel chunks, or on the GPU where a 61 GB model
    takes a fraction of a second (the cuda backend and bench/hf_peers.py make these weights there)."""

    CHUNK = 1 << 20  # values per host task; a tensor is the same whatever the chunking

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed
        self.shapes = weight_shapes(config)
        self.tied = tied_copies(config)
        self._tables: dict[tuple[float, float], np.ndarray] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def table(self, mean: float, std: float) -> np.ndarray:
        """The 2^16 bf16 bit patterns of the tensors scaled (mean, std): the seed's normal samples, scaled."""
        key = (mean, std)
        if key not in self._tables:
            normal = np.random.default_rng([self.seed, 1 << 16]).standard_normal(1 << 16, dtype=np.float32)
            self._tables[key] = f32_to_bf16(np.float32(mean) + np.float32(std) * normal)
        return self._tables[key]

    def recipe(self, name: str) -> RandomRecipe:
        name = self.tied.get(name, name)
        shape = self.shapes[name]
        size = math.prod(shape)
        if size >= 1 << 32:
            raise ValueError(f"{name}: {size} values, more than a uint32 index of the hash reaches")
        k1 = _hash32(zlib.crc32(name.encode()) ^ _hash32(self.seed + 0x9E3779B9))
        return RandomRecipe(self.table(*_init_scale(name, shape)), k1, _hash32(k1 ^ 0x85EBCA6B), size)

    def stored(self, name: str) -> np.ndarray:
        recipe = self.recipe(name)
        out = np.empty(recipe.size, np.uint16)

        def fill(chunk: int) -> None:
            start = chunk * self.CHUNK
            part = out[start:start + self.CHUNK]
            x = np.arange(start, start + part.size, dtype=np.uint32)
            x += np.uint32(recipe.k1)
            lowbias32(x)
            x ^= np.uint32(recipe.k2)
            part[:] = recipe.table[lowbias32(x) >> np.uint32(16)]

        chunks = range(-(-out.size // self.CHUNK))
        if len(chunks) == 1:
            fill(0)
        else:  # numpy's arithmetic and fancy indexing release the GIL
            with ThreadPoolExecutor(min(len(chunks), os.cpu_count() or 1, 16)) as pool:
                list(pool.map(fill, chunks))
        return out.reshape(self.shapes[self.tied.get(name, name)])

    def __getitem__(self, name: str) -> np.ndarray:
        return bf16_to_f32(self.stored(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def save_hf_model_dir(
    path: str | os.PathLike, config: ModelConfig, weights: Mapping[str, np.ndarray], dtype: str = "float32",
    shards: int = 1,
) -> Path:
    """Write an HF-style model dir (config, safetensors, byte-level BPE tokenizer, ChatML template).

    `dtype` is the storage dtype of the safetensors; `shards` > 1 writes model-0000i-of-0000n files + index.
    RandomBf16Weights saved as bfloat16 are written as made, one tensor at a time (an 8B checkpoint in seconds)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = replace(config, torch_dtype=dtype)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))

    tied = tied_copies(config)
    names = [k for k in weights if k not in tied]
    if isinstance(weights, RandomBf16Weights) and dtype == "bfloat16":
        def write(file: Path, part: list[str]) -> None:
            write_bf16_safetensors(file, weights, part)
    else:
        def write(file: Path, part: list[str]) -> None:
            write_safetensors(file, {k: weights[k] for k in part}, dtype)
    if shards == 1:
        write(path / "model.safetensors", names)
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            write(path / file, part)
            weight_map |= dict.fromkeys(part, file)
        sizes = [math.prod(weights.shape(k)) if isinstance(weights, LazyWeights) else weights[k].size for k in names]
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    write_tokenizer(path, config.vocab_size)
    return path


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A model dir's byte-level BPE tokenizer of vocab_size ids and its config (ChatML template)."""
    build_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    tok_config = {"bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "add_bos_token": False,
                  "chat_template": CHATML_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def write_bf16_safetensors(path: str | os.PathLike, weights: RandomBf16Weights, names: list[str]) -> None:
    """One safetensors file of the named tensors in bfloat16, each made while the one before is written."""
    header, offset = {}, 0
    for name in names:
        nbytes = 2 * math.prod(weights.shape(name))
        header[name] = {"dtype": "BF16", "shape": list(weights.shape(name)), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # tensor data 8-byte aligned, as the format asks
    with open(path, "wb") as f, ThreadPoolExecutor(1) as ahead:
        f.write(struct.pack("<Q", len(head)) + head)
        pending = ahead.submit(weights.stored, names[0]) if names else None
        for following in [*names[1:], None]:  # two tensors on the host at a time: one written, one being made
            tensor = pending.result()
            pending = ahead.submit(weights.stored, following) if following else None
            tensor.astype("<u2", copy=False).tofile(f)


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
