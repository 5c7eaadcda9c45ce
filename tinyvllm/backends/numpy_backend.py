"""The numpy backend: the reference forward pass over the paged KV cache (float32, CPU).

It is written to be read, and it is the specification every CUDA kernel is tested against: each function below
names its twin in cuda/*.cu. Everything is batched over the tokens of a step; only attention loops, over the
sequences of a prefill step (their causal masks differ in shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

import tinyvllm.backends.sampler as sampler
from tinyvllm.backends.base import Backend, Batch, SamplerOutput
from tinyvllm.backends.host_weight import HostWeight, linear
from tinyvllm.backends.moe import StackedWeight, fused_moe, route
from tinyvllm.config import EngineConfig
from tinyvllm.model.config import ModelConfig
from tinyvllm.model.dtypes import e4m3_to_f32, f32_to_e4m3
from tinyvllm.model.fp8 import Fp8Rows, quantize_rows, stack_rows
from tinyvllm.model.fp8_checkpoint import Fp8CheckpointWeights
from tinyvllm.model.kv_scales import kv_cache_scales
from tinyvllm.model.layout import NORM_FIELDS, ROUTER, row_slices, weight_shapes
from tinyvllm.model.rope import layer_ropes
from tinyvllm.model.weights import LayerWeights, pack_weights


# ---- the operations (each the twin of a CUDA kernel) -------------------------------------------------------------

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) * weight over the last axis (weight: a gain plus the family's norm_offset, host_layer).
    Twin: cuda/norm.cu rms_norm."""
    variance = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + eps)) * weight


