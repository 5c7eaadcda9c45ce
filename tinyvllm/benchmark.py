"""Benchmark workloads (W1-W6, J1), their measurement, and the physical floor each is compared with.

Workloads use random token ids and ignore EOS, so every run generates exactly the planned tokens; J1 is a job of text
rows through the CLI's runner, set against the same requests as token ids through the engine. The floors come
from two rates measured on the same machine (memory bandwidth and dense GEMM FLOP/s): a step cannot be faster than
reading its bytes (weights + KV) or doing its FLOPs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.dummy import dummy_model, english_text
from tinyvllm.jobs.run import LocalExecutor, run_job
from tinyvllm.model.config import ModelConfig
from tinyvllm.sampling_params import SamplingParams

WORKLOADS = {
    "W1": "throughput: 512 prompts x 256 random tokens in, 256 out, greedy",
    "W2": "mixed: 256 prompts, input and output lengths uniform in [100, 1024]",
    "W3": "latency: batch 1, 256 in, 256 out",
    "W4": "prefill: 64 prompts x 1024 tokens, 1 out",
    "W5": "shared prefix: 1024 prompts = one 1024-token prefix + 64 unique tokens, 64 out",
    "W1P": "W1 with presence 0.5, frequency 0.5 and repetition 1.1 penalties on every request",
    "W6": "structured outputs: 512 prompts x 256 random tokens in, one 6-field JSON schema, up to 256 out; then "
          "the same requests unconstrained, each generating as many tokens as it did constrained",
    "J1": "a job: 20,000 JSONL rows, each a chat of English text (~200 tokens), 128 out, greedy, through the CLI's job "
          "runner (read, template, tokenize, detokenize, Parquet commits); vs the same requests as token ids through "
          "LLM.generate",
}
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
# An extraction schema: strings, a bounded integer, an array, a nested object, a boolean. (maxLength on every string
# would cost the mask ~2.3x: docs/PERFORMANCE.md.)
W6_SCHEMA = {"type": "object", "additionalProperties": False,
             "required": ["name", "age", "email", "tags", "address", "active"],
             "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            "email": {"type": "string"},
                            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                            "address": {"type": "object", "additionalProperties": False,
                                        "required": ["street", "city"],
                                        "properties": {"street": {"type": "string"}, "city": {"type": "string"}}},
                            "active": {"type": "boolean"}}}


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: dict = field(default_factory=dict)  # more SamplingParams fields (W1P: the penalties)


def make_workload(name: str, vocab_size: int, scale: float = 1.0, seed: int = 0) -> list[Request]:
    """The requests of a workload; `scale` shrinks counts and lengths (e.g. 0.05 for a CPU smoke run)."""
    rng = np.random.default_rng(seed)

    def n(x: int) -> int:
        return max(1, int(round(x * scale)))

    def prompt(length: int) -> list[int]:
        return rng.integers(0, vocab_size, length).tolist()

    if name == "W6":
        return [Request(prompt(n(256)), n(256), {"structured_outputs": {"json": W6_SCHEMA}}) for _ in range(n(512))]
    if name in ("W1", "W1P"):
        sampling = PENALTIES if name == "W1P" else {}
        return [Request(prompt(n(256)), n(256), sampling) for _ in range(n(512))]
    if name == "W2":
        lo, hi = n(100), n(1024)
        return [Request(prompt(int(rng.integers(lo, hi + 1))), int(rng.integers(lo, hi + 1))) for _ in range(n(256))]
    if name == "W3":
        return [Request(prompt(n(256)), n(256))]
    if name == "W4":
        return [Request(prompt(n(1024)), 1) for _ in range(n(64))]
    if name == "W5":
        shared = prompt(n(1024))
        return [Request(shared + prompt(n(64)), n(64)) for _ in range(n(1024))]
    raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")


def run_workload(llm, requests: list[Request], sequential: bool = False, outputs: list | None = None) -> dict:
    """Generate every request (greedy, EOS ignored); return throughput and latency figures (and append the
    RequestOutputs to `outputs` if given)."""
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, **r.sampling) for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    start = time.perf_counter()
    if sequential:  # W3: one request at a time
        done = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    else:
        done = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    if outputs is not None:
        outputs.extend(done)
    outputs = done
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(p) for p in prompts)
    ttft = [o.metrics.ttft_ms for o in outputs]
    tpot = [o.metrics.tpot_ms for o in outputs if o.metrics.tpot_ms is not None]
    return {
        "engine_settings": {name: getattr(llm.engine_config, name) for name in SWITCHABLE},
        "requests": len(requests), "input_tokens": in_tokens, "output_tokens": out_tokens, "wall_s": wall,
        "output_tok_s": out_tokens / wall, "total_tok_s": (in_tokens + out_tokens) / wall,
        "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50), "tpot_p99_ms": _pct(tpot, 99),
    }


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


# ---- the physical floor ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Storage:
    """What a run's decode step reads and at what rate its GEMMs run: bytes per parameter of the linear layers and
    of the LM head, bytes per KV cache value, and the linear layers' GEMM rate (None: the limits' bf16 rate)."""

    linear_bytes: int = 2
    lm_head_bytes: int = 2
    kv_bytes: int = 2
    linear_flops: float | None = None


def run_storage(llm, limits: dict) -> Storage:
    """The LLM's Storage: FP8 weights (quantization "fp8" or an FP8 checkpoint) 1 byte a parameter with the
    limits' FP8 GEMM rate, the LM head too with quantize_lm_head; an fp8 KV cache 1 byte a value."""
    engine = llm.engine_config
    fp8 = engine.quantization == "fp8" or llm.model_config.quantization is not None
    return Storage(linear_bytes=1 if fp8 else 2, lm_head_bytes=1 if fp8 and engine.quantize_lm_head else 2,
                   kv_bytes=1 if engine.kv_cache_dtype != "auto" else 2,
                   linear_flops=limits.get("fp8_gemm_flops") if fp8 else None)

