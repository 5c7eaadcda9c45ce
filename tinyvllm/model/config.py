"""ModelConfig: the hyperparameters tinyvllm needs (Llama, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2 and 3, and the
mixture-of-experts Mixtral, Qwen3-MoE and OLMoE), read from HF config.json."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from tinyvllm.model.fp8 import Fp8Scheme, fp8_scheme


class Family(NamedTuple):
    """What a model family changes in the Llama decoder layer; the backends branch on these flags, not on names."""

    model_type: str
    attention_bias: bool  # biases on the Q, K and V projections (not on O)
    qk_norm: bool  # a per-head RMSNorm on Q and on K before RoPE
    # llama.cpp stores the Q/K rows interleaved per head (its rotate-pairs RoPE): a GGUF file's are un-permuted
    gguf_permute_qk: bool
    sandwich_norms: bool = False  # RMSNorms of the attention's and the MLP's outputs too (Gemma 2 and 3)
    norm_offset: float = 0.0  # every RMSNorm multiplies by (norm_offset + weight): Gemma's 1
    scaled_embeddings: bool = False  # the embeddings times sqrt(hidden_size), rounded to the model's dtype (Gemma)
    # which layers attend over `sliding_window`: "all"; "pattern" (layer i unless (i + 1) % sliding_window_pattern
    # is 0, Gemma); "max_window_layers" (layers from max_window_layers on, where use_sliding_window is set, Qwen)
    window_layers: str = "all"
    sliding_window_pattern: int = 0  # the default of the config key of that name
    text_config: bool = False  # the decoder's hyperparameters are the config's text_config (a multimodal wrapper)
    defaults: tuple[tuple[str, object], ...] = ()  # what HF's config class assumes for a key its config.json omits
    # mixture of experts: the config.json key counting the experts (None: a dense family)
    num_experts_key: str | None = None
    norm_topk_prob: bool | None = None  # fixed by the family (Mixtral renormalizes its top-k); None: config.json's
    qk_norm_per_head: bool = True  # False: the q/k norms span the whole projection, all heads at once (OLMoE)


GEMMA_DEFAULTS = (("hidden_activation", "gelu_pytorch_tanh"), ("query_pre_attn_scalar", 256),
                  ("tie_word_embeddings", True), ("rms_norm_eps", 1e-6))
GEMMA3_DEFAULTS = (*GEMMA_DEFAULTS, ("vocab_size", 262208), ("hidden_size", 2304), ("intermediate_size", 9216),
                   ("num_hidden_layers", 26), ("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256),
                   ("max_position_embeddings", 131072), ("rope_theta", 1e6), ("rope_local_base_freq", 10000.0),
                   ("sliding_window", 4096))
_GEMMA = dict(gguf_permute_qk=False, sandwich_norms=True, norm_offset=1.0, scaled_embeddings=True,
              window_layers="pattern")
# HF architecture -> its family. Each family's checkpoint tensors are in model/layout.py (LAYOUTS, by model_type).
FAMILIES = {
    "LlamaForCausalLM": Family("llama", attention_bias=False, qk_norm=False, gguf_permute_qk=True),
    "MistralForCausalLM": Family("mistral", attention_bias=False, qk_norm=False, gguf_permute_qk=True),
    "Qwen2ForCausalLM": Family("qwen2", attention_bias=True, qk_norm=False, gguf_permute_qk=False,
                               window_layers="max_window_layers"),
    "Qwen3ForCausalLM": Family("qwen3", attention_bias=False, qk_norm=True, gguf_permute_qk=False,
                               window_layers="max_window_layers"),
    "Phi3ForCausalLM": Family("phi3", attention_bias=False, qk_norm=False, gguf_permute_qk=False),
    "Gemma2ForCausalLM": Family("gemma2", attention_bias=False, qk_norm=False, sliding_window_pattern=2,
                                defaults=(*GEMMA_DEFAULTS, ("attn_logit_softcapping", 50.0),
                                          ("final_logit_softcapping", 30.0)), **_GEMMA),
    "Gemma3ForCausalLM": Family("gemma3_text", attention_bias=False, qk_norm=True, sliding_window_pattern=6,
                                defaults=GEMMA3_DEFAULTS, **_GEMMA),
    # Its language model only: the vision tower's tensors are skipped, and no image reaches it.
    "Gemma3ForConditionalGeneration": Family("gemma3", attention_bias=False, qk_norm=True, sliding_window_pattern=6,
                                             text_config=True, defaults=GEMMA3_DEFAULTS, **_GEMMA),
    "MixtralForCausalLM": Family("mixtral", attention_bias=False, qk_norm=False, gguf_permute_qk=True,
                                 num_experts_key="num_local_experts", norm_topk_prob=True),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", attention_bias=False, qk_norm=True, gguf_permute_qk=False,
                                  num_experts_key="num_experts", window_layers="max_window_layers"),
    "OlmoeForCausalLM": Family("olmoe", attention_bias=False, qk_norm=True, gguf_permute_qk=False,
                               num_experts_key="num_experts", qk_norm_per_head=False),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # of the MLP's gate: SwiGLU, or GeGLU with tanh-approximated GELU
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("bfloat16", "float16", "float32")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
LONGROPE_KEYS = ("short_factor", "long_factor", "original_max_position_embeddings")
# (low, high) of each size: the highs are far above any real Llama, so that a corrupt or hostile config fails here,
# before anything is sized from it (a num_hidden_layers of 1e9 would allocate gigabytes, then fail).
DIMENSIONS = {"vocab_size": (1, 1 << 24), "hidden_size": (1, 1 << 17), "intermediate_size": (1, 1 << 20),
              "num_hidden_layers": (1, 1 << 12), "num_attention_heads": (1, 1 << 12),
              "num_key_value_heads": (1, 1 << 12), "head_dim": (1, 1 << 12), "max_position_embeddings": (2, 1 << 24)}
MOE_DIMENSIONS = {"num_experts": (1, 1 << 12), "moe_intermediate_size": (1, 1 << 20), "decoder_sparse_step": (1, 1 << 12)}
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size", "decoder_sparse_step",
              "mlp_only_layers")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or normalized llama3 / longrope / linear parameters (normalize_rope_scaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    architecture: str = "LlamaForCausalLM"  # a key of FAMILIES
    # how many positions a sliding layer's query sees (itself and those before it); None: all before it
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # each layer's, of LAYER_TYPES; None: every layer slides (if windowed)
    partial_rotary_factor: float = 1.0  # the fraction of each head's dimensions RoPE rotates (the first ones)
    local_rope_theta: float | None = None  # the sliding layers' RoPE base, unscaled (Gemma 3); None: rope_theta
    activation: str = "silu"  # of ACTIVATIONS
    attn_logit_softcapping: float | None = None  # attention scores become cap * tanh(score / cap)
    final_logit_softcapping: float | None = None  # and so do the logits
    query_pre_attn_scalar: float | None = None  # attention scores are scaled by its -1/2 power; None: head_dim's
    quantization: Fp8Scheme | None = None  # an FP8 checkpoint's quantization_config; None: unquantized weights
    # mixture of experts (num_experts 0: a dense model): each token's MLP is the weighted sum of the
    # num_experts_per_tok experts its router scores highest (softmax probabilities, renormalized over the chosen
    # ones where norm_topk_prob), each an MLP of moe_intermediate_size; layer i is sparse unless it is one of
    # mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step (Qwen3-MoE's dense layers)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in FAMILIES:
            raise ValueError(f"unsupported architecture {self.architecture!r}: supported are {', '.join(FAMILIES)}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"invalid sliding_window={window!r:.40} in the model config: must be a positive integer")
        for name in DIMENSIONS:
            check_dimension(name, getattr(self, name))
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"invalid {name}={value!r:.40}: must be a finite number > 0")
        ids = self.eos_token_ids + ([] if self.bos_token_id is None else [self.bos_token_id])
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"invalid bos_token_id / eos_token_id {bad[0]!r:.40} in the model config: not a token "
                             f"id of the vocabulary (vocab_size {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"unsupported torch_dtype {self.torch_dtype!r} (expected one of {DTYPES})")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        self._check_family_fields()
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.family.norm_topk_prob is not None:  # the family's router decides, whatever the config says
            self.norm_topk_prob = self.family.norm_topk_prob
        self.check_experts()

    def _check_family_fields(self) -> None:
        """ValueError for a value of the fields Phi-3 and Gemma add that no forward can run."""
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {self.activation!r:.40}: supported are "
                             f"{', '.join(ACTIVATIONS)}")
        types = self.layer_types
        if types is not None and (len(types) != self.num_hidden_layers or not set(types) <= set(LAYER_TYPES)):
            raise ValueError(f"invalid layer_types {list(types)!r:.80}: one of {LAYER_TYPES} per layer")
        factor = self.partial_rotary_factor
        if not isinstance(factor, (int, float)) or not 0 < factor <= 1 or int(self.head_dim * factor) % 2:
            raise ValueError(f"invalid partial_rotary_factor={factor!r:.40}: must be in (0, 1] and rotate an even "
                             f"number of the {self.head_dim} dimensions of a head")
        for name in ("local_rope_theta", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"invalid {name}={value!r:.40}: must be a finite number > 0 (or null)")
        half = self.rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            if self.rope_scaling and len(self.rope_scaling.get(key, [0] * half)) != half:
                raise ValueError(f"longrope {key} has {len(self.rope_scaling[key])} entries: the rotated "
                                 f"{self.rotary_dim} dimensions of a head need {half}")

    def check_experts(self) -> None:
        """ValueError for experts a family does not have, or sizes out of range."""
        if not self.num_experts and self.family.num_experts_key is None:
            return
        if self.family.num_experts_key is None:
            raise ValueError(f"{self.architecture} has no experts: num_experts={self.num_experts} in its config")
        for name in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
            check_dimension(name, getattr(self, name))
        k = self.num_experts_per_tok
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_experts:
            raise ValueError(f"invalid num_experts_per_tok={k!r:.40} in the model config: must be an integer in "
                             f"[1, num_experts={self.num_experts}]")
        bad = [i for i in self.mlp_only_layers
               if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"invalid mlp_only_layers entry {bad[0]!r:.40} in the model config: not a layer index")

    def moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the experts (else the dense MLP of intermediate_size)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def attention_bias(self) -> bool:
        return self.family.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    @property
    def qk_norm_per_head(self) -> bool:
        return self.family.qk_norm_per_head

    @property
    def rotary_dim(self) -> int:
        """How many of a head's dimensions (the first ones) RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def norm_offset(self) -> float:
        return self.family.norm_offset

    @property
    def sandwich_norms(self) -> bool:
        return self.family.sandwich_norms

    @property
    def embed_scale(self) -> float:
        """What the embeddings are multiplied by (a backend rounds it to its compute dtype, as HF does)."""
        return math.sqrt(self.hidden_size) if self.family.scaled_embeddings else 1.0

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it attends over the whole context)."""
        types = self.layer_types or ("sliding_attention",) * self.num_hidden_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in types]

    def ops_beyond_llama(self, max_model_len: int | None) -> list[str]:
        """What a sequence of max_model_len tokens (None: the model's longest) needs beyond the decoder the cuda
        backend runs (Llama's, with sliding windows, soft-capped attention logits, query_pre_attn_scalar, LongRoPE,
        partial rotary dimensions and a second RoPE base): the operations only the numpy backend implements."""
        named = {f"{self.rotary_dim} rotary dimensions (not a multiple of 8)": self.rotary_dim % 8 != 0}
        return [name for name, needed in named.items() if needed]

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        arch, family = _architecture(d)
        d = _decoder_dict(d, family)
        _check_unsupported(d, arch, family)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if d.get(k) is None]
        if missing:
            raise ValueError(f"config is missing required fields {missing}")
        for name in ("hidden_size", "num_attention_heads", "num_hidden_layers"):  # head_dim etc. are computed
            check_dimension(name, d[name])
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        dtype = str(d.get("torch_dtype") or d.get("dtype") or "float32").removeprefix("torch.")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=_as_float("rms_norm_eps", d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(eos),
            torch_dtype=dtype,
            architecture=arch,
            activation=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            **_rope_fields(d),
            **window_fields(d, family),
            quantization=fp8_scheme(d.get("quantization_config")),
            **_moe_fields(d, family),
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        d = read_json_object(config_file)
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen = read_json_object(gen_file)
            # generation_config.json is what HF generate() stops on: its eos ids extend config.json's.
            eos = _as_id_list(d.get("eos_token_id"))
            d["eos_token_id"] = eos + [i for i in _as_id_list(gen.get("eos_token_id")) if i not in eos]
            if d.get("bos_token_id") is None:
                d["bos_token_id"] = gen.get("bos_token_id")
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict:
        """config.json as hub checkpoints carry it (rope_theta + rope_scaling)."""
        eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        return {
            "architectures": [self.architecture],
            "model_type": self.family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.activation,
            "hidden_activation": self.activation,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos if self.eos_token_ids else None,
            "torch_dtype": self.torch_dtype,
            "sliding_window": self.sliding_window,
            **({"quantization_config": self.quantization.config} if self.quantization else {}),
            **({"layer_types": [LAYER_TYPES[w is not None] for w in self.layer_windows]} if self.sliding_window
               else {}),
            "use_sliding_window": self.sliding_window is not None,
            "max_window_layers": 0,
            "partial_rotary_factor": self.partial_rotary_factor,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
            **({"rope_local_base_freq": self.local_rope_theta} if self.local_rope_theta else {}),
            **({"query_pre_attn_scalar": self.query_pre_attn_scalar} if self.query_pre_attn_scalar else {}),
            **({"original_max_position_embeddings": self.rope_scaling["original_max_position_embeddings"]}
               if self.rope_scaling and "original_max_position_embeddings" in self.rope_scaling else {}),
        } | self._moe_hf_dict()

    def _moe_hf_dict(self) -> dict:
        if not self.num_experts:
            return {}
        out = {name: getattr(self, name) for name in MOE_FIELDS if name != "num_experts"}
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        return out | {self.family.num_experts_key: self.num_experts}


def _moe_fields(d: dict, family: Family) -> dict:
    """The ModelConfig MoE fields of a config.json (none for a dense family). The expert MLP's width is
    moe_intermediate_size where the config has one (Qwen3-MoE), intermediate_size elsewhere."""
    if family.num_experts_key is None:
        return {}
    norm = family.norm_topk_prob
    layers = d.get("mlp_only_layers") or []
    if not isinstance(layers, list):
        raise ValueError(f"invalid mlp_only_layers={layers!r:.40} in the model config: must be a list of layers")
    return {"num_experts": d.get(family.num_experts_key), "num_experts_per_tok": d.get("num_experts_per_tok"),
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)) if norm is None else norm,
            "moe_intermediate_size": d.get("moe_intermediate_size") or d["intermediate_size"],
            "decoder_sparse_step": d.get("decoder_sparse_step", 1), "mlp_only_layers": tuple(layers)}


def normalize_rope_scaling(rs: dict | None) -> dict | None:
    """None for plain RoPE; {"rope_type": "llama3", <LLAMA3_KEYS>} for Llama 3.1+ scaling; {"rope_type": "linear",
    "factor"}; {"rope_type": "longrope", <LONGROPE_KEYS>, and "factor" / "attention_factor" where given} (Phi-3's
    "su" and "longrope"); ValueError otherwise."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    keys = {"llama3": LLAMA3_KEYS, "longrope": LONGROPE_KEYS, "su": LONGROPE_KEYS, "linear": ("factor",)}.get(kind)
    if keys is None:
        raise ValueError(f"unsupported rope type {kind!r}: supported are 'default', 'llama3', 'linear' and 'longrope'")
    missing = [k for k in keys if rs.get(k) is None]
    if missing:
        raise ValueError(f"{kind} rope scaling is missing {missing}")
    if keys is LONGROPE_KEYS:
        out: dict = {"rope_type": "longrope", "short_factor": [_as_float("short_factor", x) for x in rs["short_factor"]],
                     "long_factor": [_as_float("long_factor", x) for x in rs["long_factor"]]}
        out |= {k: _as_float(k, rs[k]) for k in ("factor", "attention_factor") if rs.get(k) is not None}
    else:
        out = {"rope_type": kind, **{k: _as_float(k, rs[k]) for k in keys if k != "original_max_position_embeddings"}}
    if "original_max_position_embeddings" in keys:
        out["original_max_position_embeddings"] = int(rs["original_max_position_embeddings"])
    return out


def _architecture(d: dict) -> tuple[str, Family]:
    archs = d.get("architectures") or ["LlamaForCausalLM"]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in FAMILIES:
        raise ValueError(f"unsupported architectures {archs!r:.80}: supported are {', '.join(FAMILIES)}")
    family = FAMILIES[archs[0]]
    if d.get("model_type", family.model_type) != family.model_type:
        raise ValueError(f"model_type {d['model_type']!r:.40} does not match {archs[0]} "
                         f"(expected {family.model_type!r})")
    return archs[0], family


def _decoder_dict(d: dict, family: Family) -> dict:
    """The decoder's hyperparameters (a multimodal config's text_config, with its token ids), with the defaults of
    the family's HF config class filled in."""
    if family.text_config:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("this multimodal config has no text_config object")
        d = {**{k: d[k] for k in ("bos_token_id", "eos_token_id", "torch_dtype", "dtype") if k in d}, **text}
    return {**dict(family.defaults), **d}


def _check_unsupported(d: dict, arch: str, family: Family) -> None:
    """Features HF supports in these families but tinyvllm does not: refuse rather than compute something else.
    Qwen2's Q/K/V biases are always on; elsewhere attention_bias would also put a bias on O."""
    required = {"mlp_bias": False, "use_bidirectional_attention": False}
    if not family.attention_bias:
        required["attention_bias"] = False
    for key, ok in required.items():
        if (d.get(key) or False) != ok:
            raise ValueError(f"unsupported {key}={d[key]!r:.40} in this {arch} config (tinyvllm requires {ok!r})")
    if d.get("clip_qkv") is not None:  # OLMoE's optional clamp of Q, K and V
        raise ValueError(f"unsupported clip_qkv={d['clip_qkv']!r:.40} in this {arch} config (tinyvllm requires None)")
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r:.40} in this {arch} config: supported are "
                         f"{', '.join(ACTIVATIONS)}")