def add_rms_norm(x: np.ndarray, part: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x + rms_norm(part): a sandwich norm's residual add, of the attention's or the MLP's output (Gemma 2 and 3).
    Twin: cuda/norm.cu rms_norm_residual (with the next rms_norm of the result fused in)."""
    return x + rms_norm(part, weight, eps)


def qk_norm(q: np.ndarray, k: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray,
            eps: float, per_head: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """RMSNorm of each head of q [T, heads, d] and k [T, kv_heads, d] on its own (Qwen3, before RoPE); per_head
    False: of each token's whole Q and whole K, weights [heads * d] and [kv_heads * d] (OLMoE).
    Twins: cuda/qkv.cu qk_norm, and cache.cu rope_and_cache's norm_head (the per-head norms fused before RoPE)."""
    if per_head:
        return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return (rms_norm(q.reshape(len(q), -1), q_weight, eps).reshape(q.shape),
            rms_norm(k.reshape(len(k), -1), k_weight, eps).reshape(k.shape))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on the first 2 * cos.shape[1] dimensions of x [T, heads, head_dim] (all of them but where
    partial_rotary_factor < 1; the rest pass unrotated) with cos/sin [T, rotary_dim/2].
    Twin: cuda/cache.cu rope_and_cache."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """SiLU(gate) * up, with gate_up [T, 2 * I] holding gate then up.  Twin: cuda/activation.cu."""
    gate, up = np.split(gate_up, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


def gelu_tanh_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """GELU(gate) (its tanh approximation, HF's gelu_pytorch_tanh) * up: Gemma's GeGLU.
    Twin: cuda/activation.cu gelu_tanh_and_mul, and gemv.cu's gemv_geglu_bf16."""
    gate, up = np.split(gate_up, 2, axis=-1)
    inner = np.float32(math.sqrt(2 / math.pi)) * (gate + np.float32(0.044715) * gate * gate * gate)
    return np.float32(0.5) * gate * (np.float32(1) + np.tanh(inner)) * up


ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}  # ModelConfig.activation -> the op


def soft_cap(x: np.ndarray, cap: float | None) -> np.ndarray:
    """cap * tanh(x / cap): Gemma 2's attention scores and logits (x as it is for no cap).
    Twin: cuda/activation.cu soft_cap (the logits)."""
    return x if cap is None else np.float32(cap) * np.tanh(x / np.float32(cap))


def interleave_gate_up(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [..., 2 * I] (gate, then up) with its last axis in the cuda backend's order: groups of 8 gate entries,
    each followed by the same units' 8 up entries. Twin: the gate/up weight's rows as backends/cuda/weights.py packs
    them, and so the columns of their product, which cuda/activation.cu and gemv.cu's gated GEMVs read."""
    gate, up = np.split(gate_up, 2, axis=-1)
    pairs = np.stack([gate.reshape(*gate.shape[:-1], -1, 8), up.reshape(*up.shape[:-1], -1, 8)], axis=-2)
    return pairs.reshape(gate_up.shape)


KVScales = tuple[np.ndarray, np.ndarray]  # an fp8 cache's K and V scales of one layer, float32 [kv_heads] each


def write_kv_cache(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                   slot_mapping: np.ndarray, scales: KVScales | None = None) -> None:
    """Store each token's K/V [T, kv_heads, head_dim] at its slot of the cache [slots, kv_heads, head_dim]; an fp8
    cache (uint8, with `scales`) holds the e4m3 codes of value / scale (model/kv_scales.py), as the twin computes
    it: value times the float32 1 / scale (exact for the power-of-two scales the cache derives itself).
    Twin: cuda/cache.cu rope_and_cache (after its rotation)."""
    if scales is not None:
        k, v = (f32_to_e4m3(x * (np.float32(1) / scale)[:, None]) for x, scale in zip((k, v), scales))
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v


def read_kv_cache(cache: np.ndarray, slots: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """The cache's entries at `slots` [...] -> [..., kv_heads, head_dim] float32 (fp8 codes times their scale)."""
    return cache[slots] if scale is None else e4m3_to_f32(cache[slots]) * scale[:, None]


def context_slots(block_table: np.ndarray, context_len: int, block_size: int) -> np.ndarray:
    """The cache slots of positions 0..context_len-1 of a sequence, through its block table."""
    positions = np.arange(context_len)
    return block_table[positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class AttentionSpec:
    """How a layer's attention scores its keys: q . k times `scale`, soft-capped at `softcap`; a query at position p
    sees the keys at positions p - window + 1 .. p (window None: 0 .. p)."""

    scale: float
    window: int | None = None
    softcap: float | None = None

    def scores(self, raw: np.ndarray, key_pos: np.ndarray, query_pos: np.ndarray) -> np.ndarray:
        """raw q . k with the key positions on its last axis and the query positions broadcast against them ->
        the scores the softmax reads (-inf for the keys a query does not see)."""
        visible = key_pos <= query_pos
        if self.window is not None:
            visible &= key_pos > query_pos - self.window
        return np.where(visible, soft_cap(raw * self.scale, self.softcap), -np.inf)


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, batch: Batch, block_size: int,
                    scale: float | AttentionSpec, kv_scales: KVScales | None = None,
                    invariant: bool = False) -> np.ndarray:
    """Causal attention of each sequence's new queries over its context, read from the paged cache.

    q [T, heads, head_dim] -> [T, heads, head_dim]. A query at position p sees keys at positions <= p (within a
    sliding window, soft-capped: an AttentionSpec). Grouped-query attention: query head h reads KV head
    h // (heads / kv_heads). kv_scales: those of an fp8 cache. invariant: each query on its own (`query_attention`),
    so that its result is the same whether it comes in a prefill chunk or a decode step, with whatever else.
    Twins: cuda/attention_decode.cu (one query per sequence), cuda/attention_prefill.cu (many).
    """
    spec = scale if isinstance(scale, AttentionSpec) else AttentionSpec(scale)
    group = q.shape[1] // k_cache.shape[1]
    k_scale, v_scale = kv_scales or (None, None)
    if invariant:
        return query_attention(q, k_cache, v_cache, batch, block_size, spec, group, (k_scale, v_scale))
    if batch.max_query_len == 1:
        return _decode_attention(q, k_cache, v_cache, batch, block_size, spec, group, k_scale, v_scale)
    out = np.empty_like(q)
    for i in range(batch.num_seqs):
        start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        ctx = int(batch.context_lens[i])
        slots = context_slots(batch.block_tables[i], ctx, block_size)
        k = np.repeat(read_kv_cache(k_cache, slots, k_scale), group, axis=1)  # [ctx, heads, d]
        v = np.repeat(read_kv_cache(v_cache, slots, v_scale), group, axis=1)
        raw = np.einsum("qhd,khd->hqk", q[start:end], k)
        scores = spec.scores(raw, np.arange(ctx)[None, None, :], batch.positions[start:end][None, :, None])
        out[start:end] = np.einsum("hqk,khd->qhd", _softmax(scores), v)
    return out


def _decode_attention(q, k_cache, v_cache, batch: Batch, block_size: int, spec: AttentionSpec, group: int, k_scale,
                      v_scale) -> np.ndarray:
    # One query per sequence: pad every context to the longest and mask, so the whole batch is one einsum.
    max_ctx = int(batch.context_lens.max())
    positions = np.arange(max_ctx)
    blocks = batch.block_tables[:, np.minimum(positions // block_size, batch.block_tables.shape[1] - 1)]
    slots = blocks * block_size + positions % block_size  # [S, max_ctx]
    k, v = read_kv_cache(k_cache, slots, k_scale), read_kv_cache(v_cache, slots, v_scale)  # [S, max_ctx, kv_heads, d]
    s, kv_heads, d = q.shape[0], k.shape[2], q.shape[2]
    qg = q.reshape(s, kv_heads, group, d)
    raw = np.einsum("sgjd,skgd->sgjk", qg, k)  # [S, kv_heads, group, max_ctx]
    # The padding past a context is past its query's position (context_len - 1): masked as the future is.
    scores = spec.scores(raw, positions[None, None, None, :], (batch.context_lens - 1)[:, None, None, None])
    out = np.einsum("sgjk,skgd->sgjd", _softmax(scores), v)
    return out.reshape(s, kv_heads * group, d)


def query_attention(q, k_cache, v_cache, batch: Batch, block_size: int, spec: AttentionSpec, group: int,
                    kv_scales: tuple) -> np.ndarray:
    """Batch-invariant attention: each query token over exactly the keys it sees, read from its sequence's blocks,
    as one product of its own shape. Its sums then depend on its position alone, not on how many queries came
    with it (a decode step, a prefill chunk, a recompute after preemption) nor on the longest context in the step,
    which the batched forms pad to. Twin: cuda/attention_decode.cu with one row per query (ops.py
    invariant_rows)."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = heads // group
    seq_of = np.repeat(np.arange(batch.num_seqs), np.diff(batch.query_start_loc))
    out = np.empty_like(q)
    for t in range(len(q)):
        p = int(batch.positions[t])
        key_pos = np.arange(0 if spec.window is None else max(0, p - spec.window + 1), p + 1)
        slots = batch.block_tables[seq_of[t]][key_pos // block_size] * block_size + key_pos % block_size
        k, v = (read_kv_cache(cache, slots, scale) for cache, scale in zip((k_cache, v_cache), kv_scales))
        qg = np.ascontiguousarray(q[t]).reshape(kv_heads, group, d)
        raw = qg @ k.transpose(1, 2, 0)  # [kv_heads, group, n]
        probs = _softmax(spec.scores(raw, key_pos, p))
        out[t] = (probs @ v.transpose(1, 0, 2)).reshape(heads, d)
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---- memory ---------------------------------------------------------------------------------------------------------

GIB = 1 << 30
KV_SHARE = 0.9  # of the memory left after the weights, the most the KV cache takes (the rest: a step's activations)


def available_memory() -> int | None:
    """Bytes of host memory that can be allocated without swapping (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_weight_bytes(config: ModelConfig) -> int:
    """Bytes the numpy backend holds a model's weights in: every tensor as float32 (a tied LM head too: the backend
    holds its transpose beside the embedding)."""
    return 4 * sum(math.prod(shape) for shape in weight_shapes(config).values())


def check_weights_fit(config: ModelConfig) -> None:
    """MemoryError, one line, when the model's float32 weights are more than the memory available."""
    need, free = host_weight_bytes(config), available_memory()
    if free is not None and need > free:
        raise MemoryError(f"the model's weights need {need / GIB:.2f} GiB as float32 on the numpy backend but "
                          f"{free / GIB:.2f} GiB of memory is available")


# ---- the model -----------------------------------------------------------------------------------------------------

def host_layer(layer: LayerWeights, quantize: bool = False, norm_offset: float = 0.0) -> LayerWeights[HostWeight]:
    """A packed layer as the forward reads it: matrices as HostWeights [in, out] (an expert layer's stacked experts as
    StackedWeights [experts, in, out]; an FP8 checkpoint's e4m3 ones as stored, float ones in float32, or in e4m3
    with a scale per output channel (per expert too) where `quantize`; the router stays float32), vectors as float32
    arrays (the RMSNorm gains plus norm_offset: Gemma's (1 + weight)), the parts its family lacks None."""

    def host(name: str, w: Fp8Rows | np.ndarray | None) -> HostWeight | StackedWeight | np.ndarray | None:
        if w is None:
            return None
        if isinstance(w, Fp8Rows):
            return StackedWeight.from_fp8(w) if w.codes.ndim == 3 else HostWeight.from_fp8(w)
        if w.ndim == 3:  # an expert layer's experts, stacked
            return StackedWeight.quantized(w) if quantize else StackedWeight.from_rows(w)
        if w.ndim == 2:
            # the router stays float32 (as vLLM keeps it unquantized)
            return HostWeight.from_fp8(quantize_rows(w)) if quantize and name != ROUTER else HostWeight.from_rows(w)
        w = np.asarray(w, dtype=np.float32)
        return w + np.float32(norm_offset) if norm_offset and name in NORM_FIELDS else w

    return LayerWeights(**{f.name: host(f.name, getattr(layer, f.name)) for f in fields(layer)})


class NumpyBackend(Backend):
    """The decoder forward (Llama and the families of model/config.py) in float32 over a paged KV cache held in
    numpy arrays; with FP8 weights (quantization="fp8" or an FP8 checkpoint) its linear layers run W8A8 e4m3
    (backends/host_weight.py)."""

    name = "numpy"

    def __init__(self, model, engine_config: EngineConfig) -> None:
        self.config = cfg = model.config
        self.vocab_size = cfg.vocab_size
        self.engine_config = engine_config
        self.invariant = engine_config.batch_invariant  # every row's result independent of the batch (README)
        check_weights_fit(cfg)  # before packing, which would run the host out of memory
        # FP8 (model/fp8.py): a checkpoint's e4m3 linear weights as stored, or, with quantization="fp8", every float
        # linear weight quantized here; the embedding stays float32, the LM head too unless quantize_lm_head
        checkpoint = isinstance(model.weights, Fp8CheckpointWeights)
        packed = (pack_weights(model.weights, cfg, model.weights.fp8_or_float, stack_rows) if checkpoint
                  else pack_weights(model.weights, cfg))
        self.embed = np.ascontiguousarray(packed.embed, dtype=np.float32)
        self.embed_scale = np.float32(cfg.embed_scale)  # in the compute dtype, as HF scales in the embedding's
        self.lm_head = (HostWeight.from_fp8(quantize_rows(packed.lm_head)) if engine_config.quantize_lm_head
                        else HostWeight.from_rows(packed.lm_head))  # [hidden, vocab]
        self.final_norm = np.asarray(packed.final_norm, dtype=np.float32) + np.float32(cfg.norm_offset)
        quantize = engine_config.quantization == "fp8" and not checkpoint
        self.layers = [host_layer(layer, quantize, cfg.norm_offset) for layer in packed.layers]
        self.qkv_columns = row_slices(cfg, "qkv")  # Q's, K's and V's columns of the fused projection
        self.ropes = layer_ropes(cfg)
        self.attention = [AttentionSpec(cfg.attention_scale, window, cfg.attn_logit_softcapping)
                          for window in cfg.layer_windows]
        self.activation = ACTIVATIONS[cfg.activation]
        self.token_counts = sampler.TokenCounts(engine_config.max_num_seqs, cfg.vocab_size)
        self.kv_scales: list[KVScales | None] = [None] * cfg.num_hidden_layers  # per layer, for an fp8 cache
        if engine_config.fp8_kv_cache:
            self.kv_scales = list(zip(*kv_cache_scales(model.weights, cfg, model.kv_cache_scales)))
        self.kv_dtype = np.uint8 if engine_config.fp8_kv_cache else np.float32
        self.k_cache: list[np.ndarray] = []
        self.v_cache: list[np.ndarray] = []

    def kv_bytes_per_block(self) -> int:
        cfg = self.config
        return (2 * cfg.num_hidden_layers * self.engine_config.block_size * cfg.num_key_value_heads * cfg.head_dim
                * np.dtype(self.kv_dtype).itemsize)

    def init_kv_cache(self) -> int:
        ec, cfg = self.engine_config, self.config
        self.close()  # an old cache goes before the count of the memory available
        num_blocks = ec.num_kv_blocks
        if num_blocks is None:
            # Enough for every sequence at full length, within the memory budget and the memory the weights left.
            wanted = ec.max_num_seqs * -(-ec.max_model_len // ec.block_size)
            num_blocks = max(1, min(wanted, self.kv_budget() // self.kv_bytes_per_block()))
        shape = (num_blocks * ec.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = [np.zeros(shape, self.kv_dtype) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [np.zeros(shape, self.kv_dtype) for _ in range(cfg.num_hidden_layers)]
        return num_blocks

    def kv_budget(self) -> int:
        """Bytes for the KV cache: cpu_kv_cache_gib, at most KV_SHARE of the memory available with the weights
        loaded; MemoryError (one line) when that is not one block."""
        free = available_memory()
        budget = self.engine_config.cpu_kv_cache_bytes
        if free is None:
            return budget
        block = self.kv_bytes_per_block()
        if int(free * KV_SHARE) < block:
            raise MemoryError(f"no room for a KV cache on the numpy backend: {free / GIB:.2f} GiB of memory is "
                              f"available after the weights, a block of {block} bytes does not fit")
        return min(budget, int(free * KV_SHARE))

    def close(self) -> None:
        """Free the KV cache (its arrays are this backend's largest memory); idempotent."""
        self.k_cache, self.v_cache = [], []

    def forward(self, batch: Batch, logit_rows: np.ndarray) -> np.ndarray:
        """Run the layers over the batch's tokens; return logits [len(logit_rows), vocab] of the chosen tokens."""
        cfg = self.config
        rotations = {id(rope): rope.cos_sin(batch.positions) for rope in self.ropes}  # cos, sin of each distinct rope
        x = self.embed[batch.token_ids]  # [T, hidden]
        if self.embed_scale != 1:
            x = x * self.embed_scale
        for i, layer in enumerate(self.layers):
            x = self.layer_forward(i, layer, x, batch, *rotations[id(self.ropes[i])])
        h = rms_norm(x[logit_rows], self.final_norm, cfg.rms_norm_eps)
        return soft_cap(linear(h, self.lm_head, invariant=self.invariant), cfg.final_logit_softcapping)

    def layer_forward(self, i: int, layer: LayerWeights, x: np.ndarray, batch: Batch, cos: np.ndarray,
                      sin: np.ndarray) -> np.ndarray:
        """Decoder layer i on the residual stream x [T, hidden] (its K and V into the cache) -> the new x."""
        cfg = self.config
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_cols, k_cols, v_cols = self.qkv_columns
        h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
        qkv = linear(h, layer.qkv, layer.qkv_bias, self.invariant)  # Qwen2's bias
        q = qkv[:, q_cols].reshape(-1, heads, d)
        k = qkv[:, k_cols].reshape(-1, kv_heads, d)
        v = qkv[:, v_cols].reshape(-1, kv_heads, d)
        if layer.q_norm is not None:  # Qwen3, Gemma 3
            q, k = qk_norm(q, k, layer.q_norm, layer.k_norm, cfg.rms_norm_eps, cfg.qk_norm_per_head)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv_cache(self.k_cache[i], self.v_cache[i], k, v, batch.slot_mapping, self.kv_scales[i])
        attn = paged_attention(q, self.k_cache[i], self.v_cache[i], batch, self.engine_config.block_size,
                               self.attention[i], self.kv_scales[i], self.invariant)
        out = linear(attn.reshape(len(x), heads * d), layer.o, invariant=self.invariant)
        # Gemma: the attention's (and the MLP's) output normalized before the residual add
        x = x + out if layer.attn_out_norm is None else add_rms_norm(x, out, layer.attn_out_norm, cfg.rms_norm_eps)
        h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
        out = self.mlp(layer, h)
        return x + out if layer.mlp_out_norm is None else add_rms_norm(x, out, layer.mlp_out_norm, cfg.rms_norm_eps)

    def mlp(self, layer: LayerWeights[HostWeight], h: np.ndarray) -> np.ndarray:
        """The layer's MLP on its normed input h [T, hidden]: the dense one, or the experts its router picks."""
        invariant = self.invariant
        if layer.router is None:
            return linear(self.activation(linear(h, layer.gate_up, invariant=invariant)), layer.down,
                          invariant=invariant)
        cfg = self.config
        weights, ids = route(linear(h, layer.router, invariant=invariant), cfg.num_experts_per_tok,
                             cfg.norm_topk_prob)
        return fused_moe(h, layer.experts_gate_up, layer.experts_down, weights, ids, self.activation, invariant)

    def execute(self, batch: Batch, bitmask: np.ndarray | None = None) -> SamplerOutput:
        if batch.block_copies is not None:
            bs = self.engine_config.block_size
            for cache in (*self.k_cache, *self.v_cache):
                for src, dst in batch.block_copies:
                    cache[dst * bs: (dst + 1) * bs] = cache[src * bs: (src + 1) * bs]
        sampled_rows = batch.sampled_rows
        if len(sampled_rows) != batch.num_seqs:
            raise ValueError("the numpy backend samples one row per sequence")
        # Sequences asking for prompt logprobs need logits at their new positions, not just the last.
        prompt_rows = [np.arange(batch.query_start_loc[i], batch.query_start_loc[i] + len(targets))
                       for i, targets in batch.prompt_logprob_targets.items()]
        logits = self.forward(batch, np.concatenate([sampled_rows, *prompt_rows]))
        return sample_from_logits(logits[: batch.num_seqs], batch, logits[batch.num_seqs:], self.token_counts,
                                  bitmask)


def sample_from_logits(logits: np.ndarray, batch: Batch, prompt_logits: np.ndarray | None = None,
                       token_counts: sampler.TokenCounts | None = None,
                       bitmask: np.ndarray | None = None) -> SamplerOutput:
    """Apply the batch's token bitmask and logits processors (in place), sample one token per sequence (logits [S, V]:
    its sampled row's) and gather the logprobs the batch asks for: the numpy backend's sampling, and the reference
    the GPU tests compare with.

    prompt_logits holds, for each entry of batch.prompt_logprob_targets in order, the logits of its positions."""
    if batch.bitmask_rows is not None:
        sampler.apply_token_bitmask(logits, bitmask, batch.bitmask_rows)
    proc = batch.logits_processing
    if proc is not None:
        token_counts.init_slots(proc.slot_inits)
        last_tokens = batch.token_ids[batch.query_start_loc[1:] - 1]
        sampler.apply_logits_processing(logits, proc, last_tokens, token_counts)
    token_ids = sampler.sample(logits, batch.sampling)
    if proc is not None:
        token_counts.count(proc, token_ids)
    out = SamplerOutput.one_each(token_ids)
    if batch.sampling.num_logprobs >= 0:
        out.logprobs = sampler.gather_logprobs(logits, token_ids, batch.sampling.num_logprobs)
    offset = 0
    for i, targets in batch.prompt_logprob_targets.items():
        rows = prompt_logits[offset: offset + len(targets)]
        out.prompt_logprobs[i] = sampler.gather_logprobs(rows, targets, batch.num_prompt_logprobs)
        offset += len(targets)
    return out
