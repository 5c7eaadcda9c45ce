"""The fused MoE kernels (cuda/moe.cu) against their numpy twins (backends/moe.py) on fresh random inputs with
NaN-poisoned outputs: routing (ties in the router logits included, broken as torch.topk on the CPU), the grouping
by expert padded to each path's tile (an expert no token chose included), and the expert products through the
residual add, on the GEMV path (a few tokens) and the grouped GEMM's (hundreds), top-k 2 and 8; the same with e4m3
experts (quantization="fp8"). Lines starting with REPORT carry measured errors (pytest -s)."""

import numpy as np
import pytest

from tinyvllm.backends.cuda.moe import max_padded_rows
from tinyvllm.backends.cuda.ops import MOE_GEMM_BLOCK_MS, MOE_GEMV_TILE, moe_block_m, moe_max_tiles, moe_uses_gemv
from tinyvllm.backends.moe import StackedWeight, align_block_size, fused_moe, route
from tinyvllm.backends.numpy_backend import silu_and_mul
from tinyvllm.model.dtypes import e4m3_to_f32
from tinyvllm.model.fp8 import Fp8Rows, quantize_activations, quantize_rows

from test_kernels import BF16_TOL, Gpu, bf16_round, rel_err

pytestmark = pytest.mark.gpu


def router_logits(rng, tokens, experts, ties=False, unchosen=None):
    """float32 logits [tokens, experts]; ties: a few integer values, so that most rows tie; unchosen: an expert whose
    logit is far below every other's, so no token picks it."""
    if ties:
        logits = rng.integers(-2, 3, (tokens, experts)).astype(np.float32)
    else:
        logits = rng.standard_normal((tokens, experts), dtype=np.float32) * 2
    if unchosen is not None:
        logits[:, unchosen] = -40.0
    return logits


def run_topk(gpu, ops, logits, k, renormalize):
    tokens, experts = logits.shape
    weights, ids = gpu.poisoned((tokens, k), np.float32), gpu.poisoned((tokens, k), np.int32)
    ops.moe_topk_softmax(weights, ids, gpu.put(logits), tokens, experts, k, renormalize)
    return weights, ids


@pytest.mark.parametrize("tokens,experts,k,renormalize,ties", [
    (1, 128, 8, True, False), (300, 128, 8, True, True), (7, 8, 2, True, True), (257, 8, 2, True, False),
    (64, 64, 8, False, True), (100, 64, 8, False, False), (50, 200, 3, True, True), (40, 1024, 2, False, True),
    (33, 16, 16, True, True)])
def test_moe_topk_softmax(cuda, ops, tokens, experts, k, renormalize, ties):
    """Ids exactly as route's (torch.topk's tie order: introselect where k * 64 > experts, a heap below), weights
    within float32 rounding."""
    gpu, rng = Gpu(cuda), np.random.default_rng(tokens * 7 + experts + k)
    logits = router_logits(rng, tokens, experts, ties)
    weights, ids = run_topk(gpu, ops, logits, k, renormalize)
    ref_weights, ref_ids = route(logits, k, renormalize)
    got_ids = gpu.get(ids, (tokens, k), np.int32)
    np.testing.assert_array_equal(got_ids, ref_ids)
    np.testing.assert_allclose(gpu.get(weights, (tokens, k), np.float32), ref_weights, rtol=2e-6, atol=1e-7)


def run_align(gpu, ops, ids, experts, block_m):
    tokens, k = ids.shape
    rows, tiles = max_padded_rows(tokens, k, experts)
    sorted_ids, expert_ids = gpu.poisoned((rows,), np.int32), gpu.poisoned((tiles,), np.int32)
    num_post_padded = gpu.poisoned((1,), np.int32)
    ops.moe_align(sorted_ids, expert_ids, num_post_padded, gpu.put(ids.astype(np.int32)), ids.size, experts, block_m)
    return sorted_ids, expert_ids, num_post_padded


@pytest.mark.parametrize("tokens,experts,k", [(1, 128, 8), (5, 8, 2), (8, 64, 8), (300, 128, 8), (1000, 8, 2),
                                              (257, 16, 8)])
