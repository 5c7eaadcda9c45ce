"""The engine's settings, in one place: `EngineConfig`; and `setting()`, the declaration every settings dataclass
(EngineConfig, SamplingParams, the job's JobConfig and RayConfig) gives its fields.

`LLM(model, **kwargs)` builds an EngineConfig from its keyword arguments (as nano-vllm builds its Config) and passes
it whole to the engine, scheduler, block manager and backend. A `setting()` field declares what every surface needs:
its type (the annotation), default, bounds or choices and help; its CLI flag; whether it is a job-file key; and, for
SamplingParams, whether a row of a job's input may set it. From that one declaration come the checks
(`check_settings`, run in `__post_init__`: a bad value is a SettingError, a ValueError, naming the field, wherever it
came from), the CLI flags (cli.py), the job-file keys and their TOML types (jobs/file.py), the readers' coercion
(io/readers.py) and the README's tables (checked by tests/test_settings_docs.py).

Types a setting may have: bool, int, float, str (optionally `| None`); `list[X]` of those (a string item must be
non-empty; the bounds apply to each item); `str | list[str]` (one string stands for a list of one);
`dict[int, X]` (keys are token ids, integers >= 0; the bounds apply to the values); or a class of its own, declared
`own_type=True`, which converts and checks itself.

This module imports nothing of tinyvllm: it is the bottom of the import graph.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable

BACKENDS = ("auto", "numpy", "cuda")
BATCHING_POLICIES = ("continuous", "static")
GRAPH_CAPTURES = ("lazy", "eager")
DTYPES = ("auto", "float32", "bfloat16")  # each backend computes in one: numpy float32, cuda bfloat16
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's spellings of e4m3; e5m2 is not implemented
QUANTIZATIONS = ("fp8",)  # vLLM's names of the weight quantizations implemented
INT32_MAX = 2**31 - 1  # sizes end up in int32 arrays and kernel arguments
SCALARS = {"bool": bool, "int": int, "float": float, "str": str}


class SettingError(ValueError):
    """A setting's value is invalid, or one the model or the machine cannot meet (e.g. max_model_len)."""


def setting(default, help: str, *, choices: tuple[str, ...] | None = None, low: float | None = None,
            high: float | None = None, low_open: bool = False, also: tuple = (),
            check: Callable[[object], str | None] | None = None, flag: str | bool | None = None,
            job_key: bool = True, per_row: bool = False, own_type: bool = False):
    """A dataclass field with what the checks, the CLI, job files and input rows need to know about it.

    `low`/`high` bound a number (`low_open`: strictly above `low`); `also`: values allowed outside the bounds
    (temperature's 0); `choices` lists a string's allowed values; `check(value)` returns why a value that passed
    the rest is still invalid ("must be ..."), or None. `flag`: the CLI flag (None: --the-name; for a bool,
    "--on/--off" names both; False: no flag). `job_key`: a job file takes it. `per_row`: a row of a job's input may
    set it. `own_type`: the value's class converts and checks it (the generic checks skip it). A list or dict
    default is copied for each instance."""
    meta = {"help": help, "choices": choices, "low": low, "high": high, "low_open": low_open, "also": also,
            "check": check, "flag": flag, "job_key": job_key, "per_row": per_row, "own_type": own_type}
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Setting:
    """One `setting()` field of a dataclass, its annotation parsed."""

    name: str
    kind: type | None  # the scalar type (of a list's items, of a dict's values); None: an own_type class
    container: type | None  # list, dict or None (a scalar)
    optional: bool  # `| None`
    one_or_list: bool  # `str | list[str]`: a single item stands for a list of one
    field: dataclasses.Field

    @property
    def meta(self):
        return self.field.metadata

    @property
    def default(self):
        f = self.field
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@functools.cache
def settings(cls) -> tuple[Setting, ...]:
    """The `setting()` fields of a settings dataclass, in declaration order."""
    return tuple(_parse(f, str(f.type)) for f in dataclasses.fields(cls) if "help" in f.metadata)


def _parse(f: dataclasses.Field, annotation: str) -> Setting:
    parts = [p.strip() for p in annotation.split(" | ")]
    optional = "None" in parts
    parts = [p for p in parts if p != "None"]
    one_or_list = parts == ["str", "list[str]"]
    text = parts[-1] if one_or_list else parts[0]
    if f.metadata["own_type"]:
        return Setting(f.name, None, None, optional, False, f)
    container = list if text.startswith("list[") else dict if text.startswith("dict[") else None
    if container is list:
        text = text[len("list["):-1]
    elif container is dict:
        key, _, text = text[len("dict["):-1].partition(", ")
        if key != "int":
            raise TypeError(f"unsupported setting type {annotation} ({f.name}): dict keys are token ids, int")
    if len(parts) != 1 + one_or_list or text not in SCALARS:
        raise TypeError(f"unsupported setting type {annotation} ({f.name})")
    return Setting(f.name, SCALARS[text], container, optional, one_or_list, f)


