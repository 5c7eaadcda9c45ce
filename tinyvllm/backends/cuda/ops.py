"""One launcher per CUDA kernel of cuda/*.cu: its grid, block, argument types and the preconditions it assumes.

A kernel's launch facts live here and nowhere else: CudaBackend and the GPU tests call these launchers, and the tile
constants below reach the compiler as -D defines (DEFINES), so Python is their single source. A launcher raises
ValueError on a shape its kernel cannot run (a kernel would read out of bounds instead). No pycuda here: launchers
call whatever `kernels` maps a kernel name to (Device.kernels gives the compiled ones), so their geometry and checks
can be tested on any machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

HEAD_DIMS = (64, 96, 128, 256)  # head dims the attention kernels are instantiated for
VECTOR = 8  # bf16 per 16-byte load: the kernels' widths (hidden, intermediate, KV) are multiples of it

# Tile constants, passed to the compiler as -D defines.
PREFILL_BLOCK_M = 64  # attention_prefill: (query, head) rows per block, 16 per warp
DECODE_WARPS = 2  # attention_decode: warps per block (each serves one KV head of one sequence), head_dim <= 128
# attention_decode at head_dim > 128: a warp's K/V stages and Q (41 KB at 256) leave room for one under the 48 KB of
# static shared memory a block may have
DECODE_WIDE_WARPS = 1
# attention_decode: fewest 16-key tiles in each part of a context cut into parts (a shorter context gets fewer
# parts): at batch 1 and 256-512 keys (W3), parts of 1-2 tiles cost more in their merge than they gain (1.07-1.08 ms
# per token with 1, 1.05-1.06 with 2-4; bench/results/PERFORMANCE-history.md)
DECODE_MIN_SPLIT_TILES = 4
# attention_combine_quantize: threads per block (a sequence per block) and 8-dim groups per thread, so rows of up to
# 256 * 8 * 4 = 8192 (num_heads * head_dim) values
COMBINE_ROW_THREADS = 256
COMBINE_ROW_GROUPS = 4
# batch-invariant attention: keys per chunk (softmaxed afresh, folded in order: cuda/mma.cuh; a multiple of every
# head dim's block_n), and the slots of a (sequence, head) for a small batch's chunk states (contexts of up to
# INVARIANT_CHUNK * INVARIANT_PARTS keys run in parts; a longer one in one)
INVARIANT_CHUNK = 64
INVARIANT_PARTS = 64
NORM_CHUNKS = 2  # rms_norm: most 8-entry chunks of a row per thread (held in registers)
MAX_THREADS = 1024  # threads per block the GPU allows
SAMPLING_THREADS = 1024  # sample, logprobs: threads per block
# sample_split, logprobs_split: blocks a row (a thread-block cluster, 8 at most portably), for batches of up to
# SAMPLING_SPLIT_ROWS rows, whose clusters fit the GPU at once (an H100's GPCs hold two each)
SAMPLING_SPLIT = 8
SAMPLING_SPLIT_ROWS = 16
MAX_TOP_LOGPROBS = 64  # logprobs: most top logprobs per row (its shared-memory lists)
GEMV_WARPS = 8  # gemv: warps per block
GEMV_UNROLL = 8  # gemv: 16-byte loads per row (two rows) and of x that a lane has in flight
CHAIN_WARPS = 4  # gemv_chain_*: most warps per block, each the mma chain of one 16-row tile
# gemv_chain_*: k per stage of a warp's ring (256 bytes of each of its 16 weight rows and of x's 8) and the ring's
# stages; the weights of all but one are copied before the wait for the previous kernel, x's rows after it
# (docs/PERFORMANCE.md, batch-invariant mode)
CHAIN_K = 128
CHAIN_STAGES = 4
CHAIN8_STAGES = 8  # gemv_chain8_*'s ring: more bytes in flight a warp
MOE_MAX_EXPERTS = 1024  # moe_topk_softmax, moe_align: most experts (their shared-memory rows)
MOE_TOPK_THREADS = 128  # moe_topk_softmax: threads per block (one block per token, a thread per expert)
MOE_ALIGN_THREADS = 256  # moe_align: threads per block (one block per expert)
MOE_GEMV_WARPS = 8  # moe_gemv_*: warps per block (split of them share a weight tile of 16 rows)
MOE_GEMV_UNROLL = 8  # moe_gemv_*: 16-byte loads per weight row (two rows) and of x that a lane has in flight
MOE_GEMM_BLOCK_MS = (32, 64)  # moe_gemm_*_<m>: padded rows (assignments of one expert) per tile (moe_block_m)
MOE_GEMM_BLOCK_K = 64  # moe_gemm_*: k per pipeline stage (128 contiguous bytes of each weight row)
MOE_GEMM_STAGES = 3  # moe_gemm_*: cp.async pipeline depth (two k-steps in flight while one is multiplied)
MOE_GEMM_WARPS = {32: 4, 64: 8}  # moe_gemm_*_<m>: warps per block (64: two per 16 rows, each 64 of the 128 columns)
DEFINES: dict[str, dict[str, int]] = {
    "attention_prefill": {"BLOCK_M": PREFILL_BLOCK_M, "INV_CHUNK": INVARIANT_CHUNK},
    "attention_decode": {"NWARPS": DECODE_WARPS, "NWARPS_WIDE": DECODE_WIDE_WARPS,
                         "MIN_SPLIT_TILES": DECODE_MIN_SPLIT_TILES, "COMBINE_ROW_THREADS": COMBINE_ROW_THREADS,
                         "COMBINE_ROW_GROUPS": COMBINE_ROW_GROUPS, "INV_CHUNK": INVARIANT_CHUNK,
                         "INV_PARTS": INVARIANT_PARTS},
    "norm": {"NORM_CHUNKS": NORM_CHUNKS},
    "sampling": {"NTHREADS": SAMPLING_THREADS, "MAX_TOP_LOGPROBS": MAX_TOP_LOGPROBS, "ROW_SPLIT": SAMPLING_SPLIT},
    "gemv": {"GEMV_WARPS": GEMV_WARPS, "GEMV_UNROLL": GEMV_UNROLL},
    "fp8": {"GEMV_WARPS": GEMV_WARPS, "GEMV_UNROLL": GEMV_UNROLL},
    "gemv_chain": {"GEMV_WARPS": GEMV_WARPS, "GEMV_UNROLL": GEMV_UNROLL, "CHAIN_WARPS": CHAIN_WARPS, "CHAIN_K": CHAIN_K,
                   "CHAIN_STAGES": CHAIN_STAGES, "CHAIN8_STAGES": CHAIN8_STAGES},
    "moe": {"MOE_MAX_EXPERTS": MOE_MAX_EXPERTS, "MOE_TOPK_THREADS": MOE_TOPK_THREADS,
            "MOE_ALIGN_THREADS": MOE_ALIGN_THREADS, "MOE_GEMV_WARPS": MOE_GEMV_WARPS,
            "MOE_GEMV_UNROLL": MOE_GEMV_UNROLL, "MOE_GEMM_BLOCK_K": MOE_GEMM_BLOCK_K,
            "MOE_GEMM_STAGES": MOE_GEMM_STAGES, **{f"MOE_GEMM_WARPS_{m}": w for m, w in MOE_GEMM_WARPS.items()}},
}

GEMV_MAX_ROWS = 8  # the width of gemv's mma tile (m16n8k16: x^T is its 16x8 B operand); any m <= 8 costs the same
GEMV_TILE_ROWS = 16  # output rows (weight rows) of one gemv mma tile
# gemv_chain and its gated forms: a warp's ring of stages (16 weight rows, then x's 8) in shared memory, rows padded
# by 16 bytes
CHAIN_TILES = (16, 8)  # gemv_chain_*'s weight rows a warp: 16 (w the mma's A operand), or 8 (x the A operand)


def chain_warp_shared_bytes(tile_rows: int) -> int:
    """gemv_chain_*: a warp's ring, CHAIN_STAGES stages (CHAIN8_STAGES in 8-row tiles) of its tile's rows and x's 8,
    each CHAIN_K + VECTOR bf16."""
    stages = CHAIN_STAGES if tile_rows == GEMV_TILE_ROWS else CHAIN8_STAGES
    return stages * (tile_rows + GEMV_MAX_ROWS) * (CHAIN_K + VECTOR) * 2


CHAIN_WARP_SHARED_BYTES = chain_warp_shared_bytes(GEMV_TILE_ROWS)
CHAIN_SHARED_BYTES = CHAIN_WARPS * CHAIN_WARP_SHARED_BYTES
MMA_K = 16  # the mma's k: gemv_chain_*'s k is a multiple of it
GEMV_K_PER_ITERATION = GEMV_UNROLL * 4 * VECTOR  # k one gemv warp loads per iteration: 4 lanes per row
FP8_GEMV_K_PER_ITERATION = GEMV_UNROLL * 4 * 16  # the same for e4m3 weights (16 codes per 16-byte load)
MOE_GEMV_K_PER_ITERATION = MOE_GEMV_UNROLL * 4 * VECTOR  # the same for moe_gemv_*
MAX_SPLITS = 32  # attention_decode: most parts of one context
SMALL_BATCH_SPLITS = 8  # attention_decode: fewest parts a context may be cut into when a batch is cut at all
ELEMENTWISE_THREADS = 256  # embedding, resolve_tokens, the activations, soft_cap, logits processors: per block
CLEAR_THREADS = 1024  # clear_token_slots: vocabulary entries per block
FP8_VECTOR = 16  # e4m3 codes per 16-byte load: gemv_fp8's k and cuBLASLt's FP8 leading dimensions are multiples
QUANTIZE_THREADS = 256  # quantize_fp8: threads per block (a row per block)
QUANTIZE_GROUP_THREADS = 128  # quantize_fp8_groups: threads per block (16 a group of 128 columns)
GATE_UP_GROUP = 8  # the gate/up weight's rows interleaved in groups of 8 (forward.py), its product's columns too
ROW_THREADS = 128  # rope_and_cache, add_qkv_bias, qk_norm: threads per block (add_qkv_bias, qk_norm: a token each)
MOE_GEMV_TILE = 8  # moe_gemv_*: assignments per tile (the n = 8 side of their mma)
MOE_GEMM_TILE_N = 128  # moe_gemm_*: output columns per tile (gate/up: 64 units' gate and up columns)
MOE_SUM_THREADS = 256  # moe_sum: threads per block, 4 columns each


@dataclass(frozen=True)
class Signature:
    """A kernel's C parameters as cuda/<file>.cu declares them (without __restrict__)."""

    file: str
    params: str
    shared_bytes: int = 0  # the dynamic shared memory of each launch (the kernel's extern __shared__ array)

    @property
    def arg_format(self) -> str:
        """PyCUDA's argument format: P for a pointer, i for an int, f for a float."""
        return "".join("P" if "*" in param else {"int": "i", "float": "f"}[param.split()[0]]
                       for param in self.params.split(","))


