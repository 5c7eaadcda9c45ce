"""Linear layers: our GEMV kernel (cuda/gemv.cu) for a few rows, cuBLAS for more. With the GEMV the gate/up
projection ends in its activation, SwiGLU or GeGLU (gemv_swiglu, gemv_geglu); after cuBLAS, the activation is a
kernel of its own (silu_and_mul, gelu_tanh_and_mul).

At decode batch 1..8 a GEMM is one pass over the weights, and cuBLAS reaches only about half of the memory
bandwidth there; gemv.cu is built to stream the weights at the copy rate. Both paths compute the same thing
(bf16 inputs, float32 accumulation) and launch without allocating or synchronizing, so either can be captured in
a CUDA graph.

FP8 weights (e4m3 codes with a float32 scale per output channel, W8A8), the input quantized to e4m3 per token: for
a few rows our FP8 GEMV (gemv_fp8, gemv_swiglu_fp8, gemv_geglu_fp8) on the input already quantized (x_codes: the
f16 values of its e4m3 codes with their scales, written by the kernel that wrote x, rms_norm; else
quantize_fp8_values first), ending in the scales (and the activation); else cuBLASLt's FP8 GEMM on x's e4m3
codes (x_codes: written by the kernel that wrote x, rms_norm or the gate/up projection's activation, into
input_codes' buffer; else quantize_fp8 first), applying the token and channel scales itself (its outer-vector
scales, cublas.py gemm_scaled), or where it cannot, into float32 with unit scales and scale_rows_cols after it
(cuda/fp8.cu); then the activation as its kernel on the bf16 gate/up product, quantized to e4m3 as it is written
(silu_and_mul_e4m3: the down projection's codes).

An FP8 checkpoint's block-scaled codes (a scale per 128 x 128 block, as stored; WeightUploader._runs_block_scales):
the input quantized per row and 128 columns by the product itself (quantize_fp8_groups: no producer writes those
codes), then for up to 8 rows gemv_fp8_block, which scales each 64-column step of a row's sum by its block's and
its group's scales, and beyond them cuBLASLt's block-scaled GEMM (cublas.py gemm_scaled) on the rows in whole
fours, the GEMV on the 1-3 left. Their gate/up rows are not interleaved (the blocks' rows must stay together), so
the activation is always its kernel after the product, reading gate columns then up columns.

Batch-invariant (invariant=True): every product takes cuBLAS with its one split-free algorithm per shape
(cublas.py), or for up to 8 rows of the shapes in chain_shapes our gemv_chain (cuda/gemv_chain.cu), which adds a
row's products in that algorithm's order (one mma chain over k); never the GEMV, whose order differs: a row's
product is then the same in a batch of 1 and of 500.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.backends.cuda.cublas import SCALE_BLOCK, Cublas, scale_kind
from tinyvllm.backends.cuda.ops import FP8_VECTOR, GEMV_MAX_ROWS, GEMV_TILE_ROWS, MMA_K, VECTOR, Ops, fp8_gemv_fits
from tinyvllm.backends.cuda.tensors import BF16, E4M3, F16, F32, DeviceTensor, matmul_shape

# Measured on the H200 (docs/PERFORMANCE.md). Alone (bench/gemv.py) the kernel beats cuBLAS by 15-25% on weights of
# a few MB (Llama-3.2-1B's QKV and O) and ties at 16-32 MB (its MLP). In a decode step it also starts streaming its
# weights while the kernel before it ends (programmatic dependent launch), which cuBLAS's kernels do not: with the
# MLP's GEMMs on it too, W3 went from 1.16 to 1.11 ms per token; the 128k x 2048 LM head stays on cuBLAS (equal).
GEMV_MAX_WEIGHTS = 64 << 20  # n * k up to which the kernel runs
# ModelConfig.activation -> the Ops launchers of its gated MLP: (the GEMV with it as epilogue, the kernel after cuBLAS)
GATED_ACTIVATIONS = {"silu": ("gemv_swiglu", "silu_and_mul"), "gelu_pytorch_tanh": ("gemv_geglu", "gelu_tanh_and_mul")}
# ModelConfig.activation -> the FP8 GEMV with it as epilogue (e4m3 weights)
GATED_FP8_GEMVS = {"silu": "gemv_swiglu_fp8", "gelu_pytorch_tanh": "gemv_geglu_fp8"}


@dataclass(frozen=True)
class Fp8Scratch:
    """The buffers an FP8 linear layer goes through: its input's e4m3 codes (or, for the GEMV, their f16 values) and
    their scales, and the float32
    product of the cuBLASLt path before the scales where cuBLASLt cannot apply them itself (run in pieces of as
    many rows as it holds: that path is the fallback of an older cuBLASLt, and a buffer for every row of the widest
    layer would be ~1 GB at Llama-3.1-8B's 8,192 tokens)."""

    codes: DeviceTensor  # e4m3 [t, >= every layer input's width]
    scales: DeviceTensor  # f32 [t]: one per token
    acc: DeviceTensor  # f32 [r, >= every layer output's width], r <= t rows
    values: DeviceTensor | None = None  # f16 [GEMV_MAX_ROWS, >= every input's width]: the GEMV's x, where not given
    # f32 [>= t * ceil(widest input / 128)]: block-scaled weights' inputs' scales a row and 128 columns
    group_scales: DeviceTensor | None = None


class Linear:
    """out[:m] = x[:m] . w^T, row-major, w [n, k]: the kernel chosen by the weight's dtype (bf16: our GEMV for a few
    rows, else cuBLAS; e4m3: the same through fp8 (scratch: its buffers)), with the launchers of `ops` (the
    device's, on the stream `blas` runs on)."""

    def __init__(self, blas: Cublas, ops: Ops, max_gemv_weights: int = GEMV_MAX_WEIGHTS,
                 fp8: Fp8Scratch | None = None, invariant: bool = False,
                 chain_shapes: set[tuple[int, int]] | None = None,
                 chain8_shapes: set[tuple[int, int]] | None = None) -> None:
        """invariant: batch-invariant (the module's docstring); blas then pins its algorithms too. chain_shapes:
        the (n, k) whose products of up to 8 rows run as gemv_chain when invariant (CudaForward checks each shape
        first); None: every shape. chain8_shapes: those of them whose ungated products run it in 8-row tiles."""
        if invariant and not getattr(blas, "invariant", False):
            raise ValueError("a batch-invariant linear layer needs a batch-invariant cuBLAS handle")
        self.blas = blas
        self.invariant = invariant
        self.chain_shapes = chain_shapes
        self.chain8_shapes = chain8_shapes or set()
        self.ops = ops
        self.max_gemv_weights = max_gemv_weights
        self.fp8 = fp8

    def uses_gemv(self, m: int, n: int, k: int) -> bool:
        return (not self.invariant and 0 < m <= GEMV_MAX_ROWS and 0 < n * k <= self.max_gemv_weights
                and k % VECTOR == 0)

    def uses_chain_gemv(self, m: int, n: int, k: int) -> bool:
        """Batch-invariant: m rows of a bf16 product with w [n, k] run as gemv_chain."""
        return (self.invariant and 0 < m <= GEMV_MAX_ROWS and k % MMA_K == 0
                and (self.chain_shapes is None or (n, k) in self.chain_shapes))

    def _check(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int,
               accumulate: bool = False) -> tuple[int, int]:
        if w.dtype == E4M3:
            return self._check_fp8(out, x, w, m, accumulate)
        if w.dtype != BF16:
            raise ValueError(f"linear layers with {w.dtype} weights are not supported on the cuda backend (bf16 or "
                             "e4m3 with scales)")
        if x.dtype != BF16 or out.dtype not in (BF16, F32):
            raise ValueError(f"a bf16 linear layer takes bf16 inputs into bf16 or f32 outputs, not {x.dtype} into "
                             f"{out.dtype}")
        return matmul_shape(out, x, w, m)

    def gemm(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int, accumulate: bool = False,
             x_codes: DeviceTensor | None = None) -> None:
        """float32 accumulation; out bf16 or float32 (its dtype), out += x . w^T when accumulate. x_codes: x quantized
        by the kernel that wrote it, with f32 scales [>= m], which an e4m3 w's product reads instead of quantizing x:
        for the FP8 GEMV the f16 values of its e4m3 codes [>= m, k], else the e4m3 codes (input_codes' buffer)."""
        n, k = self._check(out, x, w, m, accumulate)
        if w.dtype == E4M3:
            self._gemm_fp8(out, x, w, m, n, k, accumulate, x_codes)
        elif self.uses_gemv(m, n, k):
            self.ops.gemv(out.ptr, x.ptr, w.ptr, m, n, k, out.dtype == F32, accumulate)
        elif self.uses_chain_gemv(m, n, k):
            self.ops.gemv_chain(out.ptr, x.ptr, w.ptr, m, n, k, out.dtype == F32, accumulate,
                                tile_rows=8 if (n, k) in self.chain8_shapes else GEMV_TILE_ROWS)
        else:
            self.blas.gemm(out, x, w, m, accumulate=accumulate)

    def _check_fp8(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int,
                   accumulate: bool) -> tuple[int, int]:
        s, kind = self.fp8, scale_kind(w)
        if s is None:
            raise ValueError("an e4m3 linear layer needs the fp8 scratch buffers")
        groups = m * -(-w.shape[1] // SCALE_BLOCK)  # a block-scaled input's scales
        if kind == "block" and (s.group_scales is None or groups > s.group_scales.numel):
            raise ValueError(f"a block-scaled e4m3 product of {m} rows of {w.shape[1]}: no room for its input's "
                             "group scales in the fp8 scratch")
        if x.dtype != BF16 or out.dtype not in (BF16, F32):
            raise ValueError(f"an e4m3 linear layer takes bf16 inputs into bf16 or f32 outputs, not {x.dtype} into "
                             f"{out.dtype}")
        n, k = matmul_shape(out, x, w, m)
        acc = 0 if _lands_in_place(out, accumulate) else n  # the scratch accumulator holds a row at least
        if k % FP8_VECTOR or n % VECTOR or m * k > s.codes.numel or acc > s.acc.numel or m > s.scales.numel:
            raise ValueError(f"an e4m3 product of {m} rows, n {n}, k {k}: k must be a multiple of {FP8_VECTOR}, n of "
                             f"{VECTOR}, and the fp8 scratch buffers hold it")
        return n, k

    def uses_fp8_gemv(self, m: int, k: int) -> bool:
        """Whether an e4m3 product of m rows runs as our FP8 GEMV (any weight size: it streams half the bytes of
        bf16, where cuBLASLt's FP8 GEMM is slower than its bf16 one)."""
        return not self.invariant and fp8_gemv_fits(m, k)

    def input_codes(self, m: int, k: int) -> DeviceTensor | None:
        """Where the producer of an m-row FP8 GEMM input of width k writes its e4m3 codes and scales (the scratch
        codes; consumed by the next FP8 product, which then quantizes nothing), or None where the product is the
        FP8 GEMV (its x is f16 code values: the forward's own buffer) or the layers are not FP8."""
        s = self.fp8
        if s is None or self.uses_fp8_gemv(m, k) or m * k > s.codes.numel or m > s.scales.numel:
            return None
        return DeviceTensor(s.codes.ptr, E4M3, (m, k), DeviceTensor(s.scales.ptr, F32, (m,)))

    def quantized_input(self, w: DeviceTensor, m: int) -> DeviceTensor | None:
        """Where the kernel that produces the m-row input of the product with w may write it quantized, for a
        per-channel or per-tensor e4m3 w: the fp8 scratch's f16 values for the FP8 GEMV, its e4m3 codes for
        cuBLASLt (with their scales), as `x_codes` of gemm(); None where the product quantizes its input itself
        (bf16 or block-scaled w) or the scratch cannot hold it."""
        s, k = self.fp8, w.shape[-1]
        if w.dtype != E4M3 or s is None or scale_kind(w) == "block":
            return None
        return self._scratch_values(m, k) if self.uses_fp8_gemv(m, k) else self.input_codes(m, k)

    def _scratch_values(self, m: int, k: int) -> DeviceTensor | None:
        """The fp8 scratch's f16 values and scales as an m-row FP8 GEMV input of width k, or None if it lacks room."""
        s = self.fp8
        if s.values is None or s.values.rows < m or s.values.shape[-1] < k:
            return None
        return DeviceTensor(s.values.ptr, F16, (m, k), DeviceTensor(s.scales.ptr, F32, (m,)))

    def _gemm_codes(self, x: DeviceTensor, m: int, k: int, x_codes: DeviceTensor | None) -> DeviceTensor:
        """The FP8 GEMM's e4m3 input: x_codes, else x quantized per token into the scratch codes."""
        if x_codes is None:
            s = self.fp8
            self.ops.quantize_fp8(s.codes.ptr, s.scales.ptr, x.ptr, m, k)
            return DeviceTensor(s.codes.ptr, E4M3, (m, k), DeviceTensor(s.scales.ptr, F32, (m,)))
        if (x_codes.dtype != E4M3 or x_codes.rows < m or x_codes.shape[-1] != k or x_codes.scale is None
                or x_codes.scale.numel < m):
            raise ValueError(f"x_codes of an FP8 GEMM of {m} rows of {k}: {x_codes.dtype} {x_codes.shape}")
        return DeviceTensor(x_codes.ptr, E4M3, (m, k), x_codes.scale)

    def _gemv_input(self, x: DeviceTensor, m: int, k: int, x_codes: DeviceTensor | None) -> DeviceTensor:
        """The FP8 GEMV's x: x_codes, else x quantized into the scratch values and scales."""
        if x_codes is None:
            values = self._scratch_values(m, k)
            if values is None:
                raise ValueError(f"an FP8 GEMV of {m} rows of {k}: the fp8 scratch has no values buffer for it")
            self.ops.quantize_fp8_values(values.ptr, values.scale.ptr, x.ptr, m, k)
            return values
        if (x_codes.dtype != F16 or x_codes.rows < m or x_codes.shape[-1] != k or x_codes.scale is None
                or x_codes.scale.numel < m):
            raise ValueError(f"x_codes of an FP8 GEMV of {m} rows of {k}: {x_codes.dtype} {x_codes.shape}")
        return x_codes

    def _gemm_fp8(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int, n: int, k: int,
                  accumulate: bool, x_codes: DeviceTensor | None = None) -> None:
        """Our FP8 GEMV on x quantized (_gemv_input), or cuBLASLt and the scales on x's e4m3 codes (_gemm_codes);
        block-scaled weights: _gemm_fp8_blocks."""
        if scale_kind(w) == "block":
            self._gemm_fp8_blocks(out, x, w, m, n, k, accumulate)
            return
        if self.uses_fp8_gemv(m, k):
            xq = self._gemv_input(x, m, k, x_codes)
            self.ops.gemv_fp8(out.ptr, xq.ptr, w.ptr, w.scale.ptr, xq.scale.ptr, m, n, k, out.dtype == F32,
                              accumulate)
            return
        s = self.fp8
        codes = self._gemm_codes(x, m, k, x_codes)
        if self.blas.gemm_scaled(out, codes, w, m, accumulate):  # cuBLASLt applies the scales itself
            return
        if _lands_in_place(out, accumulate):
            self.blas.gemm(out, DeviceTensor(codes.ptr, E4M3, (m, k)), w, m)
            self.ops.scale_rows_cols(out.ptr, out.ptr, codes.scale.ptr, w.scale.ptr, m, n, True, False)
            return
        step = s.acc.numel // n  # rows the accumulator holds: pieces of that many (its size: Fp8Scratch)
        for r0 in range(0, m, step):
            rows = min(step, m - r0)
            acc = DeviceTensor(s.acc.ptr, F32, (rows, n))
            self.blas.gemm(acc, DeviceTensor(codes.row(r0), E4M3, (rows, k)), w, rows)
            self.ops.scale_rows_cols(out.row(r0), acc.ptr, codes.scale.ptr + 4 * r0, w.scale.ptr, rows, n,
                                     out.dtype == F32, accumulate)

    def _gemm_fp8_blocks(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int, n: int, k: int,
                         accumulate: bool) -> None:
        """An FP8 checkpoint's block-scaled weight (a scale per 128 x 128 block): x quantized per row and 128
        columns (quantize_fp8_groups), then cuBLASLt's block-scaled GEMM on the rows in whole fours (its algorithms
        take no other count) and our gemv_fp8_block on the rest, or on all of them where the GEMV runs."""
        s = self.fp8
        head = 0 if self.uses_fp8_gemv(m, k) else m - m % 4
        if head:
            groups = DeviceTensor(s.group_scales.ptr, F32, (-(-k // SCALE_BLOCK) * head,))
            self.ops.quantize_fp8_groups(s.codes.ptr, groups.ptr, x.ptr, head, k, values=False)
            if not self.blas.gemm_scaled(out, DeviceTensor(s.codes.ptr, E4M3, (head, k), groups), w, head,
                                         accumulate):
                raise RuntimeError(f"cuBLASLt has no block-scaled FP8 algorithm for {head} rows, n {n}, k {k}")
        if head < m:
            rows = m - head
            if s.values is None or s.values.rows < rows or s.values.shape[-1] < k:
                raise ValueError(f"an FP8 GEMV of {rows} rows of {k}: the fp8 scratch has no values buffer for it")
            self.ops.quantize_fp8_groups(s.values.ptr, s.group_scales.ptr, x.row(head), rows, k, values=True)
            self.ops.gemv_fp8_block(out.row(head), s.values.ptr, w.ptr, w.scale.ptr, s.group_scales.ptr, rows, n, k,
                                    out.dtype == F32, accumulate)

    def gate_up_swiglu(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int,
                       gate_up: DeviceTensor, activation: str = "silu", x_codes: DeviceTensor | None = None,
                       down_e4m3: bool = False) -> DeviceTensor | None:
        """bf16 out[:m, n / 2] = SwiGLU(x . w^T) (activation "silu"; "gelu_pytorch_tanh": GeGLU), w [n, k] the gate/up
        projection with its rows interleaved in groups of 8 (8 gate, then the same units' 8 up; a block-scaled e4m3
        w's are not: all gate rows, then all up rows, so that its 128-row blocks stay whole); gate_up: a bf16
        [>= m, n] buffer that the cuBLAS path goes through; x_codes: gemm's. An e4m3 w through cuBLASLt where the
        down projection is e4m3 too (down_e4m3): the activation is written quantized instead, as that projection's
        input (input_codes' buffer), and returned, for gemm's x_codes (out is not written); else None."""
        n, k = self._check(gate_up, x, w, m)
        if out.dtype != BF16 or out.shape[-1] != n // 2 or out.rows < m:
            raise ValueError(f"gate_up_swiglu of {m} rows and {n} gate/up units: out {out.dtype} {out.shape}")
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"the cuda backend has no gated MLP with the {activation!r} activation")
        gemv_name, kernel_name = GATED_ACTIVATIONS[activation]
        if w.dtype == E4M3 and scale_kind(w) == "block":  # its rows not interleaved: all gates, then all ups
            self._gemm_fp8_blocks(gate_up, x, w, m, n, k, False)
            getattr(self.ops, kernel_name)(out.ptr, gate_up.ptr, m, n // 2, n // 2)
        elif w.dtype == E4M3 and self.uses_fp8_gemv(m, k):
            xq = self._gemv_input(x, m, k, x_codes)
            getattr(self.ops, GATED_FP8_GEMVS[activation])(out.ptr, xq.ptr, w.ptr, w.scale.ptr, xq.scale.ptr, m, n, k)
        elif w.dtype == E4M3:
            self._gemm_fp8(gate_up, x, w, m, n, k, False, x_codes)
            down_codes = self.input_codes(m, n // 2) if down_e4m3 else None
            if down_codes is not None:
                self.ops.gated_e4m3(kernel_name, down_codes.ptr, down_codes.scale.ptr, gate_up.ptr, m, n // 2)
                return down_codes
            getattr(self.ops, kernel_name)(out.ptr, gate_up.ptr, m, n // 2)
        elif self.uses_gemv(m, n, k):
            getattr(self.ops, gemv_name)(out.ptr, x.ptr, w.ptr, m, n, k)
        elif self.uses_chain_gemv(m, n, k):
            self.ops.gemv_chain_gated(gemv_name.removeprefix("gemv_"), out.ptr, x.ptr, w.ptr, m, n, k)
        else:
            self.blas.gemm(gate_up, x, w, m)
            getattr(self.ops, kernel_name)(out.ptr, gate_up.ptr, m, n // 2)
        return None


def _lands_in_place(out: DeviceTensor, accumulate: bool) -> bool:
    """Whether cuBLASLt's FP8 product can be written into out itself and scaled there (float32, adding to nothing:
    the LM head's logits, whose [rows, vocabulary] the scratch accumulator is not sized for)."""
    return out.dtype == F32 and not accumulate