def matmul_params(config: ModelConfig) -> int:
    """Parameters used in GEMMs per token (every linear layer and the LM head; not the embedding gather). Of an
    expert layer: the router and the top_k experts a token runs through (the active parameters)."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    moe = sum(map(config.moe_layer, range(config.num_hidden_layers)))
    dense = config.num_hidden_layers - moe
    active_moe = h * config.num_experts + config.num_experts_per_tok * expert_params(config)
    return config.num_hidden_layers * attn + dense * 3 * h * config.intermediate_size + moe * active_moe + \
        config.vocab_size * h


def decode_gemm_shapes(config: ModelConfig) -> dict[str, tuple[int, int, bool, bool]]:
    """A dense model's decode GEMMs as the cuda backend runs them, each (n, k, float32 output, added to the output):
    QKV, O, gate/up (both in one product), down, the LM head; O and down add into the float32 residual stream
    (bench/gemv.py times them)."""
    h, d = config.hidden_size, config.head_dim
    return {"qkv": ((config.num_attention_heads + 2 * config.num_key_value_heads) * d, h, False, False),
            "o": (h, config.num_attention_heads * d, True, True),
            "gate_up": (2 * config.intermediate_size, h, False, False),
            "down": (h, config.intermediate_size, True, True),
            "lm_head": (config.vocab_size, h, True, False)}


def expert_params(config: ModelConfig) -> int:
    """One expert's parameters (gate, up and down of moe_intermediate_size); 0 for a dense model."""
    return 3 * config.hidden_size * config.moe_intermediate_size if config.num_experts else 0


def experts_read(config: ModelConfig, tokens: int) -> float:
    """The experts of one expert layer a decode step of `tokens` tokens reads, expected under uniform routing
    (each token's top_k distinct experts at random): num_experts * (1 - (1 - top_k / num_experts) ** tokens), top_k
    for one token, nearly all of them for a large batch."""
    e, k = config.num_experts, config.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens) if e else 0.0


def weight_bytes(config: ModelConfig, tokens: int = 1, storage: Storage | None = None) -> int:
    """Bytes of weights a decode step of `tokens` tokens reads: every GEMM's (the LM head included) at the storage's
    bytes per parameter, the norm gains and the biases (bf16); of an expert layer the router and the experts the
    step's tokens chose (experts_read: a dense model's bytes are the same for any batch). Not an untied embedding
    table, of which a step gathers only its tokens' rows; not FP8's per-row scales (4 bytes a row, ~0.1%)."""
    storage = storage or Storage()
    h, d, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    per_layer = (4 if config.sandwich_norms else 2) * h  # the RMSNorm gains
    if config.attention_bias:
        per_layer += (config.num_attention_heads + 2 * config.num_key_value_heads) * d
    if config.qk_norm:  # per head, or over the whole Q and K projections (OLMoE)
        per_layer += 2 * d if config.qk_norm_per_head else (config.num_attention_heads +
                                                                    config.num_key_value_heads) * d
    moe = sum(map(config.moe_layer, range(layers)))
    experts = moe * (experts_read(config, tokens) - config.num_experts_per_tok) * expert_params(config)
    lm_head = config.vocab_size * h
    linear = matmul_params(config) - lm_head + experts
    return round(linear * storage.linear_bytes + lm_head * storage.lm_head_bytes + (layers * per_layer + h) * 2)