SIGNATURES: dict[str, Signature] = {}  # kernel name -> its signature, declared by each launcher


def kernel(file: str, params: str, *names: str, shared: Callable[[str], int] | None = None) -> Callable:
    """Declare the kernel a launcher launches (named as the launcher unless `names` lists template instances);
    shared: each instance's dynamic shared memory in bytes, by name."""
    def declare(launcher: Callable) -> Callable:
        for name in names or (launcher.__name__,):
            SIGNATURES[name] = Signature(file, params, shared(name) if shared else 0)
        return launcher
    return declare


def _sampling_grid(name: str, num_rows: int, row_split: bool) -> tuple[str, tuple[int]]:
    """sample's or logprobs' instance and grid: a block a row, or, where splitting is allowed and there are at most
    SAMPLING_SPLIT_ROWS rows, the `_split` instance's cluster of SAMPLING_SPLIT blocks a row (cuda/sampling.cu)."""
    if row_split and num_rows <= SAMPLING_SPLIT_ROWS:
        return f"{name}_split", (num_rows * SAMPLING_SPLIT,)
    return name, (num_rows,)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _require_vectors(kernel_name: str, **widths: int) -> None:
    for what, width in widths.items():
        _require(width % VECTOR == 0, f"{kernel_name}: {what} {width} is not a multiple of {VECTOR} (the kernel "
                                      "moves 16-byte vectors of bf16)")


def _quantized_norm(name: str, values: int, codes: int, scales: int) -> str:
    """The norm kernel that writes the quantized rows asked for: f16 code values (`name`), e4m3 codes (name_e4m3),
    or none (`name`, values 0); scales come with either."""
    _require(not (values and codes), f"{name}: values (f16) or codes (e4m3), not both")
    _require(bool(values or codes) == bool(scales), f"{name}: quantized rows need their scales, scales their rows")
    return f"{name}_e4m3" if codes else name


