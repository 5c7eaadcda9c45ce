"""ModelConfig: the hyperparameters tinyvllm needs (Llama, Mistral, Qwen2/2.5, Qwen3, and the mixture-of-experts
Mixtral, Qwen3-MoE and OLMoE), read from HF config.json."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple


class Family(NamedTuple):
    """What a model family changes in the Llama decoder layer; the backends branch on these flags, not on names."""

    model_type: str
    attention_bias: bool  # biases on the Q, K and V projections (not on O)
    qk_norm: bool  # a per-head RMSNorm on Q and on K before RoPE
    # llama.cpp stores the Q/K rows interleaved per head (its rotate-pairs RoPE): a GGUF file's are un-permuted
    gguf_permute_qk: bool
    # mixture of experts: the config.json key counting the experts (None: a dense family)
    num_experts_key: str | None = None
    norm_topk_prob: bool | None = None  # fixed by the family (Mixtral renormalizes its top-k); None: config.json's
    qk_norm_per_head: bool = True  # False: the q/k norms span the whole projection, all heads at once (OLMoE)


# HF architecture -> its family. Mistral is Llama with a sliding window (refused unless it never slides). Each
# family's checkpoint tensors are in model/layout.py (LAYOUTS, by model_type).
FAMILIES = {
    "LlamaForCausalLM": Family("llama", attention_bias=False, qk_norm=False, gguf_permute_qk=True),
    "MistralForCausalLM": Family("mistral", attention_bias=False, qk_norm=False, gguf_permute_qk=True),
    "Qwen2ForCausalLM": Family("qwen2", attention_bias=True, qk_norm=False, gguf_permute_qk=False),
    "Qwen3ForCausalLM": Family("qwen3", attention_bias=False, qk_norm=True, gguf_permute_qk=False),
    "MixtralForCausalLM": Family("mixtral", attention_bias=False, qk_norm=False, gguf_permute_qk=True,
                                 num_experts_key="num_local_experts", norm_topk_prob=True),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", attention_bias=False, qk_norm=True, gguf_permute_qk=False,
                                  num_experts_key="num_experts"),
    "OlmoeForCausalLM": Family("olmoe", attention_bias=False, qk_norm=True, gguf_permute_qk=False,
                               num_experts_key="num_experts", qk_norm_per_head=False),
}
# the families a window may slide in (their config.json's sliding_window is read; elsewhere only a refused
# use_sliding_window turns one on)
WINDOWED = ("mistral", "mixtral")
DTYPES = ("bfloat16", "float16", "float32")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
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
    rope_scaling: dict | None = None  # None, or normalized llama3 parameters (see normalize_rope_scaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    architecture: str = "LlamaForCausalLM"  # a key of FAMILIES
    sliding_window: int | None = None  # attention span of a Mistral config; None: every position sees all before it
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
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.family.norm_topk_prob is not None:  # the family's router decides, whatever the config says
            self.norm_topk_prob = self.family.norm_topk_prob
        self.check_experts()

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

    def check_max_model_len(self, max_model_len: int | None) -> None:
        """ValueError when a sequence of max_model_len tokens (None: the model's longest) would need the sliding
        window, which tinyvllm does not implement."""
        if self.sliding_window is not None and self.sliding_window < (max_model_len or self.max_position_embeddings):
            raise ValueError(f"this {self.architecture} config attends over a sliding window of {self.sliding_window} "
                             f"tokens, which tinyvllm does not implement: set max_model_len <= {self.sliding_window}")

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in FAMILIES:
            raise ValueError(f"unsupported architectures {archs!r:.80}: supported are {', '.join(FAMILIES)}")
        arch = archs[0]
        family = FAMILIES[arch]
        if d.get("model_type", family.model_type) != family.model_type:
            raise ValueError(f"model_type {d['model_type']!r:.40} does not match {arch} "
                             f"(expected {family.model_type!r})")
        # Features HF supports in these families but tinyvllm's kernels do not: refuse rather than compute something
        # else. Qwen2's Q/K/V biases are always on; elsewhere attention_bias would also put a bias on O.
        required = {"hidden_act": "silu", "mlp_bias": False, "use_sliding_window": False, "clip_qkv": None}
        if not family.attention_bias:
            required["attention_bias"] = False
        for key, ok in required.items():
            if d.get(key, ok) != ok:
                raise ValueError(f"unsupported {key}={d[key]!r:.40} in this {arch} config (tinyvllm requires {ok!r})")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if d.get(k) is None]
        if missing:
            raise ValueError(f"config is missing required fields {missing}")
        for name in ("hidden_size", "num_attention_heads"):  # checked before head_dim is computed from them
            check_dimension(name, d[name])

        # transformers>=5 folds rope_theta and the scaling into `rope_parameters`; hub checkpoints keep them apart.
        rope = d.get("rope_parameters")
        if rope is not None:
            if "rope_theta" not in rope:
                raise ValueError(f"unsupported rope_parameters {rope!r} (per-layer-type rope is not Llama)")
            rope_theta, rope_scaling = rope["rope_theta"], rope
        else:
            rope_theta, rope_scaling = d.get("rope_theta", 10000.0), d.get("rope_scaling")
        if (rope_scaling or {}).get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("unsupported partial_rotary_factor: tinyvllm rotates the whole head")

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
            rope_theta=_as_float("rope_theta", rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(eos),
            torch_dtype=dtype,
            architecture=arch,
            # Qwen configs carry a sliding_window that only use_sliding_window (refused above) turns on.
            sliding_window=d.get("sliding_window") if family.model_type in WINDOWED else None,
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
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos if self.eos_token_ids else None,
            "torch_dtype": self.torch_dtype,
            "sliding_window": self.sliding_window,
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
    """None for plain RoPE; {"rope_type": "llama3", <LLAMA3_KEYS>} for Llama 3.1+ scaling; ValueError otherwise."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope type {kind!r}: only 'default' and 'llama3' are supported")
    missing = [k for k in LLAMA3_KEYS if k not in rs]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {missing}")
    out: dict = {"rope_type": "llama3"}
    out.update({k: float(rs[k]) for k in LLAMA3_KEYS[:3]})
    out["original_max_position_embeddings"] = int(rs["original_max_position_embeddings"])
    return out


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
