"""cuda/moe.cu's GEMV path emulated on the host, lane by lane: moe_align's tiles of 8 (align_block_size, its twin),
moe_gemv_gate_up and moe_gemv_down with each lane's 16-byte loads, the m16n8k16 mma's fragment layout (PTX's:
A row g / g + 8 at k 2t.. and 2t + 8.., B column g, C (g, 2t..) and (g + 8, 2t..)), the clamped rows and the
sentinel rows, then moe_sum's slot order: against backends/moe.py fused_moe on decode shapes and on GEMV batches
whose experts have more than one tile of assignments. The index math, not the hardware: tests/gpu runs the kernels."""

import numpy as np
import pytest

from tinyvllm.backends.cuda.ops import MOE_GEMV_TILE, MOE_GEMV_UNROLL, MOE_GEMV_WARPS, moe_uses_gemv
from tinyvllm.backends.moe import StackedWeight, align_block_size, fused_moe, route
from tinyvllm.backends.numpy_backend import silu_and_mul
from tinyvllm.model.dtypes import bf16_to_f32, f32_to_bf16


def bf16(x):
    return bf16_to_f32(f32_to_bf16(np.asarray(x, np.float32)))


def mma(c, a_regs, b_regs):
    """c [32, 4] += A . B with the lanes' registers: a_regs [32, 4, 2] (a0..a3 of mma.cuh, two bf16 each), b_regs
    [32, 2, 2]; A 16x16 and B 16x8 assembled as PTX lays them out."""
    a, b = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, k0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[row, k0:k0 + 2] = a_regs[lane, reg]
        for reg, k0 in enumerate((2 * t, 2 * t + 8)):
            b[k0:k0 + 2, g] = b_regs[lane, reg]
    d = a.astype(np.float64) @ b
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += [d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]]


def gemv_rows(lo_rows, hi_rows, x_rows, k):
    """gemv_rows for one warp: lo_rows/hi_rows [32, k] each lane's weight rows, x_rows [32, k] (zeros: a padding
    row) -> c [32, 4]."""
    c, chunks = np.zeros((32, 4)), k // 8
    for base in range(0, chunks, MOE_GEMV_UNROLL * 4):
        loads = []
        for u in range(MOE_GEMV_UNROLL):
            regs = np.zeros((3, 32, 8), np.float32)  # wl, wh, xv: 8 bf16 (a uint4) per lane
            for lane in range(32):
                chunk = base + u * 4 + (lane & 3)
                if chunk < chunks:
                    part = slice(chunk * 8, chunk * 8 + 8)
                    regs[:, lane] = lo_rows[lane, part], hi_rows[lane, part], x_rows[lane, part]
            loads.append(regs.reshape(3, 32, 4, 2))  # .x .y .z .w
        for wl, wh, xv in loads:  # mma(c, wl.x, wh.x, wl.y, wh.y, xv.x, xv.y), then the .z/.w halves
            for half in (0, 2):
                a_regs = np.stack([wl[:, half], wh[:, half], wl[:, half + 1], wh[:, half + 1]], axis=1)
                mma(c, a_regs, xv[:, half:half + 2])
    return c


def warp_lanes(u0, size):
    g = np.arange(32) >> 2
    return np.minimum(u0 + g, size - 1), np.minimum(u0 + g + 8, size - 1)


def emulate(h, gate_up, down, weights, ids):
    """The GEMV launches: x [T, hidden] bf16 values, gate_up [E, 2 * inter, hidden], down [E, hidden, inter] ->
    moe_sum's [T, hidden] float32."""
    (tokens, k), experts, inter, hidden = ids.shape, gate_up.shape[0], down.shape[2], down.shape[1]
    sorted_ids, expert_ids, total = align_block_size(ids, experts, MOE_GEMV_TILE)
    assignments = ids.size
    act = np.full((total, inter), np.nan, np.float32)
    out = np.full((assignments, hidden), np.nan, np.float32)
    lane_g, lane_t = np.arange(32) >> 2, np.arange(32) & 3
    for tile in range(total // 8):
        e = expert_ids[tile]
        a_of = sorted_ids[tile * 8 + lane_g]  # each lane's column (assignment) g
        x_rows = np.where((a_of < assignments)[:, None], h[np.minimum(a_of, assignments - 1) // k], 0)
        for u0 in range(0, inter, 8):  # weight tiles: 8 units' gate rows (A rows g), their up rows (g + 8)
            lo = np.minimum(u0 + lane_g, inter - 1)
            c = gemv_rows(gate_up[e][lo], gate_up[e][inter + lo], x_rows, hidden)
            for j in range(2):  # c elements j: the unit's gate at column 2t + j, j + 2: its up
                unit, col = u0 + lane_g, 2 * lane_t + j
                ok = unit < inter
                gate, up = bf16(c[ok, j]), bf16(c[ok, j + 2])
                act[tile * 8 + col[ok], unit[ok]] = bf16(gate / (1 + np.exp(-gate)) * up)
        for n0 in range(0, hidden, 16):
            lo, hi = warp_lanes(n0, hidden)
            c = gemv_rows(down[e][lo], down[e][hi], act[tile * 8 + lane_g], inter)
            for j in range(4):
                row, a = n0 + lane_g + 8 * (j >> 1), sorted_ids[tile * 8 + 2 * lane_t + (j & 1)]
                ok = (row < hidden) & (a < assignments)
                out[a[ok], row[ok]] = weights.reshape(-1)[a[ok]] * c[ok, j]
    rows = out.reshape(tokens, k, hidden)
    total_rows = rows[:, 0].copy()
    for slot in range(1, k):
        total_rows += rows[:, slot]
    return total_rows, act


# (tokens, experts, top_k, hidden, inter): decode batches (3 rows of the GPU test's families, a padded 4th), a
# GEMV batch of 16 tokens over 16 experts (runs of more than 8: several tiles per expert), widths not whole warps
@pytest.mark.parametrize("tokens,experts,k,hidden,inter", [(3, 8, 2, 64, 48), (4, 32, 8, 64, 32), (1, 16, 8, 40, 24),
                                                           (16, 16, 8, 48, 40), (11, 8, 2, 32, 56)])
def test_gemv_path_emulated_is_fused_moe(tokens, experts, k, hidden, inter):
    assert moe_uses_gemv(tokens, k, experts) and MOE_GEMV_WARPS >= 1
    rng = np.random.default_rng(tokens * experts + hidden)
    h = bf16(rng.standard_normal((tokens, hidden)))
    gate_up = bf16(rng.standard_normal((experts, 2 * inter, hidden)) / np.sqrt(hidden))
    down = bf16(rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter))
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    if tokens >= 11:
        logits[:, :3] += 3  # the first experts chosen by most tokens: runs of more than one tile
    weights, ids = route(logits, k, True)
    got, act = emulate(h, gate_up, down, weights, ids)
    sorted_ids, _, total = align_block_size(ids, experts, MOE_GEMV_TILE)
    if tokens >= 11:
        assert np.bincount(ids.reshape(-1), minlength=experts).max() > MOE_GEMV_TILE
    assert not np.isnan(act[:total]).any()  # every padded row written (padding rows: SwiGLU of zeros)
    assert (act[:total][sorted_ids >= ids.size] == 0).all()
    ref = fused_moe(h, StackedWeight.from_rows(gate_up), StackedWeight.from_rows(down), weights, ids,
                    lambda v: bf16(silu_and_mul(bf16(v))))
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)