def _rope_fields(d: dict) -> dict:
    """rope_theta, rope_scaling, partial_rotary_factor and local_rope_theta of a config, from hub checkpoints' keys
    or transformers>=5's `rope_parameters` (one dict, or one per layer type)."""
    rope, local = d.get("rope_parameters"), d.get("rope_local_base_freq")
    if isinstance(rope, dict) and "full_attention" in rope:
        sliding = rope.get("sliding_attention") or {}
        if normalize_rope_scaling(sliding) is not None:
            raise ValueError(f"unsupported rope_parameters {sliding!r:.80} of the sliding layers (only unscaled)")
        local, rope = sliding.get("rope_theta", local), rope["full_attention"]
    if rope is not None:
        if not isinstance(rope, dict) or "rope_theta" not in rope:
            raise ValueError(f"unsupported rope_parameters {rope!r:.80}")
        theta, scaling = rope["rope_theta"], rope
    else:
        theta, scaling = d.get("rope_theta", 10000.0), d.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("original_max_position_embeddings") is None \
            and d.get("original_max_position_embeddings") is not None:
        scaling = {**scaling, "original_max_position_embeddings": d["original_max_position_embeddings"]}
    partial = (scaling or {}).get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0
    return {"rope_theta": _as_float("rope_theta", theta), "rope_scaling": scaling,
            "partial_rotary_factor": _as_float("partial_rotary_factor", partial),
            "local_rope_theta": None if local is None else _as_float("rope_local_base_freq", local)}


