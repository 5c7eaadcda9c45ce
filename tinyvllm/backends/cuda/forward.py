"""The decoder forward (Llama and the families of model/config.py) in bf16 on one NVIDIA GPU: weights, activations
and the paged KV cache in device memory, and the launch sequence of a step.

Per layer: rms_norm -> QKV GEMM (-> add_qkv_bias: Qwen2) -> rope_and_cache (Qwen3's and Gemma 3's per-head q/k
norms, or qk_norm before it where a head does not fit its lanes; RoPE; K and V into the paged cache) -> attention
-> O GEMM (+= residual) -> rms_norm -> gate/up GEMM -> silu_and_mul (or gelu_tanh_and_mul: Gemma) -> down GEMM
(+= residual). Linear layers are cuBLAS GEMMs, or our GEMV kernel for up to 8 rows (linear.py), bf16 in and float32
compute; the GEMV of the gate/up projection applies the activation itself (on weight rows interleaved for it). The
residual stream stays float32 and the O and down GEMMs add into it (beta = 1); with sandwich norms (Gemma 2 and 3)
they write a float32 scratch instead, and rms_norm_residual adds its norm to the residual and normalizes the result
for the next GEMM. Every norm multiplies by (norm_offset + gain), the
embedding by embed_scale rounded to bf16 (Gemma's). The LM head writes float32 logits (soft-capped where the model
caps them) that never leave the GPU: the sampler kernel returns token ids (and logprobs when asked).

Batch-invariant (EngineConfig.batch_invariant): the linear layers run one split-free cuBLAS algorithm per shape
whatever the row count, or at up to 8 rows gemv_chain, which adds in that algorithm's order, on the shapes
_chain_shapes checked and choose_chain_shapes kept where whole steps time faster (linear.py, cublas.py); attention
runs its batch-invariant forms (attention_decode's and attention_prefill's _inv kernels): a row's keys in chunks of
INVARIANT_CHUNK from key 0, each softmaxed over the prefill's key tiles and folded in the chunks' order, the same
additions in the same order whether the position is decoded (in one part or in parts, by the batch), prefilled, in a
chunk or recomputed after preemption; sampling and logprobs keep a block a row (not split over a cluster at small
batches: another order of adding). The other kernels already treat each row alone. The MoE kernels choose their path
by the batch, so an expert model is refused.

Nothing here waits or touches the host: every method queues kernels on the stream, reading the step's inputs from
device buffers that the step driver (runner.py) fills, so a decode step's launches are what a CUDA graph captures.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pycuda.driver as cuda

from tinyvllm.backends.cuda.cublas import SCALE_BLOCK, WORKSPACE_BYTES
from tinyvllm.backends.cuda.device import Device
from tinyvllm.backends.cuda.linear import Fp8Scratch, Linear
from tinyvllm.backends.cuda.moe import allocate_moe_buffers, check_moe_config, fused_moe
from tinyvllm.backends.cuda.ops import (GEMV_MAX_ROWS, GEMV_TILE_ROWS, HEAD_DIMS, INVARIANT_PARTS, MMA_K, VECTOR,
                                       QkNorm, QuantizedOutput, decode_splits, rope_fuses_qk_norm)
from tinyvllm.backends.cuda.tensors import BF16, E4M3, F16, F32, I32, U8, U64, DeviceLayer, DeviceTensor
from tinyvllm.backends.cuda.weights import WeightUploader
from tinyvllm.config import EngineConfig
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16
from tinyvllm.model.kv_scales import kv_cache_scales
from tinyvllm.backends.base import check_cuda_kernels
from tinyvllm.model.rope import cos_sin_tables

log = logging.getLogger(__name__)

# Decode row counts from which the LM head's cuBLASLt algorithm is chosen by timing (tune_lm_head): there the GEMM
# is bound by its FLOPs, and the heuristics' first guess took 390 us at 512 rows where the fastest of their top 8
# took 306 (docs/PERFORMANCE.md); below, it reads its 0.5 GB of weights either way.
LM_HEAD_TUNE_ROWS = 128
# Batch-invariant: timed batch-1 decode steps with and without gemv_chain on a shape, alternating, the median of each
# kept (choose_chain_shapes)
CHAIN_STEP_RUNS = 7
FP8_ACC_ROWS = 256  # rows of the FP8 fallback's float32 accumulator (linear.py Fp8Scratch)


def _quantized(codes: DeviceTensor | None) -> dict[str, int]:
    """The norm launchers' quantized-row arguments for an FP8 input's buffer: f16 code values (the GEMV's x) as
    values, e4m3 codes (the GEMM's) as codes, with their scales; none for None."""
    if codes is None:
        return {}
    return {"values" if codes.dtype == F16 else "codes": codes.ptr, "scales": codes.scale.ptr}


def decode_buckets(max_seqs: int) -> list[int]:
    """The batch sizes decode steps are padded to (one CUDA graph each): 1, 2, 4, then multiples of 8, and
    max_seqs."""
    return sorted({b for b in (1, 2, 4, *range(8, max_seqs + 1, 8)) if b < max_seqs} | {max_seqs})


class Buffers(Protocol):
    """A step's input (or output) device buffers by name (runner.Staging)."""

    def ptr(self, name: str, index: int = 0) -> int: ...


@dataclass(frozen=True)
class Activations:
    """The forward's own device buffers: t rows of activations (a prefill chunk's tokens), s of sampling (the
    sequences of a step)."""

    x: DeviceTensor  # f32 [t, hidden]: the residual stream
    h: DeviceTensor  # bf16 [t, hidden]: normalized activations (GEMM input)
    # FP8 weights: h's first GEMV_MAX_ROWS rows quantized by the norm that writes h, f16 values of e4m3 codes with a
    # scale per row (the FP8 GEMV's input, linear.py); None: bf16 weights
    h_codes: DeviceTensor | None
    qkv: DeviceTensor  # bf16 [t, qkv_width]
    attn: DeviceTensor  # bf16 [t, q_width]
    gate_up: DeviceTensor  # bf16 [t, 2 * intermediate]
    act: DeviceTensor  # bf16 [t, intermediate]
    part: DeviceTensor | None  # f32 [t, hidden]: the O or down GEMM's product before its sandwich norm; None: no such
    logits: DeviceTensor  # f32 [s, vocab]
    sample_hidden: DeviceTensor  # bf16 [s, hidden]: final-normed hidden states of the positions that sample
    token_counts: DeviceTensor  # i32 [s, vocab]: the logits processors' token counts, a slot per running sequence
    prompt_mask: DeviceTensor  # u8 [s, vocab]
    partial_o: DeviceTensor  # f32 [rows, head_dim]: attention_decode's parts of a cut context
    partial_ml: DeviceTensor  # f32 [rows, 2]: their (max, sum) pairs (float2)
    workspace: DeviceTensor  # u8 [WORKSPACE_BYTES]: cuBLAS's


@dataclass(frozen=True)
class KVCache:
    """K and V of every layer, [num_blocks * block_size, kv_heads, head_dim] bf16 (or e4m3 codes) each, in one
    allocation; `pointers` lists the 2 * layers caches (u64, for copy_blocks)."""

    memory: DeviceTensor  # u8 [2 * layers * layer_bytes]
    k: list[int]
    v: list[int]
    pointers: DeviceTensor


class CudaForward:
    """The model on the GPU, for steps of up to max_tokens tokens (prefill chunks) and max_num_seqs sequences."""

    chain8_candidates: frozenset[tuple[int, int]] = frozenset()  # batch-invariant: set by _chain_shapes

    def __init__(self, model, engine_config: EngineConfig, device: Device, stream: cuda.Stream,
                 max_tokens: int) -> None:
        cfg = self.config = model.config
        self.engine_config = engine_config
        check_cuda_kernels(cfg, engine_config.max_model_len)
        if cfg.head_dim not in HEAD_DIMS:
            raise ValueError(f"the cuda backend supports head_dim {HEAD_DIMS}, not {cfg.head_dim}")
        if cfg.hidden_size % VECTOR or cfg.intermediate_size % VECTOR:
            raise ValueError(f"the cuda backend needs hidden_size and intermediate_size divisible by {VECTOR}")
        self.invariant = engine_config.batch_invariant
        if self.invariant and cfg.num_experts:
            raise ValueError("batch_invariant on the cuda backend does not cover expert (MoE) models: their kernels "
                             "choose a path by the batch size; run without it, or on the numpy backend")
        self.device, self.stream = device, stream
        self.device_name = device.name
        self.num_sms = device.num_sms

        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.group = self.heads // self.kv_heads
        self.q_width = self.heads * self.head_dim
        self.kv_width = self.kv_heads * self.head_dim
        self.qkv_width = self.q_width + 2 * self.kv_width
        self.scale = cfg.attention_scale  # head_dim ** -0.5, or query_pre_attn_scalar ** -0.5 (Gemma)
        # each layer's sliding window (0: none) and attention-logit soft cap (0: none), as the attention kernels take
        self.windows = [window or 0 for window in cfg.layer_windows]
        self.softcap = cfg.attn_logit_softcapping or 0.0
        self.norm_offset = float(cfg.norm_offset)  # every RMSNorm multiplies by (norm_offset + gain)
        # HF multiplies the embeddings by sqrt(hidden) in the model's dtype (Gemma): here bf16
        self.embed_scale = float(bf16_to_f32(f32_to_bf16(np.array([cfg.embed_scale], np.float32)))[0])
        self.max_tokens, self.max_seqs = max_tokens, engine_config.max_num_seqs

        self.kv_entry_bytes = 1 if engine_config.fp8_kv_cache else 2  # e4m3 codes or bf16
        # an fp8 cache's (K, V) scales of each layer: device float32 [kv_heads] each (model/kv_scales.py)
        self.kv_scales: list[tuple[int, int] | None] = [None] * cfg.num_hidden_layers
        if engine_config.fp8_kv_cache:
            scales = kv_cache_scales(model.weights, cfg, model.kv_cache_scales)
            k_scales, v_scales = (device.upload(s, F32) for s in scales)
            self.kv_scales = [(k_scales.row(i), v_scales.row(i)) for i in range(cfg.num_hidden_layers)]
        weights = WeightUploader(model, engine_config, device, stream)
        self.fp8, self.block_codes, self.fp8_experts = weights.fp8, weights.block_codes, weights.fp8_experts
        check_moe_config(cfg, self.fp8_experts)
        weights.upload(model.weights)
        if engine_config.quantize_lm_head:  # FP8 weights: backends.create_backend refuses it otherwise
            weights.quantize_lm_head()
        self.embed, self.lm_head, self.final_norm = weights.embed, weights.lm_head, weights.final_norm
        self.layers = weights.layers
        self._allocate_buffers()
        self.blas = device.cublas(stream, self.buf.workspace, exact_rows=frozenset(decode_buckets(self.max_seqs)),
                                  invariant=self.invariant)
        self.ops = device.ops(stream)
        # each layer's per-head q/k norms as rope_and_cache applies them (None: none, or _qk_norm runs before it)
        self.rope_norms = [self._rope_qk_norm(layer) for layer in self.layers]
        # our GEMV for a few rows, else cuBLAS; batch-invariant: the step ms of each shape's forms
        # (choose_chain_shapes), the shapes that may run in 8-row chains (_chain_shapes)
        self.chain_timings: dict[tuple[int, int], dict[str, float]] = {}
        self.linear = Linear(self.blas, self.ops, fp8=self.fp8_scratch, invariant=self.invariant,
                             chain_shapes=self._chain_shapes() if self.invariant else None)
        self.kv: KVCache | None = None
        self.k_cache: list[int] = []
        self.v_cache: list[int] = []

    # ---- memory ----------------------------------------------------------------------------------------------------

    def num_splits(self, num_seqs: int) -> int:
        return decode_splits(num_seqs, self.kv_heads, self.group, self.num_sms, self.head_dim)

    def partial_slots(self, num_seqs: int) -> int:
        """attention_decode's partial_o rows per (sequence, head) at this batch: a part's each, or (batch-invariant)
        a chunk's each, the form's INVARIANT_PARTS."""
        splits = self.num_splits(num_seqs)
        return INVARIANT_PARTS if self.invariant and splits > 1 else splits

    def _allocate_buffers(self) -> None:
        cfg, t, s = self.config, self.max_tokens, self.max_seqs
        hidden, inter, vocab, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, self.head_dim
        partial_rows = max(n * self.partial_slots(n) for n in range(1, s + 1)) * self.heads
        empty = self.device.empty
        self.buf = Activations(
            x=empty(F32, (t, hidden)), h=empty(BF16, (t, hidden)), h_codes=self._empty_codes(hidden),
            qkv=empty(BF16, (t, self.qkv_width)),
            attn=empty(BF16, (t, self.q_width)), gate_up=empty(BF16, (t, 2 * inter)), act=empty(BF16, (t, inter)),
            part=empty(F32, (t, hidden)) if cfg.sandwich_norms else None,
            logits=empty(F32, (s, vocab)), sample_hidden=empty(BF16, (s, hidden)),
            token_counts=empty(I32, (s, vocab)), prompt_mask=empty(U8, (s, vocab)),
            partial_o=empty(F32, (partial_rows, d)), partial_ml=empty(F32, (partial_rows, 2)),
            workspace=empty(U8, (WORKSPACE_BYTES,)))
        self.moe_buf = allocate_moe_buffers(self.device, cfg, t, fp8=self.fp8_experts)
        widest_input = max(hidden, self.q_width, inter)
        self.fp8_scratch = None if not self.fp8 else Fp8Scratch(
            codes=empty(E4M3, (t, widest_input)), scales=empty(F32, (t,)),
            acc=empty(F32, (min(t, FP8_ACC_ROWS), max(self.qkv_width, 2 * inter, hidden))),
            values=empty(F16, (GEMV_MAX_ROWS, widest_input)),
            group_scales=empty(F32, (t * -(-widest_input // SCALE_BLOCK),)) if self.block_codes else None)
        cuda.memset_d32(self.buf.token_counts.ptr, 0, self.buf.token_counts.numel)
        cuda.memset_d8(self.buf.prompt_mask.ptr, 0, self.buf.prompt_mask.numel)
        # float2 [max_model_len, rotary_dim / 2] per distinct RoPE (model/rope.py), and each layer's
        tables, layer_table = cos_sin_tables(cfg, self.engine_config.max_model_len)
        self.rope_tables = [self.device.upload(table, F32) for table in tables]
        self.cos_sin = [self.rope_tables[t].ptr for t in layer_table]

    def kv_bytes_per_block(self) -> int:
        return 2 * self.config.num_hidden_layers * self.engine_config.block_size * self.kv_width * self.kv_entry_bytes

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """K and V of every layer, [num_blocks * block_size, kv_heads, head_dim] bf16 (or e4m3 codes) each, in one
        allocation (a cache allocated before is freed first).

        Only block 0 is zeroed (zeroing ~120 GB took 38 ms on an H200): attention reads a slot only after the step
        that owns it wrote it (keys before a row's context end; rope_and_cache runs before attention; past the
        end the kernels load zeros), except the padded rows of a decode batch, which read slot 0 of block 0. Their
        output is dropped, and rows never mix, but zeros keep them finite."""
        self.free_kv_cache()
        layers = range(self.config.num_hidden_layers)
        block_bytes = self.engine_config.block_size * self.kv_width * self.kv_entry_bytes  # of one layer's K (or V)
        layer_bytes = num_blocks * block_bytes
        memory = self.device.empty(U8, (num_blocks * self.kv_bytes_per_block(),))
        caches = [memory.ptr + c * layer_bytes for c in range(2 * len(layers))]  # K0, V0, K1, V1, ...
        self.k_cache, self.v_cache = caches[0::2], caches[1::2]
        for cache in caches:
            cuda.memset_d32(cache, 0, block_bytes // 4)
        self.kv = KVCache(memory, self.k_cache, self.v_cache, self.device.upload(np.array(caches, np.uint64), U64))

    def free_kv_cache(self) -> None:
        if self.kv is not None:
            self.device.free(self.kv.memory)
            self.device.free(self.kv.pointers)
        self.kv, self.k_cache, self.v_cache = None, [], []

    def copy_blocks(self, pairs: int, num_pairs: int) -> None:
        """Copy KV blocks (source, destination) (pairs: device int32 [num_pairs, 2]) in every layer's K and V."""
        self.ops.copy_blocks(self.kv.pointers.ptr, self.kv.pointers.numel, pairs, num_pairs,
                             self.engine_config.block_size * self.kv_width * self.kv_entry_bytes // 2)

    def init_token_slots(self, slots: int, num_slots: int, tokens: int, token_slots: int, num_tokens: int) -> None:
        """Reset the token-count slots `slots` (device int32 [num_slots]) to `tokens`, token i going to slot
        token_slots[i]'s output counts, or (as -1 - slot) its prompt mask."""
        vocab, b = self.config.vocab_size, self.buf
        self.ops.clear_token_slots(b.token_counts.ptr, b.prompt_mask.ptr, vocab, slots, num_slots)
        if num_tokens:
            self.ops.fill_token_slots(b.token_counts.ptr, b.prompt_mask.ptr, vocab, tokens, token_slots, num_tokens)

    def on_stream(self, stream: cuda.Stream) -> CudaForward:
        """The same model (weights, buffers, KV cache) launching on another stream, with a cuBLAS handle of its own:
        what another thread captures graphs with. Its close() releases that handle only."""
        other = copy.copy(self)
        other.stream = stream
        other.blas = self.device.cublas(stream, self.buf.workspace, exact_rows=self.blas.exact_rows,
                                        algos=self.blas.algos, invariant=self.invariant)
        other.ops = self.device.ops(stream)
        other.linear = Linear(other.blas, other.ops, fp8=self.fp8_scratch, invariant=self.invariant,
                              chain_shapes=self.linear.chain_shapes, chain8_shapes=self.linear.chain8_shapes)
        return other

    def close(self) -> None:
        """Release this forward's cuBLAS handle now; its memory is the Device's, freed by Device.close()."""
        if not self.device.closed:
            self.device.release(self.blas)

    # ---- the launch sequence ---------------------------------------------------------------------------------------

    def _layers(self, n: int, inp: Buffers, out: Buffers,
                attention: Callable[[int], DeviceTensor | None]) -> None:
        """Embed n tokens and run every layer on them, the residual stream ending in buf.x. attention(i) writes
        layer i's attention into buf.attn, or returns where it wrote it quantized for the O product."""
        cfg, b, ops, linear = self.config, self.buf, self.ops, self.linear
        hidden, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset
        # tokens sampled by the previous step, which is queued before this one but not read back yet
        ops.resolve_tokens(inp.ptr("token_ids"), inp.ptr("token_src"), out.ptr("ids"), n)
        ops.embedding(b.x.ptr, self.embed.ptr, inp.ptr("token_ids"), n, hidden, self.embed_scale)
        for i, layer in enumerate(self.layers):
            codes = self._h_codes(n)
            ops.rms_norm(b.h.ptr, b.x.ptr, layer.input_norm.ptr, 0, n, hidden, eps, offset, **_quantized(codes))
            linear.gemm(b.qkv, b.h, layer.qkv, n, x_codes=codes)
            if layer.qkv_bias is not None:
                ops.add_qkv_bias(b.qkv.ptr, layer.qkv_bias.ptr, n, self.qkv_width)
            if layer.q_norm is not None and self.rope_norms[i] is None:
                self._qk_norm(layer, n)
            ops.rope_and_cache(b.qkv.ptr, self.k_cache[i], self.v_cache[i], inp.ptr("positions"),
                               inp.ptr("slot_mapping"), self.cos_sin[i], n, self.heads, self.kv_heads,
                               self.head_dim, self.qkv_width, self.kv_scales[i], cfg.rotary_dim, self.rope_norms[i])
            o_codes = attention(i)  # O's input quantized by attention's merge, or None
            self._add_to_residual(n, b.attn, layer.o, layer.attn_out_norm, layer.post_norm, o_codes)
            if layer.router is not None:  # an expert layer (ModelConfig.moe_layer)
                fused_moe(ops, linear, self.moe_buf, layer, b.x, b.h, n, cfg, self._moe_codes(n))
            else:
                act_codes = linear.gate_up_swiglu(b.act, b.h, layer.gate_up, n, b.gate_up, cfg.activation, codes,
                                                  down_e4m3=layer.down.dtype == E4M3)
                self._add_to_residual(n, b.act, layer.down, layer.mlp_out_norm, x_codes=act_codes)

    def _add_to_residual(self, n: int, x: DeviceTensor, w: DeviceTensor, out_norm: DeviceTensor | None,
                         next_norm: DeviceTensor | None = None, x_codes: DeviceTensor | None = None) -> None:
        """buf.x += x . w^T (the O or down projection; x_codes: x quantized, Linear.gemm's), normalized by out_norm
        first where the layer has sandwich norms; then, with next_norm, buf.h = rms_norm(buf.x) * next_norm (the next
        GEMM's input). Without out_norm the GEMM adds into the residual stream itself; with it, it writes buf.part,
        which rms_norm_residual adds."""
        cfg, b, ops = self.config, self.buf, self.ops
        hidden, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset
        if out_norm is None:
            self.linear.gemm(b.x, x, w, n, accumulate=True, x_codes=x_codes)
            if next_norm is not None:
                ops.rms_norm(b.h.ptr, b.x.ptr, next_norm.ptr, 0, n, hidden, eps, offset,
                             **_quantized(self._h_codes(n)))
            return
        self.linear.gemm(b.part, x, w, n, x_codes=x_codes)
        ops.rms_norm_residual(0 if next_norm is None else b.h.ptr, b.x.ptr, b.part.ptr, out_norm.ptr,
                              0 if next_norm is None else next_norm.ptr, n, hidden, eps, offset,
                              **_quantized(None if next_norm is None else self._h_codes(n)))

    def _empty_codes(self, width: int) -> DeviceTensor | None:
        """FP8 weights: a GEMV input's buffer (f16 values [GEMV_MAX_ROWS, width] with f32 scales), else None (also
        for block-scaled codes: their inputs are quantized per 128 columns by the product itself)."""
        if not self.fp8 or self.block_codes:
            return None
        values = self.device.empty(F16, (GEMV_MAX_ROWS, width))
        return dataclasses.replace(values, scale=self.device.empty(F32, (GEMV_MAX_ROWS,)))

    def _h_codes(self, n: int) -> DeviceTensor | None:
        """Where the norm writing buf.h quantizes its n rows for the next FP8 product (FP8 weights; else None): the
        f16 code values of buf.h_codes for the FP8 GEMV (n <= 8), else the e4m3 codes of Linear.input_codes."""
        codes = self.buf.h_codes
        if codes is None:
            return None
        if self.linear.uses_fp8_gemv(n, codes.shape[-1]):
            return codes
        return self.linear.input_codes(n, codes.shape[-1])

    def _moe_codes(self, n: int) -> DeviceTensor | None:
        """e4m3 experts: buf.h as the norm before an expert layer quantized it, where that is the f16 code values
        the expert kernels read (n <= 8: the FP8 GEMV's input, _h_codes), else None (fused_moe quantizes h)."""
        codes = self._h_codes(n) if self.fp8_experts else None
        return codes if codes is not None and codes.dtype == F16 else None

    def _rope_qk_norm(self, layer: DeviceLayer) -> QkNorm | None:
        """The layer's per-head q/k norms for rope_and_cache to apply (None: none, or not fusable: _qk_norm runs)."""
        cfg = self.config
        if layer.q_norm is None or not cfg.qk_norm_per_head or not rope_fuses_qk_norm(self.head_dim, cfg.rotary_dim):
            return None
        return QkNorm(layer.q_norm.ptr, layer.k_norm.ptr, cfg.rms_norm_eps, self.norm_offset)

    def _qk_norm(self, layer: DeviceLayer, n: int) -> None:
        """RMSNorm of each Q and K head (Qwen3, Gemma 3), or of each token's whole Q and whole K (OLMoE), in place."""
        cfg, qkv = self.config, self.buf.qkv.ptr
        if cfg.qk_norm_per_head:
            self.ops.qk_norm(qkv, layer.q_norm.ptr, layer.k_norm.ptr, n, self.heads, self.kv_heads, self.head_dim,
                             self.qkv_width, cfg.rms_norm_eps, self.norm_offset)
        else:
            self.ops.qk_norm_projection(qkv, layer.q_norm.ptr, layer.k_norm.ptr, n, self.q_width, self.kv_width,
                                        self.qkv_width, cfg.rms_norm_eps)

    def _chain_shapes(self) -> set[tuple[int, int]]:
        """Batch-invariant: the bf16 weight shapes whose products of up to 8 rows may run as gemv_chain, where the
        chain gives the bits of cuBLAS's pinned algorithm (_chain_matches). All of them do, until the backend times
        whole decode steps with and without each (choose_chain_shapes): a chain is one warp's dependent mmas per
        16-row tile, so a wide shape's many tiles fill the GPU, a narrow one's few with a short k may still finish
        first, and with a long k cuBLAS's pinned tiles win (docs/PERFORMANCE.md). The ungated shapes (QKV, O, down,
        the LM head) whose chain in 8-row tiles (twice the tiles) gives those bits too go in chain8_candidates."""
        def usable(w: DeviceTensor | None) -> bool:
            return w is not None and w.dtype == BF16 and w.shape[1] % MMA_K == 0

        ungated = {w.shape: w for layer in self.layers for w in (layer.qkv, layer.o, layer.down) if usable(w)}
        if usable(self.lm_head):
            ungated[self.lm_head.shape] = self.lm_head
        gated = {layer.gate_up.shape: layer.gate_up for layer in self.layers if usable(layer.gate_up)}
        self.chain8_candidates = frozenset(shape for shape, w in ungated.items() if self._chain_matches(w, tile_rows=8))
        return {shape for shape, w in {**gated, **ungated}.items() if self._chain_matches(w)}

    def choose_chain_shapes(self, step_with: Callable[[frozenset, frozenset], Callable[[], None]]) -> None:
        """Keep gemv_chain on the shapes where it makes a batch-1 decode step faster, in the tiles that make it
        fastest: for each candidate shape in turn, step_with(chain, chain8) gives a function that queues one step
        whose products of the shapes `chain` run the chain, those of `chain8` in 8-row tiles; the step without the
        candidate's chain and with it in each tile it may run in run once untimed, then CHAIN_STEP_RUNS times each,
        alternating (a GPU still raising its clocks slows them alike), and the least median decides (a tie: cuBLAS).
        Timed in the step, a product's time includes what it overlaps (the previous kernel's end, under programmatic
        dependent launch) and what the next one waits for, as a decode step has them. The times are kept in
        chain_timings (shape -> {form: ms})."""
        chain, chain8 = frozenset(self.linear.chain_shapes), frozenset(self.linear.chain8_shapes)
        candidates = set(chain)
        for shape in sorted(candidates | self.chain8_candidates):
            forms = {"cuBLAS": (chain - {shape}, chain8 - {shape})}
            if shape in candidates:
                forms["chain"] = (chain | {shape}, chain8 - {shape})
            if shape in self.chain8_candidates:
                forms["chain8"] = (chain | {shape}, chain8 | {shape})
            medians = self._step_medians({form: step_with(*sets) for form, sets in forms.items()})
            self.chain_timings[shape] = medians
            log.info("batch-invariant: n %d, k %d: a batch-1 decode step %s", *shape,
                     ", ".join(f"{form} {ms * 1e3:.1f} us" for form, ms in medians.items()))
            chain, chain8 = forms[min(medians, key=lambda form: (medians[form], form != "cuBLAS"))]
        self.linear.chain_shapes, self.linear.chain8_shapes = set(chain), set(chain8)

    def _step_medians(self, steps: dict[str, Callable[[], None]]) -> dict[str, float]:
        """Each step run once untimed, then CHAIN_STEP_RUNS times in turn: the median ms of each."""
        for step in steps.values():
            step()
        times: dict[str, list[float]] = {form: [] for form in steps}
        for _ in range(CHAIN_STEP_RUNS):
            for form, step in steps.items():
                times[form].append(self._elapsed(step))
        return {form: sorted(runs)[len(runs) // 2] for form, runs in times.items()}

    def _elapsed(self, run: Callable[[], None]) -> float:
        """The GPU time in ms of what run() queues on the stream."""
        start, end = cuda.Event(), cuda.Event()
        start.record(self.stream)
        run()
        end.record(self.stream)
        end.synchronize()
        return end.time_since(start)

    def _chain_matches(self, w: DeviceTensor, tile_rows: int = GEMV_TILE_ROWS) -> bool:
        """Whether gemv_chain (in tiles of tile_rows rows) gives 8 random rows times w the bits of cuBLAS's pinned
        algorithm, checked once per shape: bench/gemm_order.py finds split-free algorithms adding as the chain does,
        but not every one, and a shape whose algorithm does not stays on cuBLAS (the invariance holds either way)."""
        n, k = w.shape
        rng = np.random.default_rng(n + k)
        x = self.device.upload(f32_to_bf16(rng.standard_normal((GEMV_MAX_ROWS, k), dtype=np.float32)), BF16)
        outs = [self.device.empty(F32, (GEMV_MAX_ROWS, n)) for _ in range(2)]
        self.ops.gemv_chain(outs[0].ptr, x.ptr, w.ptr, GEMV_MAX_ROWS, n, k, True, False, tile_rows=tile_rows)
        self.blas.gemm(outs[1], x, w, GEMV_MAX_ROWS)
        self.stream.synchronize()
        chain, blas = (cuda.from_device(out.ptr, out.shape, np.uint32) for out in outs)
        for tensor in (x, *outs):
            self.device.free(tensor)
        if not np.array_equal(chain, blas):
            log.warning("batch-invariant: gemv_chain in %d-row tiles does not add as cuBLAS's algorithm for n %d, "
                        "k %d; those products do not run so", tile_rows, n, k)
            return False
        return True

    def tune_lm_head(self, buckets: list[int]) -> dict[int, int]:
        """Choose the LM head's GEMM algorithm by timing at each decode bucket of LM_HEAD_TUNE_ROWS rows or more
        (before any graph captures it), on the logits buffer with rows of the LM head's own weights as input.
        Returns the candidate kept per bucket (0: the heuristics' first); batch-invariant or an FP8 LM head: none
        (one algorithm; cuBLASLt's FP8 path is not tuned)."""
        if self.invariant or self.lm_head.dtype == E4M3:
            return {}
        return {m: self.blas.tune(self.buf.logits, self.lm_head, self.lm_head, m, self._elapsed)
                for m in buckets if m >= LM_HEAD_TUNE_ROWS}

    def compute_logits(self, n: int, hidden_rows: DeviceTensor, x_codes: DeviceTensor | None = None) -> None:
        """The float32 logits of the first n final-normed rows of hidden_rows (bf16 [>= n, hidden]; x_codes: them
        quantized by the norm, for an FP8 LM head's GEMV) into buf.logits, soft-capped where the model caps them
        (final_logit_softcapping), before anything reads them."""
        self.linear.gemm(self.buf.logits, hidden_rows, self.lm_head, n, x_codes=x_codes)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            self.ops.soft_cap(self.buf.logits.ptr, n, self.config.vocab_size, cap)

    def sample_logits(self, n: int, inp: Buffers, out: Buffers, proc: Buffers, last_tokens: int,
                      masks: Buffers | None = None) -> None:
        """From n rows of logits: structured outputs' token masks (masks: "bitmask" and per-row "bitmask_rows";
        None: no row has one), the logits processors (proc: LogitsProcessing's arrays; rows without any return at
        once), then one sampled token per row into out["ids"], counted in the token-count table for rows that keep
        it. last_tokens: each row's last input token (device int32 [n])."""
        b, vocab = self.buf, self.config.vocab_size
        if masks is not None:
            self.ops.apply_token_bitmask(b.logits.ptr, n, vocab, masks.ptr("bitmask"), masks.ptr("bitmask_rows"))
        # out["ids"] still holds the previous step's tokens here: a last input token not known to the host is there
        self.ops.apply_logits_processors(b.logits.ptr, n, vocab, last_tokens, proc.ptr("last_src"), out.ptr("ids"),
                                         proc.ptr("penalty_slots"), proc.ptr("presence"), proc.ptr("frequency"),
                                         proc.ptr("repetition"), b.token_counts.ptr, b.prompt_mask.ptr,
                                         proc.ptr("allowed_ptr"), proc.ptr("allowed_ids"), proc.ptr("bias_ptr"),
                                         proc.ptr("bias"))
        self.ops.sample(out.ptr("ids"), b.logits.ptr, n, vocab, inp.ptr("temperature"), inp.ptr("top_p"),
                        inp.ptr("top_k"), inp.ptr("min_p"), inp.ptr("noise_keys"), row_split=not self.invariant)
        self.ops.count_tokens(b.token_counts.ptr, vocab, out.ptr("ids"), proc.ptr("count_slots"), n)

    def decode(self, n: int, inp: Buffers, out: Buffers, proc: Buffers, sample: bool = True) -> None:
        """One decode step of n (bucket-padded) sequences, sampled ids into out (sample=False: up to the logits):
        what a graph captures."""
        b = self.buf
        splits = self.num_splits(n)

        def attention(i: int) -> DeviceTensor | None:
            codes = self.linear.quantized_input(self.layers[i].o, n)  # an FP8 O: the merge may quantize its input
            quantized = None if codes is None else QuantizedOutput(codes.ptr, codes.scale.ptr, codes.dtype == F16)
            merged = self.ops.attention_decode(b.attn.ptr, b.partial_o.ptr, b.partial_ml.ptr, b.qkv.ptr,
                                               self.k_cache[i], self.v_cache[i], inp.ptr("block_tables"),
                                               inp.ptr("bt_stride"), inp.ptr("context_lens"), n, self.scale,
                                               self.heads, self.kv_heads, self.head_dim, self.engine_config.block_size,
                                               self.qkv_width, splits, self.kv_scales[i], self.windows[i],
                                               self.softcap, self.invariant, quantized)
            return codes if merged else None

        self._layers(n, inp, out, attention)
        codes = self._h_codes(n) if self.lm_head.dtype == E4M3 else None
        self.ops.rms_norm(b.h.ptr, b.x.ptr, self.final_norm.ptr, 0, n, self.config.hidden_size,
                          self.config.rms_norm_eps, self.norm_offset, **_quantized(codes))
        self.compute_logits(n, b.h, codes)
        if sample:
            self.sample_logits(n, inp, out, proc, inp.ptr("token_ids"))  # resolved by _layers

    def prefill(self, n: int, inp: Buffers, out: Buffers, num_tiles: int, bt_width: int) -> None:
        """n tokens of a prefill chunk through every layer, attention over num_tiles tiles (ops.prefill_tiles)."""
        b = self.buf

        def attention(i: int) -> DeviceTensor | None:
            self.ops.attention_prefill(b.attn.ptr, b.qkv.ptr, self.k_cache[i], self.v_cache[i],
                                       inp.ptr("block_tables"), bt_width, inp.ptr("query_start_loc"),
                                       inp.ptr("context_lens"), inp.ptr("tile_seq"), inp.ptr("tile_row0"),
                                       num_tiles, self.scale, self.heads, self.kv_heads, self.head_dim,
                                       self.engine_config.block_size, self.qkv_width, self.kv_scales[i],
                                       self.windows[i], self.softcap, self.invariant)
            return None

        self._layers(n, inp, out, attention)

    def norm_sample_rows(self, first_seq: int, rows: int, count: int) -> None:
        """Final-norm `count` rows of the residual stream (rows: device int32) into the sample_hidden rows of
        sequences first_seq.."""
        cfg = self.config
        self.ops.rms_norm(self.buf.sample_hidden.row(first_seq), self.buf.x.ptr, self.final_norm.ptr, rows, count,
                          cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)

    def sample_prefill(self, num_seqs: int, inp: Buffers, out: Buffers, proc: Buffers,
                       masks: Buffers | None = None) -> None:
        """Sample one token per sequence from the logits of its sample_hidden row (compute_logits first)."""
        self.sample_logits(num_seqs, inp, out, proc, proc.ptr("last_tokens"), masks)

    def logprobs(self, n: int, token_ids: int, k: int, dest: tuple[int, int, int], rows: int = 0) -> None:
        """Logprobs of token_ids (device int32, a row each) and the top k of n rows of logits: rows 0..n-1, or
        (rows: device int32 [n]) those rows, each into its own row of dest (the token's logprob: float32 [rows],
        the top ids: int32 [rows, k], their logprobs: float32 [rows, k])."""
        self.ops.logprobs(*dest, self.buf.logits.ptr, token_ids, n, self.config.vocab_size, k, rows,
                          row_split=not self.invariant)

    def prompt_logprobs(self, m: int, rows: int, targets: int, k: int, dest: tuple[int, int, int]) -> None:
        """Logprobs of targets (device int32 [m]) at m rows of the residual stream (rows: device int32), into
        dest (as logprobs')."""
        cfg, buf = self.config, self.buf
        self.ops.rms_norm(buf.h.ptr, buf.x.ptr, self.final_norm.ptr, rows, m, cfg.hidden_size, cfg.rms_norm_eps,
                          self.norm_offset)
        self.compute_logits(m, buf.h)
        self.logprobs(m, targets, k, dest)