def check_settings(obj) -> None:
    """Check every `setting()` field of a dataclass instance against its declaration (a float setting given an
    integer is made a float); SettingError names the first invalid one."""
    for s in settings(type(obj)):
        value = getattr(obj, s.name)
        if s.kind is None or (value is None and s.optional):
            continue
        value = _as_declared(value, s)
        setattr(obj, s.name, value)
        why = _problem(value, s)
        if why is None and s.meta["check"] is not None:
            why = s.meta["check"](value)
        if why is not None:
            raise SettingError(f"invalid {s.name}={value!r:.40}: {why}")


def _as_declared(value, s: Setting):
    """An integer where a float is declared, as a float (items and values too)."""
    if s.kind is not float:
        return value
    if s.container is None:
        return _float(value)
    if s.container is list and isinstance(value, list):
        return [_float(v) for v in value]
    if s.container is dict and isinstance(value, dict):
        return {k: _float(v) for k, v in value.items()}
    return value


def _float(value):
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # beyond float's range: left an int, it fails as "a number"
            return value
    return value


def _problem(value, s: Setting) -> str | None:
    """Why a value does not fit its setting's type and bounds ("must be ..."), or None."""
    meta = s.meta
    if s.container is None:
        return _scalar_problem(value, s.kind, meta)
    if s.container is list:
        items = [value] if s.one_or_list and isinstance(value, str) else value
        bad = not isinstance(items, list) or any(_scalar_problem(v, s.kind, meta) or v == "" for v in items)
        words = f"a list of {_plural(s.kind)}{_range_words(meta)}"
        return ("must be a string or " + words if s.one_or_list else "must be " + words) if bad else None
    bad = not isinstance(value, dict) or any(
        _scalar_problem(k, int, {**meta, "low": 0, "high": None, "low_open": False, "also": ()}) is not None
        or _scalar_problem(v, s.kind, meta) is not None for k, v in value.items())
    return f"must map token ids to {_plural(s.kind)}{_range_words(meta)}" if bad else None


def _scalar_problem(value, kind: type, meta) -> str | None:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        return f"must be {_type_words(kind)}"
    if meta["choices"] is not None and value not in meta["choices"]:
        return f"choose {', '.join(meta['choices'])}"
    if kind not in (int, float) or value in meta["also"]:
        return None
    low, high, alternatives = meta["low"], meta["high"], "".join(f" or {a}" for a in meta["also"])
    if value != value:  # NaN
        return "must be a number"
    if low is not None and (value < low or (meta["low_open"] and value == low)):
        return f"must be {'>' if meta['low_open'] else '>='} {low}{alternatives}"
    if high is not None and value > high:
        return f"must be <= {high}{alternatives}"
    return None


def _type_words(kind: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]


def _plural(kind: type) -> str:
    return {bool: "booleans", int: "integers", float: "numbers", str: "non-empty strings"}[kind]


def _range_words(meta) -> str:
    low, high = meta["low"], meta["high"]
    if low is not None and high is not None:
        return f" in {'(' if meta['low_open'] else '['}{low}, {high}]"
    if low is not None:
        return f" {'>' if meta['low_open'] else '>='} {low}"
    return f" <= {high}" if high is not None else ""


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
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of shared prompt prefixes",
                                          flag="--prefix-caching/--no-prefix-caching")
    enable_chunked_prefill: bool = setting(True, "split long prompts over steps so decodes keep running",
                                           flag="--chunked-prefill/--no-chunked-prefill")
    dtype: str = setting("auto", "compute dtype; auto: the backend's own (numpy float32, cuda bfloat16), "
                         "others must match it", choices=DTYPES)
    kv_cache_dtype: str = setting("auto", "KV cache dtype; auto: the compute dtype; fp8 (= fp8_e4m3): e4m3 with a "
                                  "scale per layer and KV head, half the bytes of bf16", choices=KV_CACHE_DTYPES)
    quantization: str | None = setting(None, "fp8: linear layers' weights in e4m3 with a scale per output channel, "
                                       "activations per token; an FP8 checkpoint "
                                       "runs as stored [default: the checkpoint's]", choices=QUANTIZATIONS)
    quantize_lm_head: bool = setting(False, "with FP8 weights (quantization fp8, or an FP8 checkpoint): the LM head "
                                     "in e4m3 as well, a scale per vocabulary row, activations per token (the "
                                     "embedding lookup stays as stored)")
    enforce_eager: bool = setting(False, "cuda: run every step eagerly, without CUDA graphs")
    max_logprobs: int | None = setting(None, "most logprobs (or prompt logprobs) a request may ask per token; a "
                                       "request asking more fails (vLLM's; -1: no limit) [default: the backend's "
                                       "limit, cuda 64]", low=-1, high=INT32_MAX)
    # lazy by default: its thread keeps the ~4 ms a graph off the engine's thread (W1 and W3 within 1% of eager on
    # the H200: docs/PERFORMANCE.md), and start-up does not wait for 66 captures.
    cuda_graph_capture: str = setting("lazy", "cuda: capture every batch size's decode graph at start-up (eager), "
                                      "or batch 1's at start-up and the rest on a thread while the engine runs, "
                                      "the sizes steps meet first (lazy)", choices=GRAPH_CAPTURES)
    # off by default: it costs throughput (README "Batch-invariant outputs")
    batch_invariant: bool = setting(False, "every row's tokens and logprobs bitwise independent of the batch it ran "
                                    "in (batch size, chunking, preemption, prefix-cache hits), at a cost in speed")

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
