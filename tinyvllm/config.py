"""The engine's settings, in one place: `EngineConfig`.

`LLM(model, **kwargs)` builds one from its keyword arguments (as nano-vllm builds its Config) and passes it whole to
the engine, scheduler, block manager and backend. The job layer holds one too, and derives its CLI flags and job-file
keys from the fields below, so a setting added here reaches the Python API, the CLI, job files, Ray replicas and the
output's metadata. Each field's checks run in `__post_init__`: a bad value is a SettingError (a ValueError) naming the
field, wherever it came from.

This module imports nothing of tinyvllm: it is the bottom of the import graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

BACKENDS = ("auto", "numpy", "cuda")
BATCHING_POLICIES = ("continuous", "static")
GRAPH_CAPTURES = ("lazy", "eager")
DTYPES = ("auto", "float32", "bfloat16")  # each backend computes in one: numpy float32, cuda bfloat16
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's spellings of e4m3; e5m2 is not implemented
INT32_MAX = 2**31 - 1  # sizes end up in int32 arrays and kernel arguments


class SettingError(ValueError):
    """A setting's value is invalid, or one the model or the machine cannot meet (e.g. max_model_len)."""


def setting(default, help: str, *, choices: tuple[str, ...] | None = None, low: float | None = None,
            high: float | None = None, low_open: bool = False):
    """A dataclass field with what the checks, the CLI and job files need to know about it. `low`/`high` bound a
    number (`low_open`: strictly above `low`); `choices` lists a string's allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices, "low": low, "high": high,
                                            "low_open": low_open})


def check_settings(obj) -> None:
    """Check every `setting()` field of a dataclass instance against its type and bounds; ValueError names it."""
    hints = {f.name: f.type for f in dataclasses.fields(obj)}
    for f in dataclasses.fields(obj):
        if "help" not in f.metadata:
            continue
        value, meta, kind = getattr(obj, f.name), f.metadata, setting_type(hints[f.name])
        if value is None and "None" in str(hints[f.name]):
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            setattr(obj, f.name, value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise SettingError(f"invalid {f.name}={value!r}: must be {_type_words(kind)}")
        if meta["choices"] is not None and value not in meta["choices"]:
            raise SettingError(f"invalid {f.name}={value!r}: choose {', '.join(meta['choices'])}")
        low, high = meta["low"], meta["high"]
        if kind in (int, float) and value != value:  # NaN
            raise SettingError(f"invalid {f.name}={value!r}: must be a number")
        if low is not None and (value < low or (meta["low_open"] and value == low)):
            raise SettingError(f"invalid {f.name}={value!r}: must be {'>' if meta['low_open'] else '>='} {low}")
        if high is not None and value > high:
            raise SettingError(f"invalid {f.name}={value!r}: must be <= {high}")


def setting_type(annotation) -> type:
    """The base type of a setting's annotation ("int | None" -> int)."""
    text = str(annotation)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.split(" | ")[0] == name:
            return kind
    raise TypeError(f"unsupported setting type {text}")


def _type_words(kind: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]


@dataclass
class EngineConfig:
    backend: str = setting("auto", "numpy (CPU reference), cuda, or auto: cuda when a GPU is usable",
                           choices=BACKENDS)
    batching: str = setting("continuous", "continuous: admit requests as room frees; static: whole batches",
                            choices=BATCHING_POLICIES)
    max_num_seqs: int = setting(256, "sequences per step", low=1, high=65536)
    max_num_batched_tokens: int = setting(8192, "tokens per step", low=1, high=1 << 20)
    block_size: int = setting(16, "KV cache block size in tokens", low=1, high=1024)
    max_model_len: int | None = setting(None, "longest sequence, prompt + output [default: the model's]",
                                        low=2, high=INT32_MAX)
    num_kv_blocks: int | None = setting(None, "KV cache size in blocks [default: from the memory budget]",
                                        low=1, high=INT32_MAX)
    gpu_memory_utilization: float = setting(0.9, "cuda: share of GPU memory for weights + KV cache",
                                            low=0.0, high=1.0, low_open=True)
    cpu_kv_cache_gib: float = setting(2.0, "numpy: memory for the KV cache, in GiB", low=0.0, high=1 << 20,
                                      low_open=True)
    seed: int = setting(0, "the engine's seed; in a job, rows without a seed get one from it and their row number",
                        low=0, high=2**63 - 1)
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = setting(True, "split long prompts over steps so decodes keep running")
    dtype: str = setting("auto", "compute dtype; auto: the backend's own (numpy float32, cuda bfloat16), "
                         "others must match it", choices=DTYPES)
    kv_cache_dtype: str = setting("auto", "KV cache dtype; auto: the compute dtype; fp8 (= fp8_e4m3): e4m3 with a "
                                  "scale per layer and KV head, half the bytes of bf16", choices=KV_CACHE_DTYPES)
    enforce_eager: bool = setting(False, "cuda: run every step eagerly, without CUDA graphs")
    max_logprobs: int | None = setting(None, "most logprobs (or prompt logprobs) a request may ask per token; a "
                                       "request asking more fails (vLLM's; -1: no limit) [default: the backend's "
                                       "limit, cuda 64]", low=-1, high=INT32_MAX)
    # lazy by default: its thread keeps the ~4 ms a graph off the engine's thread (W1 and W3 within 1% of eager on
    # the H200, 2026-12-01, docs/PERFORMANCE.md), and start-up does not wait for 66 captures.
    cuda_graph_capture: str = setting("lazy", "cuda: capture every batch size's decode graph at start-up (eager), "
                                      "or batch 1's at start-up and the rest on a thread while the engine runs, "
                                      "the sizes steps meet first (lazy)", choices=GRAPH_CAPTURES)

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def cpu_kv_cache_bytes(self) -> int:
        return int(self.cpu_kv_cache_gib * (1 << 30))

    def for_model(self, max_position_embeddings: int) -> EngineConfig:
        """This config with max_model_len resolved against the model's (checked to fit)."""
        if self.max_model_len is None:
            return dataclasses.replace(self, max_model_len=max_position_embeddings)
        if self.max_model_len > max_position_embeddings:
            raise SettingError(f"invalid max_model_len={self.max_model_len}: the model supports up to "
                             f"{max_position_embeddings} positions")
        return self

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> EngineConfig:
        """An EngineConfig from keyword arguments; TypeError names any that is not a field."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        return cls(**kwargs)