def kv_bytes_per_token(config: ModelConfig, bytes_per_value: int = 2) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_value


@dataclass(frozen=True)
class Floor:
    """A lower bound on a workload's time, by what bounds it: prefill at the GEMM rate; then each decode step by
    reading the weights and the batch's KV cache at the copy rate, or by its FLOPs where those take longer. The
    parts add up to the bound."""

    prefill_flops_s: float  # prefill's GEMM and attention FLOPs
    decode_weights_s: float  # reading the weights, in the decode steps bound by memory
    decode_kv_s: float  # reading the KV cache, in the same steps
    decode_flops_s: float  # the decode steps bound by their FLOPs

    @property
    def seconds(self) -> float:
        return self.prefill_flops_s + self.decode_weights_s + self.decode_kv_s + self.decode_flops_s


def workload_floor(config: ModelConfig, requests: list[Request], bandwidth: float, flops: float,
                  max_num_seqs: int, cached_prefix: int = 0, storage: Storage | None = None) -> Floor:
    """The workload's Floor. Sequences run in waves of max_num_seqs, longest-first being irrelevant to a bound this
    coarse. With `cached_prefix`, every request but the first finds that many leading prompt tokens in the prefix
    cache and prefills only the rest. `storage`: the weights' and the KV cache's bytes and the linear layers' GEMM
    rate (default bf16 at `flops`); attention and a bf16 LM head run at `flops`."""
    storage = storage or Storage()
    linear_rate = storage.linear_flops or flops
    lm_head = 2 * config.vocab_size * config.hidden_size
    # per-token GEMM time: the LM head at its own precision's rate
    lm_rate = linear_rate if storage.lm_head_bytes == storage.linear_bytes else flops
    token_s = (2 * matmul_params(config) - lm_head) / linear_rate + lm_head / lm_rate
    attn_flops = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim  # per (query, key)
    prefill = 0.0
    for i, r in enumerate(requests):
        length, cached = len(r.prompt_token_ids), min(cached_prefix, len(r.prompt_token_ids)) if i else 0
        prefill += token_s * (length - cached) + attn_flops * (length ** 2 - cached ** 2) / 2 / flops
    kv_per_token = kv_bytes_per_token(config, storage.kv_bytes) / bandwidth
    weights_s = kv_s = compute_s = 0.0
    for wave_start in range(0, len(requests), max_num_seqs):
        wave = requests[wave_start: wave_start + max_num_seqs]
        for step in range(1, max(r.max_tokens for r in wave)):
            live = [r for r in wave if r.max_tokens > step]
            context = sum(len(r.prompt_token_ids) + step for r in live)
            kv = context * kv_per_token
            weights = weight_bytes(config, len(live), storage) / bandwidth  # an expert layer's: the batch's
            step_s = token_s * len(live) + attn_flops * context / flops
            if step_s > weights + kv:
                compute_s += step_s
            else:
                weights_s += weights
                kv_s += kv
    return Floor(prefill, weights_s, kv_s, compute_s)


def measure_limits(backend, fp8: bool = False) -> dict:
    """The ceilings of the machine a backend runs on, measured: {"bandwidth_bytes_s": memory copy rate (bytes read +
    written), "gemm_flops": dense GEMM rate in the backend's compute dtype}, and with fp8 on the cuda backend
    "fp8_gemm_flops" (e4m3 with outer-vector scales, bf16 out; absent where cuBLASLt has no such algorithm). The
    floors derive from them."""
    if backend.name == "cuda":
        return _cuda_limits(backend.stream, backend.forward.blas, fp8)
    return _numpy_limits()


def _numpy_limits() -> dict:
    """float32 on the CPU: best of 5 copies of 256 MiB (far beyond the caches) and of 5 GEMMs of 2048^3."""
    src = np.ones(64 << 20, np.float32)
    dst = np.empty_like(src)
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    copy_s = _best_time(lambda: np.copyto(dst, src))
    gemm_s = _best_time(lambda: a @ a)
    return {"bandwidth_bytes_s": 2 * src.nbytes / copy_s, "gemm_flops": 2 * 2048 ** 3 / gemm_s}