def _require_attention_shape(kernel_name: str, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    _require(head_dim in HEAD_DIMS, f"{kernel_name}: head_dim {head_dim} is not one of {HEAD_DIMS}")
    _require(num_heads % num_kv_heads == 0, f"{kernel_name}: {num_heads} query heads are not a multiple of "
                                            f"{num_kv_heads} KV heads")


def _require_window_softcap(kernel_name: str, window: int, softcap: float) -> None:
    _require(isinstance(window, int) and window >= 0, f"{kernel_name}: window {window!r} is not a count of keys >= 0")
    _require(softcap >= 0, f"{kernel_name}: softcap {softcap} < 0")


def decode_rows(group: int) -> int:
    """attention_decode's query heads per block (the rows of its mma tile in use): 8 or 16."""
    return 8 if group <= 8 else 16


def decode_warps(head_dim: int, invariant: bool = False) -> int:
    """attention_decode's warps per block (cuda/attention_decode.cu decode_warps); its batch-invariant form: one."""
    return 1 if invariant else DECODE_WIDE_WARPS if head_dim > 128 else DECODE_WARPS


def decode_blocks(num_kv_heads: int, group: int, head_dim: int = 128, invariant: bool = False) -> int:
    """attention_decode's blocks per sequence and part: a warp per (KV head, chunk of decode_rows query heads)."""
    return -(-num_kv_heads * -(-group // decode_rows(group)) // decode_warps(head_dim, invariant))


def decode_splits(num_seqs: int, num_kv_heads: int, group: int, num_sms: int, head_dim: int = 128) -> int:
    """attention_decode cuts each context into at most this many parts (of whole 16-key tiles): none at a batch of
    enough blocks for ~2 per SM (of DECODE_WARPS warps: more blocks of fewer warps at head_dim > 128); below that
    as many as that needs, at least SMALL_BATCH_SPLITS (a few warps left streaming long contexts alone would set
    the kernel's time)."""
    per_sm = 2 * DECODE_WARPS // decode_warps(head_dim)
    fill = -(-per_sm * num_sms // (num_seqs * decode_blocks(num_kv_heads, group, head_dim)))
    return 1 if fill == 1 else min(MAX_SPLITS, max(fill, SMALL_BATCH_SPLITS))


def prefill_tiles(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """attention_prefill's tiles over sequences of rows[s] (query, head) rows each: the sequence of each tile and
    its first row."""
    tiles = -(-rows // PREFILL_BLOCK_M)
    return np.repeat(np.arange(len(rows)), tiles), np.concatenate([np.arange(t) * PREFILL_BLOCK_M for t in tiles])


def max_prefill_tiles(num_tokens: int, num_seqs: int, group: int) -> int:
    """Most tiles of a prefill of num_tokens tokens over num_seqs sequences (each may end in a partial tile)."""
    return num_tokens * group // PREFILL_BLOCK_M + num_seqs + 1


def _gemv_geometry(kernel_name: str, m: int, n: int, k: int, num_sms: int,
                   fp8: bool = False) -> tuple[str, tuple[int], int]:
    """The kernel, the grid and `split` (warps sharing one 16-row tile, each taking a part of k) of the gemv
    kernels (fp8: e4m3 weights, 16 of them per 16-byte load). The kernel is kernel_name, or its `_pipelined` form
    where a warp has more than one iteration of k and the grid fits on the GPU at one block per SM (that form's
    occupancy): Llama-3.2-1B's down projection, 2% faster alone and W3 1% (bench/results/PERFORMANCE-history.md);
    8B's QKV and O (2 iterations, 2-3 blocks per SM) were 10-15% slower in it."""
    _require(1 <= m <= GEMV_MAX_ROWS, f"{kernel_name}: m = {m} rows not in 1..{GEMV_MAX_ROWS}")
    per_iteration = FP8_GEMV_K_PER_ITERATION if fp8 else GEMV_K_PER_ITERATION
    if fp8:
        _require(k % FP8_VECTOR == 0, f"{kernel_name}: k {k} is not a multiple of {FP8_VECTOR}")
    else:
        _require_vectors(kernel_name, k=k)
    # as many as k keeps busy for a full iteration, so that small n still has enough loads in flight (n = 2048 at
    # k = 2048: all 8 MB requested at once)
    split = 1
    while split < GEMV_WARPS and 2 * split * per_iteration <= k:
        split *= 2
    tiles = -(-n // GEMV_TILE_ROWS)
    blocks = -(-tiles // (GEMV_WARPS // split))
    pipelined = k > split * per_iteration and blocks <= num_sms
    return kernel_name + "_pipelined" * pipelined, (blocks,), split


def fp8_gemv_fits(m: int, k: int) -> bool:
    """Whether gemv_*_fp8 runs m rows of k (else cuBLASLt's FP8 GEMM on e4m3 codes)."""
    return 1 <= m <= GEMV_MAX_ROWS and k % FP8_VECTOR == 0


def _norm_threads(kernel_name: str, hidden: int) -> int:
    """The block of rms_norm and rms_norm_residual: a chunk of 8 entries per thread where a block has enough of
    them, else NORM_CHUNKS each."""
    _require_vectors(kernel_name, hidden=hidden)
    chunks = hidden // VECTOR
    _require(chunks <= MAX_THREADS * NORM_CHUNKS, f"{kernel_name}: hidden {hidden} is over the "
                                                  f"{MAX_THREADS * NORM_CHUNKS * VECTOR} one block holds")
    return -(-min(chunks, MAX_THREADS) // 32) * 32


FP8_SCALES = ", const float* k_scales, const float* v_scales"  # the fp8 kernels' extra parameters
FP8_GATED_ARGS = "bf16* out, const __half* x, const e4m3* w, const float* w_scale, const float* x_scale, int m, " \
                 "int n, int k, int split"  # gemv_swiglu_fp8, gemv_geglu_fp8
FP8_GEMV_ARGS = FP8_GATED_ARGS.replace("bf16* out", "{out}* out", 1) + ", int accumulate"  # gemv_fp8_*
COMBINE_QUANTIZE_ARGS = "{codes}* codes, float* scales, const bf16* out, const float* partial_o, " \
                        "const float2* partial_ml, const int* context_lens, int num_heads, int head_dim, " \
                        "int num_splits, int window"  # attention_combine_quantize(_values)
ROPE_QK_NORM = ", const bf16* q_weight, const bf16* k_weight, float eps, float offset"  # rope_and_cache's qk norm


class QuantizedOutput(NamedTuple):
    """Where a kernel writes its rows quantized for an FP8 product (fp8.cu's quantize_fp8 scheme): device codes
    [rows, width] (values: their f16 values, the FP8 GEMV's input; else e4m3, cuBLASLt's) and float32 scales
    [rows]."""

    codes: int
    scales: int
    values: bool


def combine_quantizes(width: int) -> bool:
    """Whether attention_combine_quantize takes rows of `width` values (its block's registers hold the row)."""
    return width % VECTOR == 0 and width <= COMBINE_ROW_THREADS * VECTOR * COMBINE_ROW_GROUPS


class QkNorm(NamedTuple):
    """The per-head q/k RMSNorm rope_and_cache applies before rotating (rope_fuses_qk_norm): device bf16 gains
    [head_dim] each, epsilon, and the gain offset (ModelConfig.norm_offset)."""

    q_weight: int
    k_weight: int
    eps: float
    offset: float = 0.0


def rope_fuses_qk_norm(head_dim: int, rotary_dim: int) -> bool:
    """Whether rope_and_cache can normalize the q and k heads itself: the whole head rotated, so that the lanes of a
    head (head_dim / 8 of them, a power of two up to a warp) hold all of it."""
    lanes = head_dim // 8
    return rotary_dim == head_dim and lanes <= 32 and lanes & (lanes - 1) == 0


def moe_uses_gemv(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a batch's experts run as GEMVs over tiles of MOE_GEMV_TILE assignments (decode: an expert's weights
    read once while it has at most that many on average) rather than the grouped GEMM's."""
    return num_tokens * top_k <= MOE_GEMV_TILE * num_experts


def moe_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The tile moe_align pads each expert's run to for this batch (the kernels' rows per tile): the GEMV's 8, else
    the grouped GEMM's 32 while experts average at most 16 assignments (nearly every run one tile, half of its rows
    real; Qwen3-30B-A3B at 129-256 tokens), else 64 (fewer padded rows multiplied, B tiles shared by more)."""
    if moe_uses_gemv(num_tokens, top_k, num_experts):
        return MOE_GEMV_TILE
    small = MOE_GEMM_BLOCK_MS[0]
    return small if 2 * num_tokens * top_k <= small * num_experts else MOE_GEMM_BLOCK_MS[-1]


def moe_gemm_shared_bytes(kernel_name: str) -> int:
    """moe_gemm[_fp8]_*_<m>'s dynamic shared memory: MOE_GEMM_STAGES stages of its A (m rows) and B (MOE_GEMM_TILE_N
    rows) tiles, rows of MOE_GEMM_BLOCK_K + 8 16-bit values (cuda/moe.cu GemmStage), and the fp8 kernels' e4m3 B
    codes of each stage as they land (MOE_GEMM_TILE_N x MOE_GEMM_BLOCK_K bytes)."""
    fp8 = kernel_name.startswith("moe_gemm_fp8_")
    block_m = int(kernel_name.rsplit("_", 1)[1])
    codes = MOE_GEMM_TILE_N * MOE_GEMM_BLOCK_K if fp8 else 0
    return MOE_GEMM_STAGES * ((block_m + MOE_GEMM_TILE_N) * (MOE_GEMM_BLOCK_K + 8) * 2 + codes)


def moe_max_tiles(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Most tiles moe_align can make of num_assignments over num_experts (each non-empty run padded to block_m):
    the expert kernels' grids, sized so that no count reaches the host."""
    return (num_assignments + min(num_experts, num_assignments) * (block_m - 1)) // block_m


MOE_INDEX_ARGS = "const int* sorted_ids, const int* expert_ids, const int* num_post_padded"
MOE_GATE_UP_ARGS = "bf16* act, const bf16* x, const bf16* w, " + MOE_INDEX_ARGS + ", int top_k, int num_assignments, " \
                   "int hidden, int inter"
MOE_DOWN_ARGS = "float* out, const bf16* act, const bf16* w, " + MOE_INDEX_ARGS + ", const float* topk_weights, " \
                "int num_assignments, int hidden, int inter"
# the moe_*_fp8_* kernels: A rows as f16 code values with a scale per row, e4m3 weights with a scale per expert and row
MOE_GATE_UP_FP8_ARGS = "bf16* act, const __half* x, const e4m3* w, const float* w_scale, const float* x_scale, " \
                       + MOE_INDEX_ARGS + ", int top_k, int num_assignments, int hidden, int inter"
MOE_DOWN_FP8_ARGS = "float* out, const __half* act, const e4m3* w, const float* w_scale, const float* act_scale, " \
                    + MOE_INDEX_ARGS + ", const float* topk_weights, int num_assignments, int hidden, int inter"


def moe_gemv_split(k: int, fp8: bool = False) -> int:
    """Warps sharing one moe_gemv weight tile, each taking a part of k: enough that each has at most one iteration
    (the fewest that do, up to MOE_GEMV_WARPS), so that a decode step's few weight tiles still keep enough loads in
    flight and no warp waits on a second round trip (Qwen3-30B-A3B: gate/up 8, down 4 of 3 iterations); fp8: e4m3
    weights, twice the k an iteration."""
    per_iteration = MOE_GEMV_K_PER_ITERATION * (2 if fp8 else 1)
    split = 1
    while split < MOE_GEMV_WARPS and split * per_iteration < k:
        split *= 2
    return split


class Ops:
    """The launchers, on one stream. `kernels` maps a kernel name to a callable(grid, block, stream, *args);
    num_sms, the GPU's SM count, is what gemv chooses its form by (0: always the plain one)."""

    def __init__(self, kernels: Mapping[str, Callable], stream, num_sms: int = 0) -> None:
        self.kernels = kernels
        self.stream = stream
        self.num_sms = num_sms

    def launch(self, name: str, grid: tuple[int, ...], block: int, *args, shared_bytes: int | None = None) -> None:
        """shared_bytes: this launch's dynamic shared memory, at most its kernel's declared amount (None: that)."""
        if shared_bytes is None:
            self.kernels[name](grid, (block, 1, 1), self.stream, *args)
        else:
            self.kernels[name](grid, (block, 1, 1), self.stream, *args, shared_bytes=shared_bytes)

    @kernel("embedding", "float* out, const bf16* table, const int* ids, int hidden, float scale")
    def embedding(self, out: int, table: int, ids: int, num_tokens: int, hidden: int, scale: float = 1.0) -> None:
        """float32 out [num_tokens, hidden] = the table's rows ids, times scale (Gemma's scaled embeddings)."""
        _require_vectors("embedding", hidden=hidden)
        self.launch("embedding", (num_tokens,), ELEMENTWISE_THREADS, out, table, ids, hidden, float(scale))

    @kernel("random", "bf16* out, const bf16* table, int n, int k1, int k2")
    def random_bf16(self, out: int, table: int, n: int, k1: int, k2: int) -> None:
        """bf16 out [n] = a RandomBf16Weights tensor (dummy.RandomRecipe: table [2^16] on the device, uint32 keys)."""
        _require(0 < n < 1 << 31, f"random_bf16: {n} values (at most 2^31 - 1)")
        signed = [k - (1 << 32) if k >= 1 << 31 else k for k in (k1, k2)]
        self.launch("random_bf16", (min(-(-n // ELEMENTWISE_THREADS), 1 << 16),), ELEMENTWISE_THREADS, out, table, n,
                    *signed)

    @kernel("embedding", "int* ids, const int* src, const int* sampled, int n")
    def resolve_tokens(self, ids: int, src: int, sampled: int, n: int) -> None:
        self.launch("resolve_tokens", (-(-n // ELEMENTWISE_THREADS),), ELEMENTWISE_THREADS, ids, src, sampled, n)

    @kernel("norm", "bf16* out, __half* values, float* scales, const float* x, const bf16* w, const int* rows, "
                    "int hidden, float eps, float offset")
    @kernel("norm", "bf16* out, e4m3* codes, float* scales, const float* x, const bf16* w, const int* rows, "
                    "int hidden, float eps, float offset", "rms_norm_e4m3")
    def rms_norm(self, out: int, x: int, w: int, rows: int, num_rows: int, hidden: int, eps: float,
                 offset: float = 0.0, values: int = 0, scales: int = 0, codes: int = 0) -> None:
        """Rows 0..num_rows-1 of x, or with rows (a device int32 array, else 0) rows[0..num_rows-1], normalized and
        times (offset + w) (offset: ModelConfig.norm_offset); with scales (float32 [num_rows]) and values (f16
        [num_rows, hidden]: the values of its e4m3 codes, gemv_fp8's x) or codes (e4m3 [num_rows, hidden]: the FP8
        GEMM's input), each out row quantized for the next FP8 product too, with quantize_fp8's arithmetic."""
        name = _quantized_norm("rms_norm", values, codes, scales)
        self.launch(name, (num_rows,), _norm_threads("rms_norm", hidden), out, codes or values, scales, x, w, rows,
                    hidden, eps, float(offset))

    @kernel("norm", "bf16* out, __half* values, float* scales, float* x, const float* part, const bf16* part_w, "
                    "const bf16* w, int hidden, float eps, float offset")
    @kernel("norm", "bf16* out, e4m3* codes, float* scales, float* x, const float* part, const bf16* part_w, "
                    "const bf16* w, int hidden, float eps, float offset", "rms_norm_residual_e4m3")
    def rms_norm_residual(self, out: int, x: int, part: int, part_w: int, w: int, num_rows: int, hidden: int,
                          eps: float, offset: float = 0.0, values: int = 0, scales: int = 0, codes: int = 0) -> None:
        """The sandwich norms' residual add: float32 x [num_rows, hidden] += rms_norm(part) * (offset + part_w)
        (part: float32, the O or down GEMM's product), then, unless out is 0, bf16 out = rms_norm(x) * (offset + w)
        of the new x, quantized into values or codes and scales as rms_norm's."""
        name = _quantized_norm("rms_norm_residual", values, codes, scales)
        self.launch(name, (num_rows,), _norm_threads("rms_norm_residual", hidden), out, codes or values, scales, x,
                    part, part_w, w, hidden, eps, float(offset))

    @kernel("qkv", "bf16* qkv, const bf16* bias, int width")
    def add_qkv_bias(self, qkv: int, bias: int, num_tokens: int, width: int) -> None:
        """qkv [num_tokens, width] += bias [width] (Qwen2's Q/K/V biases, fused as the QKV weight's rows)."""
        _require_vectors("add_qkv_bias", width=width)
        self.launch("add_qkv_bias", (num_tokens,), ROW_THREADS, qkv, bias, width)

    @kernel("qkv", "bf16* qkv, const bf16* q_weight, const bf16* k_weight, int num_heads, int num_kv_heads, "
                   "int head_dim, int row_stride, float eps, float offset")
    def qk_norm(self, qkv: int, q_weight: int, k_weight: int, num_tokens: int, num_heads: int, num_kv_heads: int,
                head_dim: int, row_stride: int, eps: float, offset: float = 0.0) -> None:
        """RMSNorm of each Q and K head of the fused qkv rows, times (offset + gain), in place (Qwen3, Gemma 3),
        before rope."""
        _require((num_heads + 2 * num_kv_heads) * head_dim <= row_stride,
                 f"qk_norm: {num_heads} + 2 * {num_kv_heads} heads of {head_dim} do not fit in a row of {row_stride}")
        self.launch("qk_norm", (num_tokens,), ROW_THREADS, qkv, q_weight, k_weight, num_heads, num_kv_heads,
                    head_dim, row_stride, eps, float(offset))

    @kernel("qkv", "bf16* qkv, const bf16* q_weight, const bf16* k_weight, int q_width, int kv_width, "
                   "int row_stride, float eps")
    def qk_norm_projection(self, qkv: int, q_weight: int, k_weight: int, num_tokens: int, q_width: int,
                           kv_width: int, row_stride: int, eps: float) -> None:
        """RMSNorm of each token's whole Q [q_width] and whole K [kv_width] of the fused qkv rows, in place (OLMoE)."""
        _require(q_width + 2 * kv_width <= row_stride,
                 f"qk_norm_projection: Q {q_width} + 2 * K {kv_width} do not fit in a row of {row_stride}")
        self.launch("qk_norm_projection", (num_tokens,), ROW_THREADS, qkv, q_weight, k_weight, q_width, kv_width,
                    row_stride, eps)

    @kernel("activation", "bf16* out, const bf16* gate_up, int inter, int group")
    def silu_and_mul(self, out: int, gate_up: int, num_tokens: int, inter: int, group: int = GATE_UP_GROUP) -> None:
        """out [num_tokens, inter] = SwiGLU of gate_up [num_tokens, 2 * inter], its columns interleaved in groups of
        `group` (that many gate units, then the same units' up; group = inter: all gates, then all ups)."""
        self._gated("silu_and_mul", out, gate_up, num_tokens, inter, group)

    @kernel("activation", "bf16* out, const bf16* gate_up, int inter, int group")
    def gelu_tanh_and_mul(self, out: int, gate_up: int, num_tokens: int, inter: int,
                          group: int = GATE_UP_GROUP) -> None:
        """silu_and_mul's GeGLU (gelu_pytorch_tanh of the gate, times up): Gemma's MLP."""
        self._gated("gelu_tanh_and_mul", out, gate_up, num_tokens, inter, group)

    def _gated(self, name: str, out: int, gate_up: int, num_tokens: int, inter: int, group: int) -> None:
        _require_vectors(name, intermediate_size=inter, group=group)
        _require(inter % group == 0, f"{name}: {inter} units are not whole groups of {group}")
        per_block = ELEMENTWISE_THREADS * VECTOR  # a vector per thread
        self.launch(name, (num_tokens, -(-inter // per_block)), ELEMENTWISE_THREADS, out, gate_up, inter, group)

    @kernel("activation", "e4m3* codes, float* scales, const bf16* gate_up, int inter", "silu_and_mul_e4m3",
            "gelu_tanh_and_mul_e4m3")
    def gated_e4m3(self, activation: str, codes: int, scales: int, gate_up: int, num_tokens: int,
                   inter: int) -> None:
        """silu_and_mul / gelu_tanh_and_mul (`activation`, the bf16 kernel's name) quantized instead of stored: e4m3
        codes [num_tokens, inter] and float32 scales [num_tokens] of the bf16 activation, as quantize_fp8 would
        write them (an FP8 down projection's input)."""
        _require(activation in ("silu_and_mul", "gelu_tanh_and_mul"), f"gated_e4m3: no {activation!r} kernel")
        _require_vectors(activation, intermediate_size=inter)
        self.launch(f"{activation}_e4m3", (num_tokens,), QUANTIZE_THREADS, codes, scales, gate_up, inter)

    @kernel("activation", "float* logits, int vocab, float cap")
    def soft_cap(self, logits: int, num_rows: int, vocab: int, cap: float) -> None:
        """float32 logits [num_rows, vocab] = cap * tanh(logits / cap), in place (final_logit_softcapping)."""
        _require(cap > 0, f"soft_cap: cap {cap} is not > 0")
        self.launch("soft_cap", (num_rows, -(-vocab // ELEMENTWISE_THREADS)), ELEMENTWISE_THREADS, logits, vocab,
                    float(cap))

    @kernel("cache", "bf16* qkv, bf16* k_cache, bf16* v_cache, const int* positions, const int* slot_mapping, "
                     "const float2* cos_sin, int num_heads, int num_kv_heads, int head_dim, int rotary_dim, "
                     "int row_stride" + ROPE_QK_NORM, "rope_and_cache_bf16")
    @kernel("cache", "bf16* qkv, e4m3* k_cache, e4m3* v_cache, const int* positions, const int* slot_mapping, "
                     "const float2* cos_sin, int num_heads, int num_kv_heads, int head_dim, int rotary_dim, "
                     "int row_stride" + ROPE_QK_NORM + FP8_SCALES, "rope_and_cache_fp8")
    def rope_and_cache(self, qkv: int, k_cache: int, v_cache: int, positions: int, slot_mapping: int, cos_sin: int,
                       num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, row_stride: int,
                       kv_scales: tuple[int, int] | None = None, rotary_dim: int | None = None,
                       qk_norm: QkNorm | None = None) -> None:
        """RoPE on the first rotary_dim dims (None: all) of the q and k heads of the qkv rows, in place, with
        cos_sin (float2 [positions, rotary_dim / 2]: model/rope.py's cos and sin), and their rotated K and V into
        the cache slots slot_mapping (negative: none). kv_scales: an fp8 cache's K and V scales of this layer
        (device float32 [kv_heads] each); None: a bf16 cache. qk_norm: each q and k head's RMSNorm first (the qk_norm
        kernel's, fused where rope_fuses_qk_norm)."""
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        _require(qk_norm is None or rope_fuses_qk_norm(head_dim, rotary_dim),
                 f"rope_and_cache: cannot fuse the q/k norms of heads of {head_dim} with rotary_dim {rotary_dim}")
        _require_vectors("rope_and_cache", head_dim=head_dim, row_stride=row_stride, rotary_dim=rotary_dim)
        _require(0 < rotary_dim <= head_dim, f"rope_and_cache: rotary_dim {rotary_dim} not in 1..{head_dim}")
        _require((num_heads + 2 * num_kv_heads) * head_dim <= row_stride,
                 f"rope_and_cache: {num_heads} + 2 * {num_kv_heads} heads of {head_dim} do not fit in a row of "
                 f"{row_stride}")
        norm = (0, 0, 0.0, 0.0) if qk_norm is None else (qk_norm.q_weight, qk_norm.k_weight, float(qk_norm.eps),
                                                         float(qk_norm.offset))
        args = (qkv, k_cache, v_cache, positions, slot_mapping, cos_sin, num_heads, num_kv_heads, head_dim,
                rotary_dim, row_stride, *norm)
        # a thread per 4 rotated pairs of a q or k head, then per 8 unrotated K entries, then per 8 V entries
        items = ((num_heads + num_kv_heads) * rotary_dim + num_kv_heads * (head_dim - rotary_dim)
                 + num_kv_heads * head_dim) // VECTOR
        grid = (num_tokens, -(-items // ROW_THREADS))
        if kv_scales is None:
            self.launch("rope_and_cache_bf16", grid, ROW_THREADS, *args)
        else:
            self.launch("rope_and_cache_fp8", grid, ROW_THREADS, *args, *kv_scales)

    @kernel("attention_decode", "bf16* out, float* partial_o, float2* partial_ml, const bf16* q, const bf16* k_cache, "
                                "const bf16* v_cache, const int* block_tables, const int* bt_stride, "
                                "const int* context_lens, float scale, int num_heads, int num_kv_heads, "
                                "int block_size, int row_stride, int num_splits, int window, float softcap",
            *(f"attention_decode_d{d}_r{r}{inv}" for inv in ("", "_inv") for d in HEAD_DIMS for r in (8, 16)))
    @kernel("attention_decode", "bf16* out, float* partial_o, float2* partial_ml, const bf16* q, const e4m3* k_cache, "
                                "const e4m3* v_cache, const int* block_tables, const int* bt_stride, "
                                "const int* context_lens, float scale, int num_heads, int num_kv_heads, "
                                "int block_size, int row_stride, int num_splits, int window, float softcap"
                                + FP8_SCALES,
            *(f"attention_decode_fp8_d{d}_r{r}{inv}" for inv in ("", "_inv") for d in HEAD_DIMS for r in (8, 16)))
    def attention_decode(self, out: int, partial_o: int, partial_ml: int, q: int, k_cache: int, v_cache: int,
                         block_tables: int, bt_stride: int, context_lens: int, num_seqs: int, scale: float,
                         num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, row_stride: int,
                         num_splits: int, kv_scales: tuple[int, int] | None = None, window: int = 0,
                         softcap: float = 0.0, invariant: bool = False,
                         quantized: QuantizedOutput | None = None) -> bool:
        """Decode attention of num_seqs sequences; with num_splits > 1 the keys a query sees are cut into up to
        num_splits parts of whole 16-key tiles, through partial_o [num_seqs * num_heads * num_splits, head_dim]
        float32 and partial_ml [same rows] float2, merged by attention_combine. kv_scales: an fp8 cache's K and V
        scales of this layer (device float32 [kv_heads] each); None: a bf16 cache. window: the layer's sliding
        window (0: none; the kernel reads no key before it); softcap: its attention-logit cap (0: none).
        invariant: the batch-invariant form (attention_decode_*_inv: a row's bits are attention_prefill's _inv
        kernels'; its parts are whole chunks of INVARIANT_CHUNK keys, partial_o holding INVARIANT_PARTS rows per
        (sequence, head) when num_splits > 1, merged by attention_combine_inv). quantized: where the merge may write
        the rows quantized for an FP8 product instead of out (attention_combine_quantize; not the invariant form).
        Returns whether it did: only with parts to merge, so that the quantizing costs no launch of its own."""
        _require_attention_shape("attention_decode", head_dim, num_heads, num_kv_heads)
        _require(num_splits >= 1, f"attention_decode: num_splits {num_splits} < 1")
        _require(num_splits <= INVARIANT_PARTS or not invariant,
                 f"attention_decode: {num_splits} parts exceed the invariant form's {INVARIANT_PARTS} slots")
        _require_window_softcap("attention_decode", window, softcap)
        group = num_heads // num_kv_heads
        rows = decode_rows(group)
        fp8, inv = "" if kv_scales is None else "fp8_", "_inv" if invariant else ""
        self.launch(f"attention_decode_{fp8}d{head_dim}_r{rows}{inv}",
                    (decode_blocks(num_kv_heads, group, head_dim, invariant), num_seqs, num_splits),
                    decode_warps(head_dim, invariant) * 32,
                    out, partial_o, partial_ml, q, k_cache, v_cache, block_tables, bt_stride,
                    context_lens, scale, num_heads, num_kv_heads, block_size, row_stride, num_splits, window,
                    float(softcap), *(kv_scales or ()))
        if num_splits == 1:
            return False
        if invariant:
            self.attention_combine_inv(out, partial_o, partial_ml, context_lens, num_seqs, num_heads, num_kv_heads,
                                       head_dim, num_splits, window, kv_scales[1] if kv_scales else 0)
            return False
        if quantized is not None and combine_quantizes(num_heads * head_dim):
            self.attention_combine_quantize(quantized, out, partial_o, partial_ml, context_lens, num_seqs, num_heads,
                                            head_dim, num_splits, window)
            return True
        self.attention_combine(out, partial_o, partial_ml, context_lens, num_seqs, num_heads, head_dim, num_splits,
                               window)
        return False

    @kernel("attention_decode", "bf16* out, const float* partial_o, const float2* partial_ml, const int* context_lens, "
                                "int num_splits, int window")
    def attention_combine(self, out: int, partial_o: int, partial_ml: int, context_lens: int, num_seqs: int,
                          num_heads: int, head_dim: int, num_splits: int, window: int = 0) -> None:
        """Merge attention_decode's parts (window: the one it was given, which its parts are cut by)."""
        self.launch("attention_combine", (num_heads, num_seqs), head_dim, out, partial_o, partial_ml, context_lens,
                    num_splits, window)

    @kernel("attention_decode", "bf16* out, const float* partial_o, const float2* partial_ml, const int* context_lens, "
                                "int num_splits, int window, const float* v_scales, int group")
    def attention_combine_inv(self, out: int, partial_o: int, partial_ml: int, context_lens: int, num_seqs: int,
                              num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int, window: int,
                              v_scales: int) -> None:
        """Fold the chunk states of attention_decode's invariant parts in the chunks' order (v_scales: an fp8
        cache's V scales of the layer, 0: a bf16 cache). partial_o and partial_ml hold INVARIANT_PARTS rows per
        (sequence, head) of num_seqs, as attention_decode writes them with num_splits > 1: the kernel reads the
        first group of each before it knows the context's chunks."""
        self.launch("attention_combine_inv", (num_heads, num_seqs), head_dim, out, partial_o, partial_ml,
                    context_lens, num_splits, window, v_scales, num_heads // num_kv_heads)

    @kernel("attention_decode", COMBINE_QUANTIZE_ARGS.format(codes="e4m3"), "attention_combine_quantize")
    @kernel("attention_decode", COMBINE_QUANTIZE_ARGS.format(codes="__half"), "attention_combine_quantize_values")
    def attention_combine_quantize(self, quantized: QuantizedOutput, out: int, partial_o: int, partial_ml: int,
                                   context_lens: int, num_seqs: int, num_heads: int, head_dim: int, num_splits: int,
                                   window: int = 0) -> None:
        """attention_combine, then each sequence's row [num_heads * head_dim] quantized as quantize_fp8 (or
        quantize_fp8_values) does, into quantized's codes and scales, in one launch; out is read, not written (the
        rows attention_decode wrote whole)."""
        width = num_heads * head_dim
        _require(combine_quantizes(width), f"attention_combine_quantize: rows of {width} values exceed "
                                           f"{COMBINE_ROW_THREADS * VECTOR * COMBINE_ROW_GROUPS}")
        name = "attention_combine_quantize" + "_values" * quantized.values
        self.launch(name, (num_seqs,), COMBINE_ROW_THREADS, quantized.codes, quantized.scales, out, partial_o,
                    partial_ml, context_lens, num_heads, head_dim, num_splits, window)

    @kernel("attention_prefill", "bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache, "
                                 "const int* block_tables, int bt_stride, const int* query_start_loc, "
                                 "const int* context_lens, const int* tile_seq, const int* tile_row0, float scale, "
                                 "int num_heads, int num_kv_heads, int block_size, int row_stride, int window, "
                                 "float softcap", *(f"attention_prefill_d{d}{inv}" for inv in ("", "_inv")
                                                    for d in HEAD_DIMS))
    @kernel("attention_prefill", "bf16* out, const bf16* qkv, const e4m3* k_cache, const e4m3* v_cache, "
                                 "const int* block_tables, int bt_stride, const int* query_start_loc, "
                                 "const int* context_lens, const int* tile_seq, const int* tile_row0, float scale, "
                                 "int num_heads, int num_kv_heads, int block_size, int row_stride, int window, "
                                 "float softcap" + FP8_SCALES,
            *(f"attention_prefill_fp8_d{d}{inv}" for inv in ("", "_inv") for d in HEAD_DIMS))
    def attention_prefill(self, out: int, qkv: int, k_cache: int, v_cache: int, block_tables: int, bt_stride: int,
                          query_start_loc: int, context_lens: int, tile_seq: int, tile_row0: int, num_tiles: int,
                          scale: float, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                          row_stride: int, kv_scales: tuple[int, int] | None = None, window: int = 0,
                          softcap: float = 0.0, invariant: bool = False) -> None:
        """Prefill attention over num_tiles tiles listed in tile_seq / tile_row0 (prefill_tiles). kv_scales, window,
        softcap and invariant: as attention_decode's."""
        _require_attention_shape("attention_prefill", head_dim, num_heads, num_kv_heads)
        _require_window_softcap("attention_prefill", window, softcap)
        fp8, inv = "" if kv_scales is None else "fp8_", "_inv" if invariant else ""
        self.launch(f"attention_prefill_{fp8}d{head_dim}{inv}", (num_tiles, num_kv_heads), PREFILL_BLOCK_M // 16 * 32,
                    out, qkv, k_cache, v_cache, block_tables, bt_stride, query_start_loc, context_lens, tile_seq,
                    tile_row0, scale, num_heads, num_kv_heads, block_size, row_stride, window, float(softcap),
                    *(kv_scales or ()))

    @kernel("sampling", "int* out, const float* logits, int vocab, const float* temperature, const float* top_p, "
                        "const int* top_k, const float* min_p, const uint32_t* noise_keys", "sample", "sample_split")
    def sample(self, out: int, logits: int, num_rows: int, vocab: int, temperature: int, top_p: int, top_k: int,
               min_p: int, noise_keys: int, row_split: bool = False) -> None:
        """A token per row. row_split: a row may be split over blocks (_sampling_grid), which adds in another order
        (not batch-invariant)."""
        name, grid = _sampling_grid("sample", num_rows, row_split)
        self.launch(name, grid, SAMPLING_THREADS, out, logits, vocab, temperature, top_p, top_k, min_p, noise_keys)

    @kernel("sampling", "float* token_lp, int* top_ids, float* top_lp, const float* logits, const int* token_ids, "
                        "const int* rows, int vocab, int k", "logprobs", "logprobs_split")
    def logprobs(self, token_lp: int, top_ids: int, top_lp: int, logits: int, token_ids: int, num_rows: int,
                 vocab: int, k: int, rows: int = 0, row_split: bool = False) -> None:
        """Logprobs of num_rows rows of logits: rows 0.. or (rows: device int32 [num_rows]) those rows, written at
        their own row of the outputs; row_split as sample's."""
        _require(0 <= k <= MAX_TOP_LOGPROBS, f"logprobs: k = {k} not in 0..{MAX_TOP_LOGPROBS}")
        name, grid = _sampling_grid("logprobs", num_rows, row_split)
        self.launch(name, grid, SAMPLING_THREADS, token_lp, top_ids, top_lp, logits, token_ids, rows, vocab, k)

    @kernel("gemv", "float* out, const bf16* x, const bf16* w, int m, int n, int k, int split, int accumulate",
            "gemv_f32", "gemv_f32_pipelined")
    @kernel("gemv", "bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int split, int accumulate",
            "gemv_bf16", "gemv_bf16_pipelined")
    def gemv(self, out: int, x: int, w: int, m: int, n: int, k: int, out_fp32: bool, accumulate: bool) -> None:
        """out[m, n] = x[m, k] . w[n, k]^T (+ out when accumulate), bf16 in, float32 accumulation, for m <= 8."""
        name, grid, split = _gemv_geometry("gemv_f32" if out_fp32 else "gemv_bf16", m, n, k, self.num_sms)
        self.launch(name, grid, GEMV_WARPS * 32, out, x, w, m, n, k, split, int(accumulate))

    @kernel("gemv_chain", "bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate",
            "gemv_chain_bf16", shared=lambda name: CHAIN_SHARED_BYTES)
    @kernel("gemv_chain", "float* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate",
            "gemv_chain_f32", shared=lambda name: CHAIN_SHARED_BYTES)
    @kernel("gemv_chain", "bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate",
            "gemv_chain8_bf16", shared=lambda name: CHAIN_WARPS * chain_warp_shared_bytes(8))
    @kernel("gemv_chain", "float* out, const bf16* x, const bf16* w, int m, int n, int k, int accumulate",
            "gemv_chain8_f32", shared=lambda name: CHAIN_WARPS * chain_warp_shared_bytes(8))
    def gemv_chain(self, out: int, x: int, w: int, m: int, n: int, k: int, out_fp32: bool, accumulate: bool,
                   tile_rows: int = GEMV_TILE_ROWS) -> None:
        """gemv's product in the order of cuBLASLt's split-free algorithms (cuda/gemv_chain.cu): the batch-invariant
        GEMV, for m <= 8; tile_rows: a warp's weight rows, 16 or 8 (the same bits; twice the tiles)."""
        _require(tile_rows in CHAIN_TILES, f"gemv_chain: tiles of {tile_rows} rows (one of {CHAIN_TILES})")
        name = f"gemv_chain{'' if tile_rows == GEMV_TILE_ROWS else tile_rows}_{'f32' if out_fp32 else 'bf16'}"
        self._gemv_chain(name, out, x, w, m, n, k, int(accumulate), tile_rows=tile_rows)

    @kernel("gemv_chain", "bf16* out, const bf16* x, const bf16* w, int m, int n, int k", "gemv_swiglu_chain",
            "gemv_geglu_chain", shared=lambda name: CHAIN_SHARED_BYTES)
    def gemv_chain_gated(self, activation: str, out: int, x: int, w: int, m: int, n: int, k: int) -> None:
        """gemv_swiglu's or gemv_geglu's product (activation: "swiglu" or "geglu") in gemv_chain's order."""
        _require(n % GEMV_TILE_ROWS == 0, f"gemv_{activation}_chain: n = {n} rows are not whole groups of 8 gate and "
                                          "8 up rows")
        self._gemv_chain(f"gemv_{activation}_chain", out, x, w, m, n, k)

    def _gemv_chain(self, name: str, out: int, x: int, w: int, m: int, n: int, k: int, *accumulate: int,
                    tile_rows: int = GEMV_TILE_ROWS) -> None:
        """A warp a tile of tile_rows rows; blocks of CHAIN_WARPS warps, or fewer when the tiles would not fill the
        SMs."""
        _require(0 < m <= GEMV_MAX_ROWS, f"{name}: m = {m} rows (1 to {GEMV_MAX_ROWS})")
        _require(k % MMA_K == 0 and k >= MMA_K, f"{name}: k {k} is not a multiple of {MMA_K} (the mma's k)")
        tiles = -(-n // tile_rows)
        warps = max(1, min(CHAIN_WARPS, tiles // self.num_sms)) if self.num_sms else CHAIN_WARPS
        self.launch(name, (-(-tiles // warps),), warps * 32, out, x, w, m, n, k, *accumulate,
                    shared_bytes=warps * chain_warp_shared_bytes(tile_rows))

    @kernel("gemv", "bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int split", "gemv_swiglu_bf16",
            "gemv_swiglu_bf16_pipelined")
    def gemv_swiglu(self, out: int, x: int, w: int, m: int, n: int, k: int) -> None:
        """bf16 out[m, n / 2] = SwiGLU(x[m, k] . w[n, k]^T), w's rows interleaved in groups of 8 (8 gate rows, then
        the same units' 8 up rows), for m <= 8."""
        self._gemv_gated("gemv_swiglu_bf16", out, x, w, m, n, k)

    @kernel("gemv", "bf16* out, const bf16* x, const bf16* w, int m, int n, int k, int split", "gemv_geglu_bf16",
            "gemv_geglu_bf16_pipelined")
    def gemv_geglu(self, out: int, x: int, w: int, m: int, n: int, k: int) -> None:
        """gemv_swiglu's GeGLU (gelu_pytorch_tanh of the gate, times up): Gemma's MLP."""
        self._gemv_gated("gemv_geglu_bf16", out, x, w, m, n, k)

    def _gemv_gated(self, kernel_name: str, out: int, x: int, w: int, m: int, n: int, k: int) -> None:
        _require(n % GEMV_TILE_ROWS == 0, f"{kernel_name}: n = {n} rows are not whole groups of 8 gate and 8 up rows")
        name, grid, split = _gemv_geometry(kernel_name, m, n, k, self.num_sms)
        self.launch(name, grid, GEMV_WARPS * 32, out, x, w, m, n, k, split)

    @kernel("logits_processors", "float* logits, int vocab, const int* last_tokens, const int* last_src, "
                                 "const int* sampled, const int* penalty_slots, const float* presence, "
                                 "const float* frequency, const float* repetition, const int* counts, "
                                 "const uint8_t* prompt_mask, const int* allowed_ptr, const int* allowed_ids, "
                                 "const int* bias_ptr, const int* bias")
    def apply_logits_processors(self, logits: int, num_rows: int, vocab: int, last_tokens: int, last_src: int,
                                sampled: int, penalty_slots: int, presence: int, frequency: int, repetition: int,
                                counts: int, prompt_mask: int, allowed_ptr: int, allowed_ids: int, bias_ptr: int,
                                bias: int) -> None:
        """LogitsProcessing on num_rows rows of logits, in place (bias: int32 triples of token, float bits, cond)."""
        self.launch("apply_logits_processors", (num_rows,), ELEMENTWISE_THREADS, logits, vocab, last_tokens, last_src,
                    sampled, penalty_slots, presence, frequency, repetition, counts, prompt_mask, allowed_ptr,
                    allowed_ids, bias_ptr, bias)

    @kernel("logits_processors", "float* logits, int vocab, const int* bitmask, int words, const int* bitmask_rows")
    def apply_token_bitmask(self, logits: int, num_rows: int, vocab: int, bitmask: int, bitmask_rows: int) -> None:
        """Structured outputs' masks on num_rows rows of logits, in place: row i keeps the tokens that bitmask row
        bitmask_rows[i] (int32 words [C, ceil(vocab / 32)]) allows; rows with bitmask_rows[i] < 0 are untouched."""
        self.launch("apply_token_bitmask", (num_rows,), ELEMENTWISE_THREADS, logits, vocab, bitmask,
                    -(-vocab // 32), bitmask_rows)

    @kernel("logits_processors", "int* counts, int vocab, const int* sampled, const int* count_slots, int n")
    def count_tokens(self, counts: int, vocab: int, sampled: int, count_slots: int, n: int) -> None:
        self.launch("count_tokens", (-(-n // ELEMENTWISE_THREADS),), ELEMENTWISE_THREADS, counts, vocab, sampled,
                    count_slots, n)

    @kernel("logits_processors", "int* counts, uint8_t* prompt_mask, int vocab, const int* slots")
    def clear_token_slots(self, counts: int, prompt_mask: int, vocab: int, slots: int, num_slots: int) -> None:
        self.launch("clear_token_slots", (num_slots, -(-vocab // CLEAR_THREADS)), CLEAR_THREADS, counts, prompt_mask,
                    vocab, slots)

    @kernel("logits_processors", "int* counts, uint8_t* prompt_mask, int vocab, const int* tokens, "
                                 "const int* token_slots, int n")
    def fill_token_slots(self, counts: int, prompt_mask: int, vocab: int, tokens: int, token_slots: int,
                         n: int) -> None:
        """After clear_token_slots: token i goes to slot token_slots[i]'s counts, or (as -1 - slot) its prompt
        mask."""
        self.launch("fill_token_slots", (-(-n // ELEMENTWISE_THREADS),), ELEMENTWISE_THREADS, counts, prompt_mask,
                    vocab, tokens, token_slots, n)

    @kernel("logits_processors", "bf16* const* caches, const int* pairs, int block_elems")
    def copy_blocks(self, caches: int, num_caches: int, pairs: int, num_pairs: int, block_elems: int) -> None:
        """Copy KV blocks pairs[p] = (source, destination) in each of num_caches caches (a device array of
        pointers); block_elems counts 2-byte units (an fp8 block of n entries is n / 2 of them)."""
        _require_vectors("copy_blocks", block_elems=block_elems)
        self.launch("copy_blocks", (num_pairs, num_caches), ELEMENTWISE_THREADS, caches, pairs, block_elems)

    @kernel("fp8", "e4m3* out, float* scales, const bf16* x, int cols")
    def quantize_fp8(self, out: int, scales: int, x: int, rows: int, cols: int) -> None:
        """e4m3 out [rows, cols] and float32 scales [rows] of bf16 x [rows, cols]: one scale per row, amax / 448 (a
        weight's output channels at load, a linear layer's input tokens in a step)."""
        _require_vectors("quantize_fp8", cols=cols)
        self.launch("quantize_fp8", (rows,), QUANTIZE_THREADS, out, scales, x, cols)

    @kernel("fp8", "float* out, const float* acc, const float* row_scale, const float* col_scale, int n, "
                   "int accumulate", "scale_rows_cols_f32")
    @kernel("fp8", "bf16* out, const float* acc, const float* row_scale, const float* col_scale, int n, "
                   "int accumulate", "scale_rows_cols_bf16")
    def scale_rows_cols(self, out: int, acc: int, row_scale: int, col_scale: int, m: int, n: int, out_fp32: bool,
                        accumulate: bool) -> None:
        """out[m, n] = acc[m, n] * row_scale[m] * col_scale[n] (+ out when accumulate): float32 acc, out float32 or
        bf16 (the FP8 GEMM's epilogue)."""
        _require_vectors("scale_rows_cols", n=n)
        per_block = ELEMENTWISE_THREADS * VECTOR
        self.launch("scale_rows_cols_" + ("f32" if out_fp32 else "bf16"), (m, -(-n // per_block)),
                    ELEMENTWISE_THREADS, out, acc, row_scale, col_scale, n, int(accumulate))

    @kernel("fp8", "__half* out, float* scales, const bf16* x, int cols")
    def quantize_fp8_values(self, out: int, scales: int, x: int, rows: int, cols: int) -> None:
        """quantize_fp8 with the f16 values of the codes as out [rows, cols]: gemv_fp8's x where the kernel that
        wrote x did not quantize it."""
        _require_vectors("quantize_fp8_values", cols=cols)
        self.launch("quantize_fp8_values", (rows,), QUANTIZE_THREADS, out, scales, x, cols)

    @kernel("fp8", FP8_GEMV_ARGS.format(out="float"), "gemv_fp8_f32", "gemv_fp8_f32_pipelined")
    @kernel("fp8", FP8_GEMV_ARGS.format(out="bf16"), "gemv_fp8_bf16", "gemv_fp8_bf16_pipelined")
    def gemv_fp8(self, out: int, x: int, w: int, w_scale: int, x_scale: int, m: int, n: int, k: int, out_fp32: bool,
                 accumulate: bool) -> None:
        """out[m, n] = x . w^T * x_scale[m] * w_scale[n] (+ out when accumulate) for m <= 8: x the f16 values of
        e4m3 codes [m, k] with their per-row scales x_scale (rms_norm's or quantize_fp8_values's), w e4m3 codes
        [n, k] with theirs."""
        name, grid, split = _gemv_geometry("gemv_fp8_" + ("f32" if out_fp32 else "bf16"), m, n, k, self.num_sms,
                                           fp8=True)
        self.launch(name, grid, GEMV_WARPS * 32, out, x, w, w_scale, x_scale, m, n, k, split, int(accumulate))

    @kernel("fp8", "e4m3* out, float* scales, const bf16* x, int rows, int cols", "quantize_fp8_groups")
    @kernel("fp8", "__half* out, float* scales, const bf16* x, int rows, int cols", "quantize_fp8_groups_values")
    def quantize_fp8_groups(self, out: int, scales: int, x: int, rows: int, cols: int, values: bool) -> None:
        """bf16 x [rows, cols] quantized per row and 128 columns: e4m3 codes (values: their f16 values, the FP8
        GEMV's x) [rows, cols] and float32 scales [ceil(cols / 128), rows], amax / 448 (a block-scaled FP8 layer's
        input: cuBLASLt's VEC128 scales, gemv_fp8_block's)."""
        _require_vectors("quantize_fp8_groups", cols=cols)
        per_block = QUANTIZE_GROUP_THREADS * VECTOR  # 8 groups of 128
        self.launch("quantize_fp8_groups" + "_values" * values, (rows, -(-cols // per_block)),
                    QUANTIZE_GROUP_THREADS, out, scales, x, rows, cols)

    @kernel("fp8", FP8_GEMV_ARGS.format(out="float"), "gemv_fp8_block_f32", "gemv_fp8_block_f32_pipelined")
    @kernel("fp8", FP8_GEMV_ARGS.format(out="bf16"), "gemv_fp8_block_bf16", "gemv_fp8_block_bf16_pipelined")
    def gemv_fp8_block(self, out: int, x: int, w: int, w_scale: int, x_scale: int, m: int, n: int, k: int,
                       out_fp32: bool, accumulate: bool) -> None:
        """gemv_fp8 with block scales: w_scale one per 128 x 128 block of w [ceil(n / 128), block_scale_stride(k)],
        x_scale one per x row and 128 columns [ceil(k / 128), m] (quantize_fp8_groups's)."""
        name, grid, split = _gemv_geometry("gemv_fp8_block_" + ("f32" if out_fp32 else "bf16"), m, n, k,
                                           self.num_sms, fp8=True)
        self.launch(name, grid, GEMV_WARPS * 32, out, x, w, w_scale, x_scale, m, n, k, split, int(accumulate))

    @kernel("fp8", FP8_GATED_ARGS, "gemv_swiglu_fp8", "gemv_swiglu_fp8_pipelined")
    def gemv_swiglu_fp8(self, out: int, x: int, w: int, w_scale: int, x_scale: int, m: int, n: int, k: int) -> None:
        """gemv_swiglu with e4m3 weights (gemv_fp8's x and scales)."""
        self._gemv_gated_fp8("gemv_swiglu_fp8", out, x, w, w_scale, x_scale, m, n, k)

    @kernel("fp8", FP8_GATED_ARGS, "gemv_geglu_fp8", "gemv_geglu_fp8_pipelined")
    def gemv_geglu_fp8(self, out: int, x: int, w: int, w_scale: int, x_scale: int, m: int, n: int, k: int) -> None:
        """gemv_geglu with e4m3 weights."""
        self._gemv_gated_fp8("gemv_geglu_fp8", out, x, w, w_scale, x_scale, m, n, k)

    def _gemv_gated_fp8(self, kernel_name: str, out: int, x: int, w: int, w_scale: int, x_scale: int, m: int, n: int,
                        k: int) -> None:
        _require(n % GEMV_TILE_ROWS == 0, f"{kernel_name}: n = {n} rows are not whole groups of 8 gate and 8 up rows")
        name, grid, split = _gemv_geometry(kernel_name, m, n, k, self.num_sms, fp8=True)
        self.launch(name, grid, GEMV_WARPS * 32, out, x, w, w_scale, x_scale, m, n, k, split)

    # ---- mixture of experts (cuda/moe.cu) -------------------------------------------------------------------------

    @kernel("moe", "float* topk_weights, int* topk_ids, const float* logits, int num_experts, int top_k, "
                   "int renormalize")
    def moe_topk_softmax(self, topk_weights: int, topk_ids: int, logits: int, num_tokens: int, num_experts: int,
                         top_k: int, renormalize: bool) -> None:
        """Each token's top_k experts by softmax probability (int32 ids, float32 weights [num_tokens, top_k]) from
        float32 router logits [num_tokens, num_experts]; renormalize: the weights over the chosen sum to 1."""
        _require(1 <= top_k <= num_experts <= MOE_MAX_EXPERTS,
                 f"moe_topk_softmax: top_k {top_k} of {num_experts} experts (at most {MOE_MAX_EXPERTS})")
        self.launch("moe_topk_softmax", (num_tokens,), MOE_TOPK_THREADS, topk_weights, topk_ids, logits, num_experts,
                    top_k, int(renormalize))

    @kernel("moe", "int* sorted_ids, int* expert_ids, int* num_post_padded, const int* topk_ids, int num_assignments, "
                   "int num_experts, int block_m")
    def moe_align(self, sorted_ids: int, expert_ids: int, num_post_padded: int, topk_ids: int, num_assignments: int,
                  num_experts: int, block_m: int) -> None:
        """The assignments of topk_ids (int32 [num_assignments], token-major) grouped by expert, stably, each run
        padded to block_m with the sentinel num_assignments: sorted_ids [moe_max_tiles * block_m], expert_ids
        [moe_max_tiles], num_post_padded [1]."""
        _require(1 <= num_experts <= MOE_MAX_EXPERTS, f"moe_align: {num_experts} experts (at most {MOE_MAX_EXPERTS})")
        _require(block_m >= 1 and num_assignments >= 1, f"moe_align: block_m {block_m}, {num_assignments} assignments")
        self.launch("moe_align", (num_experts,), MOE_ALIGN_THREADS, sorted_ids, expert_ids, num_post_padded,
                    topk_ids, num_assignments, num_experts, block_m)

    def _moe_expert_launch(self, gate_up: bool, rows: int, k: int, num_tokens: int, top_k: int, num_experts: int,
                           fp8: bool, *args) -> None:
        """Launch the gate/up or down kernel moe_block_m chose, over `rows` units (gate/up) or output columns (down)
        and k, its grid sized for the batch's most tiles: moe_gemv_* (weight tiles of 8 units or 16 columns, `split`
        warps each, MOE_GEMV_WARPS a block) or moe_gemm_*_<block_m> (MOE_GEMM_TILE_N B rows a block); fp8: their
        moe_*_fp8_* forms."""
        block_m = moe_block_m(num_tokens, top_k, num_experts)
        tiles, which = moe_max_tiles(num_tokens * top_k, num_experts, block_m), "gate_up" if gate_up else "down"
        form = "fp8_" if fp8 else ""
        if block_m == MOE_GEMV_TILE:
            split = moe_gemv_split(k, fp8)
            weight_tiles = -(-rows // (8 if gate_up else 16))
            self.launch(f"moe_gemv_{form}{which}", (tiles, -(-weight_tiles // (MOE_GEMV_WARPS // split))),
                        MOE_GEMV_WARPS * 32, *args, split)
        else:
            columns = MOE_GEMM_TILE_N // 2 if gate_up else MOE_GEMM_TILE_N
            self.launch(f"moe_gemm_{form}{which}_{block_m}", (tiles, -(-rows // columns)),
                        MOE_GEMM_WARPS[block_m] * 32, *args)

    @staticmethod
    def _moe_widths(name: str, fp8: bool, hidden: int, inter: int) -> None:
        _require_vectors(name, hidden=hidden, inter=inter)
        _require(not fp8 or (hidden % FP8_VECTOR == 0 and inter % FP8_VECTOR == 0),
                 f"{name}: e4m3 experts need hidden and inter multiples of {FP8_VECTOR}, not {hidden} and {inter}")

    @kernel("moe", MOE_GATE_UP_ARGS + ", int split", "moe_gemv_gate_up")
    @kernel("moe", MOE_GATE_UP_ARGS, *(f"moe_gemm_gate_up_{m}" for m in MOE_GEMM_BLOCK_MS),
            shared=moe_gemm_shared_bytes)
    @kernel("moe", MOE_GATE_UP_FP8_ARGS + ", int split", "moe_gemv_fp8_gate_up")
    @kernel("moe", MOE_GATE_UP_FP8_ARGS, *(f"moe_gemm_fp8_gate_up_{m}" for m in MOE_GEMM_BLOCK_MS),
            shared=moe_gemm_shared_bytes)
    def moe_gate_up(self, act: int, x: int, w: int, sorted_ids: int, expert_ids: int, num_post_padded: int,
                    num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                    scales: tuple[int, int] | None = None) -> None:
        """act [padded rows, inter] bf16 = SwiGLU(x row of each padded row's token . its expert's gate/up rows), w
        experts_gate_up [num_experts, 2 * inter, hidden] (gate rows, then up): the GEMV kernel or the grouped GEMM,
        as moe_block_m chose for moe_align. scales (w_scale, x_scale): w is e4m3 with float32 scales [num_experts *
        2 * inter] and x the f16 values of e4m3 codes [num_tokens, hidden] with scales [num_tokens]
        (quantize_fp8_values); None: both bf16."""
        self._moe_widths("moe_gate_up", scales is not None, hidden, inter)
        self._moe_expert_launch(True, inter, hidden, num_tokens, top_k, num_experts, scales is not None, act, x, w,
                                *(scales or ()), sorted_ids, expert_ids, num_post_padded, top_k, num_tokens * top_k,
                                hidden, inter)

    @kernel("moe", MOE_DOWN_ARGS + ", int split", "moe_gemv_down")
    @kernel("moe", MOE_DOWN_ARGS, *(f"moe_gemm_down_{m}" for m in MOE_GEMM_BLOCK_MS), shared=moe_gemm_shared_bytes)
    @kernel("moe", MOE_DOWN_FP8_ARGS + ", int split", "moe_gemv_fp8_down")
    @kernel("moe", MOE_DOWN_FP8_ARGS, *(f"moe_gemm_fp8_down_{m}" for m in MOE_GEMM_BLOCK_MS),
            shared=moe_gemm_shared_bytes)
    def moe_down(self, out: int, act: int, w: int, sorted_ids: int, expert_ids: int, num_post_padded: int,
                 topk_weights: int, num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                 scales: tuple[int, int] | None = None) -> None:
        """out [num_tokens * top_k, hidden] float32: each assignment's act row . its expert's down rows (w
        experts_down [num_experts, hidden, inter]) times its routing weight (float32 [num_tokens * top_k]).
        scales (w_scale, act_scale): w is e4m3 with float32 scales [num_experts * hidden] and act the f16 values of
        e4m3 codes [padded rows, inter] with a scale per padded row; None: both bf16."""
        self._moe_widths("moe_down", scales is not None, hidden, inter)
        self._moe_expert_launch(False, hidden, inter, num_tokens, top_k, num_experts, scales is not None, out, act,
                                w, *(scales or ()), sorted_ids, expert_ids, num_post_padded, topk_weights,
                                num_tokens * top_k, hidden, inter)

    @kernel("moe", "float* x, const float* rows, int top_k, int hidden")
    def moe_sum(self, x: int, rows: int, num_tokens: int, top_k: int, hidden: int) -> None:
        """x [num_tokens, hidden] float32 += the sum of each token's top_k rows [num_tokens * top_k, hidden], in
        slot order."""
        _require(hidden % 4 == 0, f"moe_sum: hidden {hidden} is not a multiple of 4")
        self.launch("moe_sum", (num_tokens, -(-hidden // (4 * MOE_SUM_THREADS))), MOE_SUM_THREADS, x, rows, top_k,
                    hidden)
