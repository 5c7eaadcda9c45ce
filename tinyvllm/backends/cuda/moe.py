"""The mixture-of-experts MLP of one layer on the GPU: the launch sequence of cuda/moe.cu and its buffers.

router GEMM (float32 logits) -> moe_topk_softmax -> moe_align (assignments grouped by expert, each run padded to the
tile of the path this batch takes) -> moe_gate_up (SwiGLU fused) -> moe_down (times the routing weight) -> moe_sum
(each token's rows in slot order, into the residual stream). A decode batch takes the GEMV kernels (tiles of 8
assignments: only the chosen experts' weights are read, each once per tile), a larger one the grouped GEMM over
tiles of 32 or 64 (ops.moe_block_m). Every kernel's grid is sized for the batch's most tiles and reads the counts on
the device, so a decode step stays capturable in a CUDA graph.

The experts are stacked [num_experts, rows, columns] bf16 (experts_gate_up: each expert's gate rows, then its up
rows, not interleaved; experts_down), so that an FP8 form is a DeviceTensor of e4m3 codes with a scale
[num_experts, rows] (per expert and output channel), as the dense layers' are per row.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.backends.cuda.ops import (MOE_GEMM_BLOCK_MS, MOE_GEMV_TILE, MOE_MAX_EXPERTS, VECTOR, Ops, moe_block_m,
                                        moe_max_tiles)
from tinyvllm.backends.cuda.tensors import BF16, F32, I32, DeviceLayer, DeviceTensor


@dataclass(frozen=True)
class MoeBuffers:
    """The device buffers of one expert layer's step of up to t tokens (shared by the layers)."""

    router_logits: DeviceTensor  # f32 [t, num_experts]
    topk_weights: DeviceTensor  # f32 [t, top_k]
    topk_ids: DeviceTensor  # i32 [t, top_k]
    sorted_ids: DeviceTensor  # i32 [most padded rows]: assignments grouped by expert (moe_align)
    expert_ids: DeviceTensor  # i32 [most tiles]: each tile's expert
    num_post_padded: DeviceTensor  # i32 [1]
    act: DeviceTensor  # bf16 [most padded rows, moe_intermediate]: SwiGLU of the gate/up product, per padded row
    rows: DeviceTensor  # f32 [t * top_k, hidden]: each assignment's weighted down product


def check_moe_config(cfg) -> None:
    """ValueError for an expert configuration the kernels cannot run."""
    if cfg.num_experts > MOE_MAX_EXPERTS:
        raise ValueError(f"the cuda backend's MoE kernels take at most {MOE_MAX_EXPERTS} experts, not "
                         f"{cfg.num_experts}")
    if cfg.moe_intermediate_size % VECTOR:
        raise ValueError(f"the cuda backend needs moe_intermediate_size divisible by {VECTOR}, not "
                         f"{cfg.moe_intermediate_size}")


def max_padded_rows(num_tokens: int, top_k: int, num_experts: int) -> tuple[int, int]:
    """(padded rows, tiles) that moe_align can make of up to num_tokens tokens, whichever tile their batch takes."""
    assignments = num_tokens * top_k
    tiles = {m: moe_max_tiles(assignments, num_experts, m) for m in (MOE_GEMV_TILE, *MOE_GEMM_BLOCK_MS)}
    return max(m * n for m, n in tiles.items()), max(tiles.values())


def allocate_moe_buffers(device, cfg, t: int) -> MoeBuffers | None:
    """The MoE buffers for steps of up to t tokens (None for a dense model)."""
    if not cfg.num_experts:
        return None
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    rows, tiles = max_padded_rows(t, k, e)
    return MoeBuffers(
        router_logits=device.empty(F32, (t, e)), topk_weights=device.empty(F32, (t, k)),
        topk_ids=device.empty(I32, (t, k)), sorted_ids=device.empty(I32, (rows,)), expert_ids=device.empty(I32, (tiles,)),
        num_post_padded=device.empty(I32, (1,)), act=device.empty(BF16, (rows, cfg.moe_intermediate_size)),
        rows=device.empty(F32, (t * k, cfg.hidden_size)))


def fused_moe(ops: Ops, linear, buf: MoeBuffers, layer: DeviceLayer, x: DeviceTensor, h: DeviceTensor, n: int,
              cfg) -> None:
    """x[:n] (float32, the residual stream) += the experts' weighted sum for the n normed rows h (bf16 [>= n,
    hidden]).  Twin: backends/moe.py fused_moe after route."""
    e, k, hidden, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    linear.gemm(buf.router_logits, h, layer.router, n)
    ops.moe_topk_softmax(buf.topk_weights.ptr, buf.topk_ids.ptr, buf.router_logits.ptr, n, e, k, cfg.norm_topk_prob)
    index = (buf.sorted_ids.ptr, buf.expert_ids.ptr, buf.num_post_padded.ptr)
    ops.moe_align(*index, buf.topk_ids.ptr, n * k, e, moe_block_m(n, k, e))
    ops.moe_gate_up(buf.act.ptr, h.ptr, layer.experts_gate_up.ptr, *index, n, k, e, hidden, inter)
    ops.moe_down(buf.rows.ptr, buf.act.ptr, layer.experts_down.ptr, *index, buf.topk_weights.ptr, n, k, e, hidden,
                 inter)
    ops.moe_sum(x.ptr, buf.rows.ptr, n, k, hidden)