def _best_time(fn: Callable[[], object], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _cuda_limits(stream, blas, fp8: bool = False) -> dict:
    """Device-to-device copy rate and bf16 cuBLAS GEMM rate on the backend's stream (and with fp8 the e4m3 GEMM's
    with per-row scales), median of CUDA-event timings."""
    import pycuda.driver as cuda  # here only: the cuda backend is the one user of pycuda

    from tinyvllm.backends.cuda.tensors import BF16, E4M3, F32, DeviceTensor
    from tinyvllm.model.dtypes import f32_to_bf16

    copy_bytes, n = 256 << 20, 4096  # copies far beyond the 50 MB L2; a GEMM that fills the GPU
    rng = np.random.default_rng(0)
    host = {name: f32_to_bf16(rng.standard_normal((n, n), dtype=np.float32)) for name in ("a", "b")}
    if fp8:  # e4m3 codes of magnitude 2^-6..2^7 (no NaN, no inf) and unit scales
        host.update({name: (rng.integers(0x08, 0x78, (n, n)) | (rng.integers(0, 2, (n, n)) << 7)).astype(np.uint8)
                     for name in ("qa", "qb")}, ones=np.ones(n, np.float32))
    dev = {name: cuda.to_device(array) for name, array in host.items()}
    dev.update(src=cuda.mem_alloc(copy_bytes), dst=cuda.mem_alloc(copy_bytes), c=cuda.mem_alloc(n * n * 2))

    def median_seconds(op: Callable[[], object], repeats: int = 20) -> float:
        op()  # warm-up
        times = []
        for _ in range(repeats):
            start, end = cuda.Event(), cuda.Event()
            start.record(stream)
            op()
            end.record(stream)
            end.synchronize()
            times.append(end.time_since(start) / 1e3)
        return float(np.median(times))

    def tensor(name: str, dtype: str, scale: DeviceTensor | None = None) -> DeviceTensor:
        return DeviceTensor(int(dev[name]), dtype, (n, n), scale)

    limits = {"bandwidth_bytes_s": 2 * copy_bytes / median_seconds(
        lambda: cuda.memcpy_dtod_async(dev["dst"], dev["src"], copy_bytes, stream))}
    limits["gemm_flops"] = 2 * n ** 3 / median_seconds(lambda: blas.gemm(tensor("c", BF16), tensor("a", BF16),
                                                                         tensor("b", BF16), n))
    if fp8:
        ones = DeviceTensor(int(dev["ones"]), F32, (n,))
        x, w = tensor("qa", E4M3, ones), tensor("qb", E4M3, ones)
        if blas.gemm_scaled(tensor("c", BF16), x, w, n):
            limits["fp8_gemm_flops"] = 2 * n ** 3 / median_seconds(lambda: blas.gemm_scaled(tensor("c", BF16), x,
                                                                                             w, n))
    for allocation in dev.values():
        allocation.free()
    return limits


# The engine settings the benchmarks run with unless told otherwise, and the longest sequence they need (the KV cache
# need not hold a model's 128k context).
BENCH_ENGINE = {"max_num_seqs": 512}
# The host benchmarks' "mixed" rows (every fourth): a stop string that never matches, 2 logprobs and penalties, the
# per-row work the host loop's targets include (bench/host_step.py, bench/profile_host.py --mixed).
MIXED_SAMPLING = dict(stop=["\x00never\x00"], logprobs=2, presence_penalty=0.5, frequency_penalty=0.1)
BENCH_MAX_MODEL_LEN = 4096
# EngineConfig settings a benchmark switches between runs on one LLM (W2 chunked prefill, W5 the prefix cache), and
# the engine part that reads each.
SWITCHABLE = {"enable_chunked_prefill": "scheduler", "enable_prefix_caching": "block_manager"}


def bench_llm(model: str | Path | None, dummy_weights: str = "llama-3.2-1b", workloads: Iterable[str] = (),
              seed: int = 0, **settings):
    """The LLM the benchmarks run on: `model` loaded, or random weights of the preset `dummy_weights` (with a
    tokenizer covering their vocabulary when J1 is among `workloads`: it decodes the text of every generated id);
    BENCH_ENGINE's settings under the given ones (None: not given), max_model_len at most BENCH_MAX_MODEL_LEN.
    ValueError: an unknown preset, a model that does not load, a bad setting."""
    from tinyvllm.llm import LLM
    from tinyvllm.model.loader import load_model

    loaded = load_model(model) if model else dummy_model(dummy_weights, seed, text="J1" in workloads)
    engine = {**BENCH_ENGINE, "max_model_len": min(BENCH_MAX_MODEL_LEN, loaded.config.max_position_embeddings),
              **{k: v for k, v in settings.items() if v is not None}}
    return LLM(loaded, **engine)


def chain_choices(llm) -> str:
    """A batch-invariant cuda LLM's form per weight shape for up to 8 rows, as its Linear runs it: gemv_chain
    ("chain", 16-row tiles), in 8-row tiles ("chain8") or cuBLAS's pinned algorithm, with the start-up timings it
    chose by (CudaForward.choose_chain_shapes: a batch-1 decode step in each form): each LLM times its own, so two
    runs may choose apart where the times are close."""
    forward = getattr(llm.backend, "forward", None)
    timings = getattr(forward, "chain_timings", None)
    if not timings:
        return "no gemv_chain timings (not batch-invariant cuda)"
    linear = forward.linear

    def choice(shape: tuple[int, int], medians: dict[str, float]) -> str:
        form = "chain8" if shape in linear.chain8_shapes else "chain" if shape in linear.chain_shapes else "cuBLAS"
        steps = ", ".join(f"{name} {ms * 1e3:.1f}" for name, ms in medians.items())
        return f"{shape[0]}x{shape[1]} {form} (step us: {steps})"

    return "; ".join(choice(shape, medians) for shape, medians in sorted(timings.items()))


@contextmanager
def engine_settings(llm, **changes):
    """Run the block with these SWITCHABLE settings changed: the LLM's EngineConfig is replaced by one with them (so
    llm.info() and each result's "engine_settings" say what ran), and the engine parts follow it; restored after."""
    unknown = sorted(set(changes) - set(SWITCHABLE))
    if unknown:
        raise ValueError(f"{', '.join(unknown)} cannot change on a running LLM (only {', '.join(SWITCHABLE)})")
    before = llm.engine_config
    _use_config(llm, replace(before, **changes))
    try:
        yield
    finally:
        _use_config(llm, before)


def _use_config(llm, config) -> None:
    llm.engine_config = llm.llm_engine.engine_config = config
    for name, part in SWITCHABLE.items():
        setattr(getattr(llm.llm_engine, part), name, getattr(config, name))


def run_benchmark(llm, workloads: list[str], scale: float = 1.0, seed: int = 0,
                  limits: dict | None = None) -> dict:
    """Run each workload on the LLM and set it against the floor from the measured limits.

    W5 runs with the prefix cache off and on, W2 with chunked prefill on and off (decodes must not stall behind
    long prompts): each through engine_settings, so every result records the settings it ran with."""
    config = llm.model_config
    # Steady state: decode graphs still being captured on a thread (lazy capture) slow the first steps
    # (docs/PERFORMANCE.md); start-up has its own benchmark (--startup).
    llm.backend.finish_startup()
    storage = run_storage(llm, {})
    limits = limits or measure_limits(llm.backend, fp8=storage.linear_bytes == 1)
    storage = run_storage(llm, limits)
    results = {"limits": limits, "workloads": {}}
    for name in workloads:
        requests = make_workload(name, config.vocab_size, scale, seed) if name != "J1" else []
        if name == "W5":
            runs = _both_ways(llm, requests, "enable_prefix_caching")
            result = {**runs[True], "cache_off": runs[False],
                      "speedup_vs_cache_off": runs[True]["output_tok_s"] / runs[False]["output_tok_s"]}
        elif name == "W2":
            chunked = llm.engine_config.enable_chunked_prefill
            runs = _both_ways(llm, requests, "enable_chunked_prefill")
            result = {**runs[chunked], "chunked_prefill" if not chunked else "unchunked": runs[not chunked]}
        elif name == "W6":
            result, requests = _structured_vs_free(llm, requests)
        elif name == "J1":
            result, requests = run_j1(llm, max(1, round(20000 * scale)), max(1, round(128 * scale)), seed=seed)
        else:
            _reset_prefix_cache(llm)
            result = run_workload(llm, requests, sequential=name == "W3")
        cached = _common_prefix_len(requests) if name == "W5" else 0  # what the prefix cache saves
        floor = workload_floor(config, requests, limits["bandwidth_bytes_s"], limits["gemm_flops"],
                              llm.engine_config.max_num_seqs, cached_prefix=cached, storage=storage)
        result.update(floor_s=floor.seconds, floor_parts_s=asdict(floor), fraction_of_limit=floor.seconds /
                      result["wall_s"])
        if name == "W4":
            flops = sum(2 * matmul_params(config) * len(r.prompt_token_ids) for r in requests)
            result["prefill_tok_s"] = result["input_tokens"] / result["wall_s"]
            result["achieved_tflops"] = flops / result["wall_s"] / 1e12
            result["fraction_of_gemm_rate"] = flops / result["wall_s"] / limits["gemm_flops"]
        if name == "W3":
            result["ms_per_token"] = result["wall_s"] * 1000 / result["output_tokens"]
        results["workloads"][name] = result
    return results


def _both_ways(llm, requests: list[Request], name: str) -> dict[bool, dict]:
    """The requests run with the switchable setting `name` the other way from the LLM's, then its own way."""
    own, runs = getattr(llm.engine_config, name), {}
    for value in (not own, own):
        with engine_settings(llm, **{name: value}):
            _reset_prefix_cache(llm)
            runs[value] = run_workload(llm, requests)
    return runs


def _structured_vs_free(llm, requests: list[Request]) -> tuple[dict, list[Request]]:
    """W6: the constrained requests twice (the first run captures the forward-only decode graphs), then the same
    prompts unconstrained, each row generating as many tokens as it did constrained: the identical work, so the
    ratio of output tok/s is the constraint's cost. Also the host's mask fill and matcher time per step. Returns
    the result and the requests as run (unconstrained, with their lengths: what the floor is computed on)."""
    stats = llm.llm_engine.structured_outputs.stats
    runs, outputs = [], []
    for _ in range(2):
        _reset_prefix_cache(llm)
        before = replace(stats)
        outputs.clear()
        run = run_workload(llm, requests, outputs=outputs)
        steps = max(1, stats.mask_steps - before.mask_steps)
        run.update(mask_fill_ms_per_step=1000 * (stats.mask_seconds - before.mask_seconds) / steps,
                   matcher_ms_per_step=1000 * (stats.consume_seconds - before.consume_seconds) / steps,
                   constrained_steps=steps)
        runs.append(run)
    same = [Request(r.prompt_token_ids, len(o.outputs[0].token_ids)) for r, o in zip(requests, outputs)]
    _reset_prefix_cache(llm)
    free = run_workload(llm, same)
    complete = sum(bool(o.outputs[0].structured_output_complete) for o in outputs)
    result = {**runs[1], "first_run": runs[0], "unconstrained": free, "complete_outputs": complete,
              "compile_s": stats.compile_seconds + stats.tokenizer_seconds,
              "constrained_vs_unconstrained": runs[1]["output_tok_s"] / free["output_tok_s"]}
    return result, same


J1_SYSTEM = "You are a helpful assistant. Answer briefly, in plain English."


def make_j1_rows(num_rows: int, num_words: int = 150, seed: int = 0) -> list[dict]:
    """J1's input rows: a chat each, one system message shared by all and a user's text of num_words words (with the
    Llama 3 template about 200 tokens)."""
    rng = np.random.default_rng(seed)
    return [{"id": f"j1-{i}", "messages": [
        {"role": "system", "content": J1_SYSTEM},
        {"role": "user", "content": "Summarize this text in one paragraph:\n\n" + english_text(rng, num_words)}]}
        for i in range(num_rows)]


class _TimedExecutor(LocalExecutor):
    """LocalExecutor on a given LLM, noting when the last row is committed (before the output is assembled)."""

    def run(self, cfg, defaults, rows, num_rows, emit, commit, stopped, columns):
        result = super().run(cfg, defaults, rows, num_rows, emit, commit, stopped, columns)
        commit(force=True)
        self.committed_at = time.perf_counter()
        return result


def run_j1(llm, num_rows: int = 20000, max_tokens: int = 128, num_words: int = 150, seed: int = 0,
           output_token_ids: bool = False, workdir: Path | None = None) -> tuple[dict, list[Request]]:
    """J1: the rows through the job runner the CLI uses (run_job, in this process, on this LLM), timed from the call
    to the last row committed; and the same requests as token ids through LLM.generate. Returns the result (the
    job's figures, the engine's under "engine", their ratio, how many rows came out the same) and the requests as
    token ids. The LLM's tokenizer must cover the model's vocabulary (dummy weights: dummy_model(text=True))."""
    if llm.tokenizer.vocab_size < llm.model_config.vocab_size:
        raise ValueError(f"J1 needs a tokenizer covering the model's {llm.model_config.vocab_size} ids (the "
                         f"tokenizer has {llm.tokenizer.vocab_size}): a real model, or dummy_model(text=True)")
    rows = make_j1_rows(num_rows, num_words, seed)
    tokenizer = llm.tokenizer
    requests = [Request(tokenizer.encode_prompt(tokenizer.apply_chat_template(r["messages"]), templated=True),
                        max_tokens) for r in rows]
    _reset_prefix_cache(llm)
    outputs: list = []
    engine = run_workload(llm, requests, outputs=outputs)
    with tempfile.TemporaryDirectory(prefix="tinyvllm-j1-", dir=workdir) as tmp:
        source = Path(tmp) / "j1.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = JobConfig(source, Path(tmp) / "j1.parquet", Path(llm.model.source), engine=llm.engine_config,
                        sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
                        output_token_ids=output_token_ids, quiet=True)
        executor = _TimedExecutor(llm)
        _reset_prefix_cache(llm)
        start = time.perf_counter()
        summary = run_job(cfg, executor)
        end = time.perf_counter()
        columns = ["completion", "completion_tokens", "prompt_tokens"]
        columns += ["completion_token_ids"] if output_token_ids else []
        table = pq.read_table(cfg.output, columns=columns).to_pydict()
    wall = executor.committed_at - start
    same = sum(text == o.outputs[0].text and (not output_token_ids or ids == o.outputs[0].token_ids)
               for text, ids, o in zip(table["completion"], table.get("completion_token_ids", table["completion"]),
                                       outputs))
    # a row whose prompt has another length was tokenized differently; the others differ in what was generated
    same_prompt_lengths = sum(n == len(o.prompt_token_ids) for n, o in zip(table["prompt_tokens"], outputs))
    out_tokens = summary["output_tokens"]
    result = {"requests": len(rows), "input_tokens": engine["input_tokens"], "output_tokens": out_tokens,
              "wall_s": wall, "output_tok_s": out_tokens / wall,
              "total_tok_s": (engine["input_tokens"] + out_tokens) / wall, "finalize_s": end - executor.committed_at,
              "job_vs_engine": out_tokens / wall / engine["output_tok_s"], "same_outputs": same,
              "same_prompt_lengths": same_prompt_lengths, "engine": engine,
              **{f"{name}_{q}_ms": summary["latency_ms"][name][q] for name in ("ttft", "tpot") for q in ("p50", "p99")}}
    return result, requests


