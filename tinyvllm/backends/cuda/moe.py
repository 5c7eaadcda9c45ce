"""The mixture-of-experts MLP of one layer on the GPU: the launch sequence of cuda/moe.cu and its buffers.

router GEMM (float32 logits) -> moe_topk_softmax -> moe_align (assignments grouped by expert, each run padded to the
tile of the path this batch takes) -> moe_gate_up (SwiGLU fused) -> moe_down (times the routing weight) -> moe_sum
(each token's rows in slot order, into the residual stream). A decode batch takes the GEMV kernels (tiles of 8
assignments: only the chosen experts' weights are read, each once per tile), a larger one the grouped GEMM over
tiles of 32 or 64 (ops.moe_block_m). Every kernel's grid is sized for the batch's most tiles and reads the counts on
the device, so a decode step stays capturable in a CUDA graph.

With e4m3 experts (quantization="fp8": W8A8 as the dense layers, a scale per expert and output channel) the
tokens' normed rows are quantized per token before moe_gate_up and the padded rows' activations per row before
moe_down (quantize_fp8_values: f16 code values and scales, which the moe_*_fp8_* kernels read); the twin is
backends/moe.py with StackedWeight.quantized experts.

The experts are stacked [num_experts, rows, columns] bf16 (experts_gate_up: each expert's gate rows, then its up
rows, not interleaved; experts_down), so that the FP8 form is a DeviceTensor of e4m3 codes with a scale
[num_experts * rows] (per expert and output channel), as the dense layers' are per row.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.backends.cuda.ops import (FP8_VECTOR, MOE_GEMM_BLOCK_MS, MOE_GEMV_TILE, MOE_MAX_EXPERTS, VECTOR, Ops,
                                        moe_block_m, moe_max_tiles)
from tinyvllm.backends.cuda.tensors import BF16, E4M3, F16, F32, I32, DeviceLayer, DeviceTensor


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
    # e4m3 experts: the f16 code values of the tokens' rows [t, hidden] and of act (same shape as act), each with
    # its f32 scales (one a row)
    x_codes: DeviceTensor | None = None
    act_codes: DeviceTensor | None = None


def check_moe_config(cfg, fp8: bool = False) -> None:
    """ValueError for an expert configuration the kernels cannot run (fp8: with e4m3 experts)."""
    if cfg.num_experts > MOE_MAX_EXPERTS:
        raise ValueError(f"the cuda backend's MoE kernels take at most {MOE_MAX_EXPERTS} experts, not "
                         f"{cfg.num_experts}")
    if cfg.moe_intermediate_size % VECTOR:
        raise ValueError(f"the cuda backend needs moe_intermediate_size divisible by {VECTOR}, not "
                         f"{cfg.moe_intermediate_size}")
    if fp8 and (cfg.hidden_size % FP8_VECTOR or cfg.moe_intermediate_size % FP8_VECTOR):
        raise ValueError(f"the cuda backend's e4m3 experts need hidden_size and moe_intermediate_size divisible by "
                         f"{FP8_VECTOR} (16-byte loads of codes), not {cfg.hidden_size} and "
                         f"{cfg.moe_intermediate_size}: run without quantization, or on the numpy backend")


def max_padded_rows(num_tokens: int, top_k: int, num_experts: int) -> tuple[int, int]:
    """(padded rows, tiles) that moe_align can make of up to num_tokens tokens, whichever tile their batch takes."""
    assignments = num_tokens * top_k
    tiles = {m: moe_max_tiles(assignments, num_experts, m) for m in (MOE_GEMV_TILE, *MOE_GEMM_BLOCK_MS)}
    return max(m * n for m, n in tiles.items()), max(tiles.values())


def allocate_moe_buffers(device, cfg, t: int, fp8: bool = False) -> MoeBuffers | None:
    """The MoE buffers for steps of up to t tokens (None for a dense model); fp8: for e4m3 experts."""
    if not cfg.num_experts:
        return None
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    rows, tiles = max_padded_rows(t, k, e)

    def codes(shape: tuple[int, int]) -> DeviceTensor | None:
        if not fp8:
            return None
        return DeviceTensor(device.empty(F16, shape).ptr, F16, shape, device.empty(F32, shape[:1]))

    return MoeBuffers(
        router_logits=device.empty(F32, (t, e)), topk_weights=device.empty(F32, (t, k)),
        topk_ids=device.empty(I32, (t, k)), sorted_ids=device.empty(I32, (rows,)), expert_ids=device.empty(I32, (tiles,)),
        num_post_padded=device.empty(I32, (1,)), act=device.empty(BF16, (rows, cfg.moe_intermediate_size)),
        rows=device.empty(F32, (t * k, cfg.hidden_size)), x_codes=codes((t, cfg.hidden_size)),
        act_codes=codes((rows, cfg.moe_intermediate_size)))


def fused_moe(ops: Ops, linear, buf: MoeBuffers, layer: DeviceLayer, x: DeviceTensor, h: DeviceTensor, n: int,
              cfg, h_codes: DeviceTensor | None = None) -> None:
    """x[:n] (float32, the residual stream) += the experts' weighted sum for the n normed rows h (bf16 [>= n,
    hidden]); h_codes: e4m3 experts, h as the norm quantized it (f16 code values with their scales, as
    quantize_fp8_values writes them), else None (quantized here).  Twin: backends/moe.py fused_moe after route."""
    e, k, hidden, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    gate_up, down = layer.experts_gate_up, layer.experts_down
    linear.gemm(buf.router_logits, h, layer.router, n)
    ops.moe_topk_softmax(buf.topk_weights.ptr, buf.topk_ids.ptr, buf.router_logits.ptr, n, e, k, cfg.norm_topk_prob)
    index = (buf.sorted_ids.ptr, buf.expert_ids.ptr, buf.num_post_padded.ptr)
    block_m = moe_block_m(n, k, e)
    ops.moe_align(*index, buf.topk_ids.ptr, n * k, e, block_m)
    if gate_up.dtype != E4M3:
        ops.moe_gate_up(buf.act.ptr, h.ptr, gate_up.ptr, *index, n, k, e, hidden, inter)
        ops.moe_down(buf.rows.ptr, buf.act.ptr, down.ptr, *index, buf.topk_weights.ptr, n, k, e, hidden, inter)
    else:
        xq, aq = h_codes if h_codes is not None else buf.x_codes, buf.act_codes
        if xq is None or down.dtype != E4M3 or xq.dtype != F16:
            raise ValueError("e4m3 experts need both products in e4m3 and the MoE buffers' fp8 codes")
        if h_codes is None:
            ops.quantize_fp8_values(xq.ptr, xq.scale.ptr, h.ptr, n, hidden)
        ops.moe_gate_up(buf.act.ptr, xq.ptr, gate_up.ptr, *index, n, k, e, hidden, inter,
                        scales=(gate_up.scale.ptr, xq.scale.ptr))
        # every padded row the batch can have (their count is on the device; rows past it are never read)
        ops.quantize_fp8_values(aq.ptr, aq.scale.ptr, buf.act.ptr, moe_max_tiles(n * k, e, block_m) * block_m, inter)
        ops.moe_down(buf.rows.ptr, aq.ptr, down.ptr, *index, buf.topk_weights.ptr, n, k, e, hidden, inter,
                     scales=(down.scale.ptr, aq.scale.ptr))
    ops.moe_sum(x.ptr, buf.rows.ptr, n, k, hidden)
