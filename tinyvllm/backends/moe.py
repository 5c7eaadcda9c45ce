"""The mixture-of-experts MLP on the host (numpy, float32): the twin a fused CUDA MoE kernel follows, step by step.

1. route: each token's router logits [T, E] -> softmax probabilities (float32) -> the top-k experts by probability,
   highest first, and their weights: the probabilities themselves, or renormalized to sum to 1 over the k chosen
   (norm_topk_prob; Mixtral always, which is the softmax over the k chosen logits). Ties are broken as torch.topk
   on the CPU breaks them (backends/topk.py), so that a router's choice is HF's whatever its logits.
2. group_by_expert, the grouping contract: the T * k (token, slot) assignments flattened token-major (assignment
   a = token * k + slot) and sorted by expert id, stably, so that within an expert the assignments keep token order;
   offsets [E + 1] bound each expert's run (an expert no token chose has an empty run). A kernel may pad each run to
   its GEMM tile; the order within a run is the same.
3. per expert with a non-empty run: gather its tokens' rows, one GEMM with the stacked gate/up weight, SiLU(gate) *
   up, one GEMM with the down weight.
4. each assignment's row times its routing weight, written back to its (token, slot) place, and each token's k rows
   summed in slot order: the output in token order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tinyvllm.backends.host_weight import HostWeight, linear
from tinyvllm.backends.topk import topk
from tinyvllm.model.fp8 import FP8_DTYPE, Fp8Rows, quantize_rows


@dataclass(frozen=True)
class StackedWeight:
    """One layer's experts' weights stacked: data [experts, in, out] in a HostWeight encoding, with scale
    [experts, out] for an encoding that has one (FP8: per expert and output channel), or [experts, *HostWeight's
    block scale] with `block` (an FP8 checkpoint's); input_scale: a checkpoint's static activation scale, one for
    every expert (the largest, as vLLM takes it). expert(e) is expert e's HostWeight, a view of its slice."""

    data: np.ndarray
    dtype: str = "float32"
    scale: np.ndarray | None = None
    block: tuple[int, int] | None = None
    input_scale: float | None = None

    @classmethod
    def from_rows(cls, w: np.ndarray) -> StackedWeight:
        """float32 experts from [experts, out, in] as model/weights.py packs them."""
        return cls(np.ascontiguousarray(np.swapaxes(w, 1, 2), dtype=np.float32))

    @classmethod
    def quantized(cls, w: np.ndarray) -> StackedWeight:
        """e4m3 experts from float [experts, out, in]: each expert's rows quantized as a dense layer's are, one scale
        per expert and output channel (model/fp8.py quantize_rows)."""
        experts, out, n_in = w.shape
        rows = quantize_rows(w.reshape(experts * out, n_in))  # a scale per row is one per expert and channel
        return cls.from_fp8(Fp8Rows(rows.codes.reshape(experts, out, n_in), rows.scale.reshape(experts, out)))

    @classmethod
    def from_fp8(cls, w: Fp8Rows) -> StackedWeight:
        """e4m3 experts from codes [experts, out, in] and their scales (Fp8Rows.by_expert), as stored."""
        scale = w.scale if w.block is None else np.swapaxes(w.scale, 1, 2)
        return cls(np.ascontiguousarray(np.swapaxes(w.codes, 1, 2)), FP8_DTYPE,
                   np.ascontiguousarray(scale, np.float32), w.block, w.input_scale)

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    @cached_property
    def experts(self) -> list[HostWeight]:
        """Each expert's HostWeight, made once (an e4m3 one decodes its values once, at its first product)."""
        return [HostWeight(self.data[e], self.dtype, None if self.scale is None else self.scale[e], self.block,
                           self.input_scale) for e in range(self.num_experts)]

    def expert(self, e: int) -> HostWeight:
        return self.experts[e]


def route(logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [T, E] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]), highest probability first.
    Among equal probabilities the experts torch.topk picks (backends/topk.py), as HF's routers do."""
    z = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    probs = e / e.sum(axis=-1, keepdims=True)
    ids = topk(probs, top_k)
    weights = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(np.float32), ids


def group_by_expert(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids [T, k] -> (assignments [T * k] sorted by expert, stably; offsets [num_experts + 1]): expert e's
    assignments are order[offsets[e]:offsets[e + 1]], each token * k + slot."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    offsets = np.zeros(num_experts + 1, np.int64)
    np.cumsum(np.bincount(flat, minlength=num_experts), out=offsets[1:])
    return order, offsets


def fused_moe(x: np.ndarray, gate_up: StackedWeight, down: StackedWeight, weights: np.ndarray, ids: np.ndarray,
              act: Callable[[np.ndarray], np.ndarray], invariant: bool = False) -> np.ndarray:
    """The experts' weighted sum for each token: x [T, hidden], gate_up stacked [E, hidden, 2 * I] (each expert's
    gate columns, then up), down [E, I, hidden], the routing of `route`; act: [n, 2 * I] -> [n, I] (SiLU-and-mul,
    numpy_backend.silu_and_mul) -> [T, hidden] float32; invariant: each token's result independent of the others
    (its expert products in fixed row blocks, its k rows summed one after another).
    Twin: the fused MoE kernel of the cuda backend."""
    num_tokens, k = ids.shape
    order, offsets = group_by_expert(ids, gate_up.num_experts)
    rows = np.empty((num_tokens * k, x.shape[1]), np.float32)  # one per assignment, in grouped order
    gathered = x[order // k]
    for e in np.flatnonzero(np.diff(offsets)):
        run = slice(offsets[e], offsets[e + 1])
        rows[run] = linear(act(linear(gathered[run], gate_up.expert(e), invariant=invariant)), down.expert(e),
                           invariant=invariant)
    rows *= weights.reshape(-1)[order][:, None]
    out = np.empty_like(rows)
    out[order] = rows  # back to (token, slot) order
    out = out.reshape(num_tokens, k, -1)
    if not invariant:
        return out.sum(axis=1)
    total = out[:, 0].copy()  # numpy's sum over an inner axis may pick its order by the array's shape
    for slot in range(1, k):
        total += out[:, slot]
    return total


def align_block_size(ids: np.ndarray, num_experts: int, block_m: int) -> tuple[np.ndarray, np.ndarray, int]:
    """group_by_expert's order with each expert's run padded to a multiple of block_m rows with the sentinel ids.size
    (vLLM's moe_align_block_size, the layout the CUDA expert kernels read): (sorted_ids int32 [num_post_padded],
    expert_ids int32 [num_post_padded / block_m]: each tile's expert, num_post_padded).  Twin: cuda/moe.cu
    moe_align."""
    order, offsets = group_by_expert(ids, num_experts)
    counts = np.diff(offsets)
    padded = -(-counts // block_m) * block_m
    starts = np.concatenate([[0], np.cumsum(padded)])
    sorted_ids = np.full(int(starts[-1]), ids.size, np.int32)
    for e in np.flatnonzero(counts):
        sorted_ids[starts[e]:starts[e] + counts[e]] = order[offsets[e]:offsets[e + 1]]
    expert_ids = np.repeat(np.arange(num_experts, dtype=np.int32), padded // block_m)
    return sorted_ids, expert_ids, int(starts[-1])