def _common_prefix_len(requests: list[Request]) -> int:
    first = requests[0].prompt_token_ids
    return min(next((i for i, (a, b) in enumerate(zip(first, r.prompt_token_ids)) if a != b), len(first))
               for r in requests[1:]) if len(requests) > 1 else 0


def _reset_prefix_cache(llm) -> None:
    """Forget every cached block, so that one run cannot warm the next."""
    llm.llm_engine.block_manager.reset_prefix_cache()


def format_results(results: dict) -> str:
    """A plain table: one line per workload."""
    lim = results["limits"]
    fp8 = f", FP8 GEMM {lim['fp8_gemm_flops'] / 1e12:.1f} TFLOP/s" if "fp8_gemm_flops" in lim else ""
    lines = [f"limits: copy bandwidth {lim['bandwidth_bytes_s'] / 1e9:.0f} GB/s, GEMM {lim['gemm_flops'] / 1e12:.1f} "
             f"TFLOP/s{fp8}",
             f"{'workload':<9}{'out tok/s':>12}{'total tok/s':>13}{'TTFT p50/p99 ms':>18}{'TPOT p50/p99 ms':>18}"
             f"{'of limit':>10}  notes"]
    for name, r in results["workloads"].items():
        notes = []
        if "ms_per_token" in r:
            notes.append(f"{r['ms_per_token']:.2f} ms/token")
        if "floor_parts_s" in r:
            parts = r["floor_parts_s"]
            notes.append(f"floor {r['floor_s']:.3f} s = prefill FLOPs {parts['prefill_flops_s']:.3f} + weights "
                         f"{parts['decode_weights_s']:.3f} + KV {parts['decode_kv_s']:.3f} + decode FLOPs "
                         f"{parts['decode_flops_s']:.3f}")
        if "achieved_tflops" in r:
            notes.append(f"{r['achieved_tflops']:.1f} TFLOP/s = {r['fraction_of_gemm_rate']:.0%} of GEMM rate")
        if "unchunked" in r:
            u = r["unchunked"]
            notes.append(f"without chunked prefill: TPOT p99 {_fmt(u['tpot_p99_ms'])} ms, total tok/s "
                         f"{u['total_tok_s']:.0f} ({r['total_tok_s'] / u['total_tok_s']:.2f}x with)")
        if "speedup_vs_cache_off" in r:
            notes.append(f"prefix cache {r['speedup_vs_cache_off']:.2f}x vs off "
                         f"({r['cache_off']['output_tok_s']:.0f} tok/s)")
        if "job_vs_engine" in r:
            notes.append(f"{r['job_vs_engine']:.0%} of the engine on token ids ({r['engine']['output_tok_s']:.0f} "
                         f"tok/s); output assembled in {r['finalize_s']:.1f} s more; {r['same_outputs']}/"
                         f"{r['requests']} rows the same ({r['same_prompt_lengths']} prompts of the same length)")
        if "constrained_vs_unconstrained" in r:
            notes.append(f"{r['constrained_vs_unconstrained']:.0%} of unconstrained "
                         f"({r['unconstrained']['output_tok_s']:.0f} tok/s, same lengths); mask fill "
                         f"{r['mask_fill_ms_per_step']:.2f} ms/step, matchers {r['matcher_ms_per_step']:.2f} ms/step; "
                         f"{r['complete_outputs']}/{r['requests']} complete; "
                         f"first run {r['first_run']['output_tok_s']:.0f}")
        ttft = f"{_fmt(r['ttft_p50_ms'])}/{_fmt(r['ttft_p99_ms'])}"
        tpot = f"{_fmt(r['tpot_p50_ms'])}/{_fmt(r['tpot_p99_ms'])}"
        lines.append(f"{name:<9}{r['output_tok_s']:>12.0f}{r['total_tok_s']:>13.0f}{ttft:>18}{tpot:>18}"
                     f"{r['fraction_of_limit']:>10.0%}  {'; '.join(notes)}")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


