"""cuda/moe.cu's grouped GEMM emulated on the host, block by block and warp by warp: moe_align's tiles of block_m
(align_block_size, its twin), the shared B tile's rows as gemm_weight_row orders them (for gate/up each column
group of WN rows holds WN / 2 units' gate rows, then the same units' up rows; rows past the weight repeat its last),
the A rows of a tile (x rows of its tokens, zeros for a padding row; act rows for down), k in steps of
MOE_GEMM_BLOCK_K with chunks past k zero, and the epilogue's map from a warp's accumulators to output columns:
against backends/moe.py fused_moe. Every (block_m, warps) layout the kernel's static_assert admits is emulated, not
only the compiled MOE_GEMM_WARPS, so a retuning of the warps is checked here first. The index math, not the
hardware (the products are exact float64 sums; the mma fragments are gemv's and attention's): tests/gpu runs the
kernels."""

import numpy as np
import pytest

from tinyvllm.backends.cuda.ops import (MOE_GEMM_BLOCK_K, MOE_GEMM_BLOCK_MS, MOE_GEMM_TILE_N, MOE_GEMM_WARPS,
                                        moe_uses_gemv)
from tinyvllm.backends.moe import StackedWeight, align_block_size, fused_moe, route
from tinyvllm.backends.numpy_backend import silu_and_mul
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16


def bf16(x):
    return bf16_to_f32(f32_to_bf16(np.asarray(x, np.float32)))