def window_fields(d: dict, family: Family) -> dict:
    """sliding_window and layer_types: which layers slide, by the family's rule (Family.window_layers) unless the
    config lists them."""
    window, n = d.get("sliding_window"), d["num_hidden_layers"]
    if family.window_layers == "max_window_layers":  # Qwen configs carry a window only use_sliding_window turns on
        if not d.get("use_sliding_window"):
            return {"sliding_window": None, "layer_types": None}
        start = d.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    elif family.window_layers == "pattern":
        pattern = d.get("sliding_window_pattern") or family.sliding_window_pattern
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    else:
        types = None
    if d.get("layer_types") is not None and types is not None:  # HF's Mistral and Phi-3 ignore layer_types
        types = d["layer_types"]
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": window, "layer_types": None if types is None else tuple(types)}


def check_dimension(name: str, value: object) -> None:
    """ValueError unless `value` is an integer within DIMENSIONS[name] (or MOE_DIMENSIONS[name])."""
    low, high = DIMENSIONS[name] if name in DIMENSIONS else MOE_DIMENSIONS[name]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"invalid {name}={value!r:.40} in the model config: must be an integer in [{low}, {high}]")


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object; ValueError naming the file otherwise."""
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, an integer too long, nesting too deep
        raise ValueError(f"{path} is not valid JSON: {str(e) or type(e).__name__}"[:300]) from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _as_float(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"invalid {name}={x!r:.40} in the model config: must be a number")
    return float(x)


def _as_id_list(x: object) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