# ---- memory of a job --------------------------------------------------------------------------------------------

def job_peak_rss(model: Path, num_rows: int, workdir: Path, max_num_seqs: int = 128) -> tuple[float, float, Path]:
    """`tinyvllm run` over num_rows short JSONL rows (numpy backend, 2 tokens out each) in a child process: its peak
    RSS in MiB, its wall time, and its output file. A failed run raises RuntimeError with its stderr."""
    src = workdir / f"in{num_rows}.jsonl"
    with open(src, "w") as f:
        for i in range(num_rows):
            f.write(json.dumps({"id": f"row-{i}", "prompt": f"Item {i}: " + "xyz " * (i % 11)}) + "\n")
    out = workdir / f"out{num_rows}.parquet"
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "tinyvllm", "run", "--model", str(model),
                           "--input", str(src), "--output", str(out), "--backend", "numpy", "--max-tokens", "2",
                           "--max-num-seqs", str(max_num_seqs), "--quiet"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tinyvllm run over {num_rows} rows failed: {proc.stderr.strip()}")
    return int(proc.stdout.split()[-1]) / 1024, time.perf_counter() - start, out


# ---- start-up --------------------------------------------------------------------------------------------------------

# Run in a fresh interpreter so that its imports are timed too (argv: model path, backend); prints the phases as JSON.
_STARTUP_CHILD = """
import json, sys, time
start = time.perf_counter()
import tinyvllm.llm
imports = time.perf_counter() - start
from tinyvllm.benchmark import startup_phases
print(json.dumps({"python imports": imports, **startup_phases(sys.argv[1], sys.argv[2])}))
"""