def weight_row(gate_up: bool, wn: int, j: int, col0: int, n: int) -> int:
    """gemm_weight_row: the weight row behind shared B row j of a block whose first unit / output column is col0."""
    if not gate_up:
        return min(col0 + j, n - 1)
    within = j % wn
    unit = min(col0 + j // wn * (wn // 2) + within % (wn // 2), n - 1)
    return unit if within < wn // 2 else n + unit


def stepped_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A [BM, k] . B [128, k]^T summed k-step by k-step as the pipeline's stages hold them (the last step's chunks
    past k read as zeros)."""
    k = a.shape[1]
    steps = -(-k // MOE_GEMM_BLOCK_K)
    padded = steps * MOE_GEMM_BLOCK_K
    a = np.pad(a, ((0, 0), (0, padded - k))).astype(np.float64)
    b = np.pad(b, ((0, 0), (0, padded - k))).astype(np.float64)
    return sum(a[:, s * MOE_GEMM_BLOCK_K:(s + 1) * MOE_GEMM_BLOCK_K] @ b[:, s * MOE_GEMM_BLOCK_K:(s + 1) *
                                                                          MOE_GEMM_BLOCK_K].T for s in range(steps))


def warp_outputs(gate_up: bool, bm: int, warps: int, c: np.ndarray, col0: int, n: int):
    """The epilogue of every warp of a block: (tile row, output column, value) for each element a thread stores,
    from the block's product c [BM, 128] read where each warp's accumulators hold it (acc[nb] element e: row
    row0 + lane / 4 (+ 8 for e >= 2), column nb * 8 + 2 (lane % 4) + e % 2 of the warp's column group; gate/up:
    nb < WN / 16 the gate, nb + WN / 16 the same units' up)."""
    row_groups = bm // 16
    wn = MOE_GEMM_TILE_N // (warps // row_groups)
    for warp in range(warps):
        row0, group = warp % row_groups * 16, warp // row_groups
        for lane in range(32):
            for h in range(2):
                r = row0 + lane // 4 + 8 * h
                for nb in range(wn // 16 if gate_up else wn // 8):
                    col = col0 + group * (wn // 2 if gate_up else wn) + nb * 8 + 2 * (lane % 4)
                    if col >= n:
                        continue
                    for e in range(2):
                        acc = c[r, group * wn + nb * 8 + 2 * (lane % 4) + e]
                        if gate_up:
                            up = c[r, group * wn + (nb + wn // 16) * 8 + 2 * (lane % 4) + e]
                            yield r, col + e, (acc, up)
                        else:
                            yield r, col + e, acc


def emulate(h, gate_up, down, weights, ids, bm: int, warps: int):
    """The grouped GEMM launches on tiles of bm: x [T, hidden] bf16 values, gate_up [E, 2 * inter, hidden], down
    [E, hidden, inter] -> (moe_sum's [T, hidden] float32, act [padded rows, inter])."""
    (tokens, k), inter, hidden = ids.shape, down.shape[2], down.shape[1]
    sorted_ids, expert_ids, total = align_block_size(ids, gate_up.shape[0], bm)
    assignments = ids.size
    wn = MOE_GEMM_TILE_N // (warps // (bm // 16))
    act = np.full((total, inter), np.nan, np.float32)
    out = np.full((assignments, hidden), np.nan, np.float32)
    for tile in range(total // bm):
        e, p0 = expert_ids[tile], tile * bm
        a_of = sorted_ids[p0:p0 + bm]
        x_rows = np.where((a_of < assignments)[:, None], h[np.minimum(a_of, assignments - 1) // k], 0)
        for col0 in range(0, inter, MOE_GEMM_TILE_N // 2):
            b = gate_up[e][[weight_row(True, wn, j, col0, inter) for j in range(MOE_GEMM_TILE_N)]]
            r, col, values = zip(*warp_outputs(True, bm, warps, stepped_product(x_rows, b), col0, inter))
            gate, up = bf16(np.array(values)).T
            act[p0 + np.array(r), np.array(col)] = bf16(gate / (1 + np.exp(-gate)) * up)
    for tile in range(total // bm):
        e, p0 = expert_ids[tile], tile * bm
        for col0 in range(0, hidden, MOE_GEMM_TILE_N):
            b = down[e][[weight_row(False, wn, j, col0, hidden) for j in range(MOE_GEMM_TILE_N)]]
            for r, col, value in warp_outputs(False, bm, warps, stepped_product(act[p0:p0 + bm], b), col0, hidden):
                a = sorted_ids[p0 + r]
                if a < assignments:
                    out[a, col] = weights.reshape(-1)[a] * value
    rows = out.reshape(tokens, k, hidden)
    return rows.sum(axis=1), act


def layouts():
    """Every (block_m, warps) the kernel's static_assert admits (warps a multiple of the 16-row groups, column
    groups of at least 32 B rows), the compiled ones first."""
    found = [(bm, w) for bm in MOE_GEMM_BLOCK_MS for w in (2, 4, 8, 16)
             if w % (bm // 16) == 0 and MOE_GEMM_TILE_N // (w // (bm // 16)) % 32 == 0]
    return sorted(found, key=lambda layout: MOE_GEMM_WARPS[layout[0]] != layout[1])


def test_the_compiled_layouts_are_emulated():
    assert all((bm, w) in layouts() for bm, w in MOE_GEMM_WARPS.items())


# (tokens, experts, top_k, hidden, inter): batches past the GEMV path, each run through every layout, widths that
# are not whole blocks (inter 72: a block of 64 units and one of 8; hidden 136: 128 columns and 8) nor whole k-steps
# (k 136 and 72: 2.1 and 1.1 steps of 64)
@pytest.mark.parametrize("layout", layouts())
@pytest.mark.parametrize("tokens,experts,k,hidden,inter", [(40, 4, 2, 136, 72), (40, 8, 2, 64, 40)])
def test_grouped_gemm_emulated_is_fused_moe(layout, tokens, experts, k, hidden, inter):
    bm, warps = layout
    assert not moe_uses_gemv(tokens, k, experts)
    rng = np.random.default_rng(tokens * experts + hidden + bm + warps)
    h = bf16(rng.standard_normal((tokens, hidden)))
    gate_up = bf16(rng.standard_normal((experts, 2 * inter, hidden)) / np.sqrt(hidden))
    down = bf16(rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter))
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    logits[:, 0] += 2  # the first expert chosen by most tokens: a run of more than one tile of 32
    weights, ids = route(logits, k, True)
    got, act = emulate(h, gate_up, down, weights, ids, bm, warps)
    sorted_ids, _, total = align_block_size(ids, experts, bm)
    assert not np.isnan(act[:total]).any()  # every padded row written (padding rows: SwiGLU of zeros)
    assert (act[:total][sorted_ids >= ids.size] == 0).all()
    ref = fused_moe(h, StackedWeight.from_rows(gate_up), StackedWeight.from_rows(down), weights, ids,
                    lambda v: bf16(silu_and_mul(bf16(v))))
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)