@pytest.mark.parametrize("block_m", [MOE_GEMV_TILE, *MOE_GEMM_BLOCK_MS])
def test_moe_align(cuda, ops, tokens, experts, k, block_m):
    """Each expert's assignments in token order, its run padded to block_m with the sentinel, its tiles named; an
    expert no token chose has no run."""
    gpu, rng = Gpu(cuda), np.random.default_rng(tokens + experts + block_m)
    _, ids = route(router_logits(rng, tokens, experts, unchosen=experts // 2), k, True)
    assert experts // 2 not in ids
    sorted_ids, expert_ids, num_post_padded = run_align(gpu, ops, ids, experts, block_m)
    ref_sorted, ref_experts, ref_total = align_block_size(ids, experts, block_m)
    total = int(gpu.get(num_post_padded, (1,), np.int32)[0])
    assert total == ref_total
    np.testing.assert_array_equal(gpu.get(sorted_ids, (total,), np.int32), ref_sorted)
    np.testing.assert_array_equal(gpu.get(expert_ids, (total // block_m,), np.int32), ref_experts)


def expert_weights(rng, experts, hidden, inter):
    """bf16-rounded experts_gate_up [E, 2 * inter, hidden] and experts_down [E, hidden, inter], scaled as dummy.py's."""
    gate_up = bf16_round(rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32) / np.sqrt(hidden))
    down = bf16_round(rng.standard_normal((experts, hidden, inter), dtype=np.float32) / np.sqrt(inter))
    return gate_up, down


# (tokens, experts, top_k, hidden, inter): the GEMV path at 1-8 tokens and at 16 and 128 (an expert's run of more
# than one tile of 8), the grouped GEMM's at 160+ (tiles of 32 at 160 and 256 tokens of 128 experts, else 64);
# Qwen3-30B-A3B's 128 experts and widths (with fewer experts: their float32 reference copies stay small), and widths
# that are not whole tiles (hidden 264: 33 chunks of 8, 8.25 GEMM k-steps; inter 200).
SHAPES = [(1, 128, 8, 512, 384), (4, 16, 8, 2048, 768), (8, 16, 8, 264, 200), (3, 8, 2, 512, 256),
          (1, 8, 2, 264, 200), (16, 16, 8, 264, 200), (128, 128, 8, 512, 384), (160, 128, 8, 264, 200),
          (256, 128, 8, 512, 384), (200, 16, 8, 264, 200), (256, 16, 8, 2048, 768), (300, 128, 8, 512, 384),
          (333, 8, 2, 512, 256), (260, 8, 2, 1024, 1792)]
GEMV_MULTI_TILE = (16, 128)  # token counts of SHAPES on the GEMV path with more than 8 tokens


def routed_inputs(gpu, ops, rng, tokens, experts, k, hidden, inter):
    """A MoE layer's inputs and their routing: the normed rows h (bf16 values), the residual stream x, the stacked
    experts, cuda's top-k (weights, ids on the GPU) and the twin's (ref_weights, ref_ids), the tile and the grouping
    moe_align made of ref_ids (its device buffers)."""
    h = bf16_round(rng.standard_normal((tokens, hidden), dtype=np.float32))
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    gate_up, down = expert_weights(rng, experts, hidden, inter)
    logits = router_logits(rng, tokens, experts, unchosen=1)
    weights, ids = run_topk(gpu, ops, logits, k, True)
    ref_weights, ref_ids = route(logits, k, True)
    block_m = moe_block_m(tokens, k, experts)
    return h, x, gate_up, down, weights, ids, ref_weights, ref_ids, block_m, run_align(gpu, ops, ref_ids, experts,
                                                                                        block_m)


def test_shapes_take_every_tile():
    assert {moe_block_m(t, k, e) for t, e, k, _, _ in SHAPES} == {MOE_GEMV_TILE, *MOE_GEMM_BLOCK_MS}


@pytest.mark.parametrize("tokens,experts,k,hidden,inter", SHAPES)
def test_moe_experts(cuda, ops, tokens, experts, k, hidden, inter):
    """topk_softmax -> align -> gate/up (SwiGLU) -> down (weighted) -> sum into the residual stream, against
    fused_moe on the same bf16 inputs: each padded row's activation, each assignment's weighted row (all of them
    written), and the residual stream after the add."""
    assert moe_uses_gemv(tokens, k, experts) == (tokens <= 8 or tokens in GEMV_MULTI_TILE)
    gpu = Gpu(cuda)
    h, x, gate_up, down, weights, ids, ref_weights, ref_ids, block_m, index = routed_inputs(
        gpu, ops, np.random.default_rng(tokens + hidden + experts), tokens, experts, k, hidden, inter)
    rows_max, _ = max_padded_rows(tokens, k, experts)
    act, rows = gpu.poisoned((rows_max, inter), np.uint16), gpu.poisoned((tokens * k, hidden), np.float32)
    x_gpu = gpu.put(x)
    ops.moe_gate_up(act, gpu.bf16(h), gpu.bf16(gate_up), *index, tokens, k, experts, hidden, inter)
    ops.moe_down(rows, act, gpu.bf16(down), *index, weights, tokens, k, experts, hidden, inter)
    ops.moe_sum(x_gpu, rows, tokens, k, hidden)

    sorted_ids, expert_ids, total = align_block_size(ref_ids, experts, block_m)
    real = sorted_ids < tokens * k
    got_act = gpu.get_bf16(act, (rows_max, inter))[:total][real]
    tiles = np.repeat(expert_ids, block_m)[real]
    ref_act = np.stack([silu_and_mul(h[a // k] @ gate_up[e].T) for a, e in zip(sorted_ids[real], tiles)])
    assert rel_err(got_act, ref_act) < BF16_TOL
    got_rows = gpu.get(rows, (tokens * k, hidden), np.float32)
    assert not np.isnan(got_rows).any()  # every assignment's row written
    ref_rows = ref_weights.reshape(-1)[:, None] * np.stack(
        [bf16_round(silu_and_mul(h[a // k] @ gate_up[e].T)) @ down[e].T for a, e in enumerate(ref_ids.reshape(-1))])
    assert rel_err(got_rows, ref_rows) < BF16_TOL
    ref = fused_moe(h, StackedWeight.from_rows(gate_up), StackedWeight.from_rows(down), ref_weights, ref_ids,
                    silu_and_mul)
    got = gpu.get(x_gpu, (tokens, hidden), np.float32)
    assert rel_err(got - x, ref) < BF16_TOL
    np.testing.assert_array_equal(gpu.get(ids, (tokens, k), np.int32), ref_ids)


# e4m3 experts: widths multiples of 16 (a 16-byte load of codes), hidden 272 and inter 208 not whole GEMM k-steps
FP8_SHAPES = [(1, 128, 8, 512, 384), (4, 16, 8, 2048, 768), (3, 8, 2, 272, 208), (16, 16, 8, 272, 208),
              (160, 128, 8, 272, 208), (256, 16, 8, 2048, 768), (300, 128, 8, 512, 384), (333, 8, 2, 512, 256)]


def test_fp8_shapes_take_every_tile():
    assert {moe_block_m(t, k, e) for t, e, k, _, _ in FP8_SHAPES} == {MOE_GEMV_TILE, *MOE_GEMM_BLOCK_MS}


def dequantized(rows: Fp8Rows, shape) -> np.ndarray:
    return (e4m3_to_f32(rows.codes) * rows.scale[:, None]).reshape(shape)


@pytest.mark.parametrize("tokens,experts,k,hidden,inter", FP8_SHAPES)
def test_moe_experts_fp8(cuda, ops, tokens, experts, k, hidden, inter):
    """e4m3 experts (a scale per expert and row, model/fp8.py quantize_rows) on the tokens' rows quantized per token
    and the activations per padded row (quantize_fp8_values, bit-exact): each padded row's activation against
    SwiGLU of the product of the dequantized values, each assignment's weighted row against the same product of
    the activation cuda wrote, the residual stream against fused_moe with StackedWeight.quantized experts (the
    twin, whose activations are float32 where cuda's are bf16)."""
    gpu = Gpu(cuda)
    h, x, gate_up, down, weights, ids, ref_weights, ref_ids, block_m, index = routed_inputs(
        gpu, ops, np.random.default_rng(tokens + hidden + experts + 1), tokens, experts, k, hidden, inter)
    gate_up_q, down_q = quantize_rows(gate_up.reshape(-1, hidden)), quantize_rows(down.reshape(-1, inter))
    rows_max, _ = max_padded_rows(tokens, k, experts)
    act, rows = gpu.poisoned((rows_max, inter), np.uint16), gpu.poisoned((tokens * k, hidden), np.float32)
    x_codes, x_scales = gpu.poisoned((tokens, hidden), np.uint16), gpu.poisoned((tokens,), np.float32)
    act_codes, act_scales = gpu.poisoned((rows_max, inter), np.uint16), gpu.poisoned((rows_max,), np.float32)
    x_gpu = gpu.put(x)
    ops.quantize_fp8_values(x_codes, x_scales, gpu.bf16(h), tokens, hidden)
    ops.moe_gate_up(act, x_codes, gpu.put(gate_up_q.codes), *index, tokens, k, experts, hidden, inter,
                    scales=(gpu.put(gate_up_q.scale), x_scales))
    padded = moe_max_tiles(tokens * k, experts, block_m) * block_m
    ops.quantize_fp8_values(act_codes, act_scales, act, padded, inter)
    ops.moe_down(rows, act_codes, gpu.put(down_q.codes), *index, weights, tokens, k, experts, hidden, inter,
                 scales=(gpu.put(down_q.scale), act_scales))
    ops.moe_sum(x_gpu, rows, tokens, k, hidden)

    sorted_ids, expert_ids, total = align_block_size(ref_ids, experts, block_m)
    real = sorted_ids < tokens * k
    gate_up_w, down_w = dequantized(gate_up_q, gate_up.shape), dequantized(down_q, down.shape)
    xq = quantize_activations(h)  # per token, as quantize_fp8_values
    got_act = gpu.get_bf16(act, (rows_max, inter))[:total]
    tiles = np.repeat(expert_ids, block_m)
    ref_act = np.stack([silu_and_mul(xq[a // k] @ gate_up_w[e].T) for a, e in zip(sorted_ids[real], tiles[real])])
    err_act = rel_err(got_act[real], ref_act)
    assert err_act < BF16_TOL
    assert (got_act[~real] == 0).all()  # a padding row's activation: 0, as in bf16
    got_rows = gpu.get(rows, (tokens * k, hidden), np.float32)
    assert not np.isnan(got_rows).any()  # every assignment's row written
    act_q = quantize_activations(got_act[real])  # the padded rows' activations as cuda quantized them
    ref_rows = np.empty_like(got_rows)
    ref_rows[sorted_ids[real]] = np.stack([a @ down_w[e].T for a, e in zip(act_q, tiles[real])])
    ref_rows *= ref_weights.reshape(-1)[:, None]
    err_rows = rel_err(got_rows, ref_rows)
    assert err_rows < 1e-4
    ref = fused_moe(h, StackedWeight.quantized(gate_up), StackedWeight.quantized(down), ref_weights, ref_ids,
                    silu_and_mul)
    err = rel_err(gpu.get(x_gpu, (tokens, hidden), np.float32) - x, ref)
    print(f"REPORT moe fp8 experts {tokens} tokens, {experts} experts, top {k}, {hidden} x {inter}: act {err_act:.1e}, "
          f"rows {err_rows:.1e}, the MoE against its twin {err:.1e}")
    assert err < 3e-2


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 16, 8, 128), (257, 16, 16, 128), (5, 9, 3, 64)])
def test_qk_norm_projection(cuda, ops, tokens, heads, kv_heads, head_dim):
    """OLMoE's q/k norms: each token's whole Q and whole K normalized with their gains; V untouched."""
    from tinyvllm.backends.numpy_backend import qk_norm

    gpu, rng = Gpu(cuda), np.random.default_rng(tokens + heads)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    width = q_width + 2 * kv_width
    qkv = bf16_round(rng.standard_normal((tokens, width), dtype=np.float32) * rng.uniform(0.1, 10, (tokens, 1)))
    q_w, k_w = (bf16_round(1 + 0.3 * rng.standard_normal(n, dtype=np.float32)) for n in (q_width, kv_width))
    buf = gpu.bf16(qkv)
    ops.qk_norm_projection(buf, gpu.bf16(q_w), gpu.bf16(k_w), tokens, q_width, kv_width, width, 1e-6)
    got = gpu.get_bf16(buf, (tokens, width))
    q, k = qk_norm(qkv[:, :q_width].reshape(tokens, heads, head_dim),
                   qkv[:, q_width:q_width + kv_width].reshape(tokens, kv_heads, head_dim), q_w, k_w, 1e-6, False)
    assert rel_err(got[:, :q_width], q.reshape(tokens, -1)) < BF16_TOL
    assert rel_err(got[:, q_width:q_width + kv_width], k.reshape(tokens, -1)) < BF16_TOL
    np.testing.assert_array_equal(got[:, q_width + kv_width:], qkv[:, q_width + kv_width:])