def startup_phases(model: str, backend: str) -> dict[str, float]:
    """Seconds per start-up phase of LLM(model) in this process, then of its first tokens."""
    from tinyvllm.backends import cuda_available
    from tinyvllm.llm import LLM
    from tinyvllm.model.loader import load_model

    phases = {}
    start = time.perf_counter()
    if backend == "cuda" or (backend == "auto" and cuda_available()):
        import tinyvllm.backends.cuda.runner  # noqa: F401  (pycuda; the backend times its CUDA context itself)

        phases["cuda imports"] = time.perf_counter() - start
    start = time.perf_counter()
    loaded = load_model(model)
    phases["model load (read + convert)"] = time.perf_counter() - start
    start = time.perf_counter()
    llm = LLM(loaded, backend=backend)
    total = time.perf_counter() - start
    parts = getattr(llm.backend, "startup_times", {})  # the cuda backend's own phases
    phases.update(parts)
    phases["engine and backend, the rest"] = total - sum(parts.values())
    for name, tokens in (("first token (one prompt)", 1), ("8 tokens (one prompt)", 8)):
        start = time.perf_counter()
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
        phases[name] = time.perf_counter() - start
    return phases


def run_startup(model: str, backend: str, env: dict[str, str] | None = None) -> dict[str, float]:
    """startup_phases in a fresh interpreter (env: its environment), with the interpreter's own start-up and the
    whole wall time added."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _STARTUP_CHILD, model, backend], capture_output=True, text=True,
                          env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"start-up run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    return {"python start": wall - sum(phases.values()), **phases, "total": wall}


def format_startup(runs: dict[str, dict[str, float]]) -> str:
    """One column of seconds per run (e.g. cold and warm kernel cache), one row per phase."""
    names = list(dict.fromkeys(name for phases in runs.values() for name in phases))
    width = max(map(len, names))
    lines = [f"{'phase':<{width}}" + "".join(f"{run:>12}" for run in runs)]
    for name in names:
        lines.append(f"{name:<{width}}" + "".join(
            f"{phases[name]:>11.3f}s" if name in phases else f"{'-':>12}" for phases in runs.values()))
    return "\n".join(lines)
