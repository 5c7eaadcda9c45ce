"""A ctypes binding of the few cuBLASLt calls tinyvllm needs (scikit-cuda style): every status checked by name.

All our matrices are row-major; cuBLAS is column-major. A row-major [m, n] matrix is the column-major [n, m] one,
so the row-major product Y[m, n] = X[m, k] . W[n, k]^T is computed as the column-major Y^T = W^T(op T) . X^T:
A = W ([k, n], ld k, transposed), B = X ([k, m], ld k), C = D = Y ([n, m], ld n). "TN" is cuBLAS's fastest layout.

Why cuBLASLt and not cublasGemmEx: GemmEx runs its algorithm heuristics at the first call of every new shape,
2-4 ms of host time each on the H200 (measured 2026-12-01). A prefill step's row count is new almost every step, and
so is each decode bucket's at its capture. Here the heuristics run once per (n, k, output type) and class of row
counts (`m_class`), and every m of the class reuses that algorithm; row counts named exact (the decode buckets, a
fixed set whose GEMMs are captured once) get their own, since a class's algorithm can be slower for them.

FP8 (W8A8) with the per-token and per-channel scales applied by cuBLASLt itself (`gemm_scaled`): its outer-vector
scale mode (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, A's scales one per output column, B's one per row),
writing bf16 or float32 and adding to the output in the same pass. Where the library or GPU has no algorithm for
it (older cuBLASLt), gemm_scaled says so and the caller runs the unit-scale GEMM into float32 and applies the scales
after it (cuda/fp8.cu scale_rows_cols).

Batch-invariant (EngineConfig.batch_invariant): every m of an (n, k, output type) runs the one algorithm the
heuristics give at INVARIANT_ROWS rows, pinned to a split-free K walk (SPLITK_NUM 1, no reduction scheme): one CTA
owns each output element and walks the whole of k, one tensor-core product of 16 after another into one
accumulator, so a row's result is the same whatever the other rows and however many. The heuristics would otherwise
pick per row count, and on small m they cut k into parts summed afterwards, a different order of additions for the
same row. Other split-free algorithms mostly add in the same order, but not all (bench/gemm_order.py; the
heuristics' own choice per row count broke a row's bits at n = 1000, k = 4096), so one algorithm serves every m.
For up to 8 rows linear.py may run gemv_chain instead, our GEMV in that walk's order, on the shapes where
CudaForward found it to give the algorithm's bits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

from tinyvllm.backends.cuda.tensors import BF16, E4M3, F32, DeviceTensor, matmul_shape

CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 14, 28
# device dtype -> cudaDataType, for the dtypes the GEMMs take
CUDA_TYPES = {BF16: CUDA_R_16BF, F32: CUDA_R_32F, E4M3: CUDA_R_8F_E4M3}
# weight (A) dtype -> the outputs a GEMM of it writes; the inputs (B) are of the weights' dtype. An e4m3 GEMM runs
# with unit scales into float32 (its per-row and per-column scales are applied after it: cuda/fp8.cu).
OUTPUT_DTYPES = {BF16: (BF16, F32), E4M3: (F32,)}
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB = 3, 4
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK = 1, 3
CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME = 2, 3
CUBLASLT_REDUCTION_SCHEME_NONE = 0
CUBLAS_STATUS_INVALID_VALUE, CUBLAS_STATUS_NOT_SUPPORTED = 7, 15
CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 17, 18
CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE = 31, 32
CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F = 3
CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F = 4, 5
# gemm_scaled's scale modes, by how the weights are scaled: (A's mode (the weights), B's (the input rows))
SCALE_MODES = {"channel": (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F),
               "block": (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F)}
SCALE_BLOCK = 128  # the block scale modes' 128 x 128 weight blocks and 128-column input groups
WORKSPACE_BYTES = 32 << 20  # the workspace a handle is given, fixed so that captured GEMMs never allocate
SCALE_PLACEHOLDER = 1 << 16  # the scale pointers' value while the heuristics are asked (where no workspace is given)
STATUS_NAMES = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
                7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
                13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
                15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR"}
EXACT_ROWS = 16  # row counts up to this are their own class
TUNE_CANDIDATES = 8  # tune(): the heuristics' first algorithms it times
TUNE_RUNS = 3  # tune(): timed runs of each (after one untimed)
# batch-invariant: the row count whose split-free algorithm every m runs (bench/batch_invariant.py measures the
# choice: large tiles suit W1's 512-row steps, small ones batch 1)
INVARIANT_ROWS = 256


def _load_library() -> ctypes.CDLL:
    names = ["libcublasLt.so.13", "libcublasLt.so.12", ctypes.util.find_library("cublasLt")]
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("cuBLASLt not found (tried libcublasLt.so.13, libcublasLt.so.12): install the CUDA toolkit "
                       "or put its lib64 directory on LD_LIBRARY_PATH")


class _Algo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: opaque."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_p, _i, _f, _u64, _i64, _size = (ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_uint64, ctypes.c_int64,
                                 ctypes.c_size_t)
_pp = ctypes.POINTER(_p)
_SIGNATURES = {
    "cublasLtCreate": [_pp],
    "cublasLtDestroy": [_p],
    "cublasLtMatmulDescCreate": [_pp, _i, _i],
    "cublasLtMatmulDescSetAttribute": [_p, _i, _p, _size],
    "cublasLtMatmulDescDestroy": [_p],
    "cublasLtMatrixLayoutCreate": [_pp, _i, _u64, _u64, _i64],
    "cublasLtMatrixLayoutDestroy": [_p],
    "cublasLtMatmulPreferenceCreate": [_pp],
    "cublasLtMatmulPreferenceSetAttribute": [_p, _i, _p, _size],
    "cublasLtMatmulPreferenceDestroy": [_p],
    "cublasLtMatmulAlgoGetHeuristic": [_p, _p, _p, _p, _p, _p, _p, _i, ctypes.POINTER(_HeuristicResult),
                                       ctypes.POINTER(_i)],
    "cublasLtMatmul": [_p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, ctypes.POINTER(_Algo), _p, _size, _p],
    "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(_Algo), _i, _p, _size],
    "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), _i, _p, _size, ctypes.POINTER(_size)],
    "cublasLtMatmulAlgoCheck": [_p, _p, _p, _p, _p, _p, ctypes.POINTER(_Algo), ctypes.POINTER(_HeuristicResult)],
}


@functools.cache
def _lib() -> ctypes.CDLL:
    """cuBLASLt, loaded at the first handle (importing this module needs no CUDA)."""
    lib = _load_library()
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = _i
    return lib


GemmTypes = tuple[int, int, int]  # the cudaDataTypes of A (the weights), B (the input rows), C (the output rows)
BF16_GEMM = (CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF)
BF16_GEMM_F32_OUT = (CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F)
FP8_GEMM = (CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_32F)


def gemm_types(out: DeviceTensor, x: DeviceTensor, w: DeviceTensor) -> GemmTypes:
    """The cudaDataTypes of out = x . w^T from the tensors' dtypes; ValueError for a pair cuBLAS is not set up for
    here."""
    if w.dtype not in OUTPUT_DTYPES or x.dtype != w.dtype:
        raise ValueError(f"cuBLAS GEMM of {w.dtype} weights and {x.dtype} inputs is not supported (bf16 or e4m3 "
                         "both)")
    if out.dtype not in OUTPUT_DTYPES[w.dtype]:
        raise ValueError(f"cuBLAS GEMM of {w.dtype} weights into a {out.dtype} output is not supported "
                         f"({' or '.join(OUTPUT_DTYPES[w.dtype])})")
    return CUDA_TYPES[w.dtype], CUDA_TYPES[x.dtype], CUDA_TYPES[out.dtype]


def block_scale_stride(k: int) -> int:
    """The row stride of a weight's 128 x 128 block scales as cuBLASLt reads them: its ceil(k / 128) blocks of
    columns rounded up to a multiple of 4 (measured on an H100: unpadded, k = 640's five and k = 256's two gave
    wrong products; bench/results/2026-12-07-h100-fp8-block-scales.txt)."""
    blocks = -(-k // SCALE_BLOCK)
    return -(-blocks // 4) * 4


def scale_kind(w: DeviceTensor) -> str:
    """How an e4m3 weight [n, k] is scaled (SCALE_MODES): "channel", a scale per row ([n]), or "block", per 128 x
    128 block ([ceil(n / 128), block_scale_stride(k)], the padding unread)."""
    n, k = w.shape
    if w.scale is not None and w.scale.shape == (n,):
        return "channel"
    if w.scale is not None and w.scale.shape == (-(-n // SCALE_BLOCK), block_scale_stride(k)):
        return "block"
    raise ValueError(f"an e4m3 weight {w.shape} needs a scale per row or per {SCALE_BLOCK} x {SCALE_BLOCK} block, "
                     f"not {None if w.scale is None else w.scale.shape}")


def _set_desc(desc: _p, attribute: int, value: ctypes._SimpleCData) -> None:
    check(_lib().cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
          "cublasLtMatmulDescSetAttribute")


def _matmul_desc() -> _p:
    """A matmul descriptor: float32 compute and scale, A (the weights) transposed."""
    desc = _p()
    check(_lib().cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
          "cublasLtMatmulDescCreate")
    _set_desc(desc, CUBLASLT_MATMUL_DESC_TRANSA, _i(CUBLAS_OP_T))
    _set_desc(desc, CUBLASLT_MATMUL_DESC_TRANSB, _i(CUBLAS_OP_N))
    return desc


def check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: {STATUS_NAMES.get(status, f'cuBLAS status {status}')}")


def m_class(m: int) -> int:
    """The row count whose algorithm m uses: m itself up to EXACT_ROWS, else m rounded up to a multiple of a
    sixteenth of the power of two at or above it (eight classes per octave: at most 1/8 more rows than m)."""
    if m <= EXACT_ROWS:
        return m
    step = (1 << (m - 1).bit_length()) // 16
    return -(-m // step) * step


def pinned_split_free(algo: _Algo) -> _Algo:
    """A copy of the algorithm with its K walk in one piece (SPLITK_NUM 1, no reduction scheme)."""
    pinned = _Algo.from_buffer_copy(algo)
    for attribute, value in ((CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 1),
                             (CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, CUBLASLT_REDUCTION_SCHEME_NONE)):
        v = ctypes.c_uint32(value)
        check(_lib().cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(pinned), attribute, ctypes.byref(v),
                                                         ctypes.sizeof(v)), "cublasLtMatmulAlgoConfigSetAttribute")
    return pinned


def split_count(algo: _Algo) -> int:
    """The parts an algorithm cuts K into (its SPLITK_NUM)."""
    value, written = ctypes.c_uint32(), _size()
    check(_lib().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                     ctypes.byref(value), ctypes.sizeof(value), ctypes.byref(written)),
          "cublasLtMatmulAlgoConfigGetAttribute")
    return value.value


class Cublas:
    """cuBLASLt GEMMs on one stream with a fixed workspace (so that they can be captured in CUDA graphs)."""

    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int,
                 exact_rows: frozenset[int] = frozenset(), algos: dict | None = None, invariant: bool = False) -> None:
        """algos: another Cublas's algorithms (shared, tuned ones included), for a handle on another stream.
        invariant: every m of a shape runs one split-free algorithm (the module's docstring)."""
        self.exact_rows = exact_rows
        self.invariant = invariant
        self.handle = _p()
        check(_lib().cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.stream, self.workspace, self.workspace_bytes = _p(stream_handle), _p(workspace_ptr), workspace_bytes
        self.desc = _matmul_desc()  # float32 compute and scale, A transposed
        # FP8 with its scales (gemm_scaled), a descriptor a scale kind: made at its first use
        self.scaled_descs: dict[str, _p] = {}
        self.preference = _p()
        check(_lib().cublasLtMatmulPreferenceCreate(ctypes.byref(self.preference)), "cublasLtMatmulPreferenceCreate")
        limit = _u64(workspace_bytes)
        check(_lib().cublasLtMatmulPreferenceSetAttribute(self.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        ctypes.byref(limit), ctypes.sizeof(limit)),
              "cublasLtMatmulPreferenceSetAttribute")
        if invariant:  # only algorithms without a split-K reduction
            mask = ctypes.c_uint32(CUBLASLT_REDUCTION_SCHEME_NONE)
            check(_lib().cublasLtMatmulPreferenceSetAttribute(
                self.preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, ctypes.byref(mask), ctypes.sizeof(mask)),
                "cublasLtMatmulPreferenceSetAttribute")
        self._layouts: dict[tuple[int, int, int, int], _p] = {}
        self.algos: dict[tuple[int, int, GemmTypes, int | str], _Algo] = {} if algos is None else algos
        self.heuristic_queries = 0  # how often the heuristics ran (tests count them)
        self._alpha = _f(1.0)
        self._betas = {False: _f(0.0), True: _f(1.0)}

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> _p:
        key = (dtype, rows, cols, ld)
        layout = self._layouts.get(key)
        if layout is None:
            layout = _p()
            check(_lib().cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
                  "cublasLtMatrixLayoutCreate")
            self._layouts[key] = layout
        return layout

    def _layouts_for(self, m: int, n: int, k: int, types: GemmTypes) -> tuple[_p, _p, _p]:
        """A (the weights), B (the input rows), C = D (the output rows)."""
        a_type, b_type, c_type = types
        return self._layout(a_type, k, n, k), self._layout(b_type, k, m, k), self._layout(c_type, n, m, n)

    def _heuristics(self, m: int, n: int, k: int, types: GemmTypes, count: int = 1,
                    desc: _p | None = None) -> list[_Algo]:
        """The heuristics' first `count` algorithms for exactly m rows, best guess first (desc: another matmul
        descriptor than the plain one)."""
        found = self._query(m, n, k, types, count, desc)
        if not found:
            raise RuntimeError(f"cuBLASLt has no algorithm for m={m}, n={n}, k={k}")
        return found

    def _query(self, m: int, n: int, k: int, types: GemmTypes, count: int, desc: _p | None) -> list[_Algo]:
        """The heuristics' answer, [] where they have none for this descriptor and shape."""
        a, b, c = self._layouts_for(m, n, k, types)
        results, found = (_HeuristicResult * count)(), _i()
        status = _lib().cublasLtMatmulAlgoGetHeuristic(self.handle, desc or self.desc, a, b, c, c, self.preference,
                                                       count, results, ctypes.byref(found))
        self.heuristic_queries += 1
        if status in (CUBLAS_STATUS_NOT_SUPPORTED, CUBLAS_STATUS_INVALID_VALUE) and desc is not None:
            return []
        check(status, f"cublasLtMatmulAlgoGetHeuristic(m={m}, n={n}, k={k})")
        return [results[i].algo for i in range(found.value)]

    def tune(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int,
             elapsed: Callable[[Callable[[], None]], float]) -> int:
        """Time the heuristics' first TUNE_CANDIDATES algorithms for exactly m rows on these buffers and keep the
        fastest for m (an exact row count: gemm() then uses it). elapsed(run) runs `run` on the stream and returns
        its time; the GEMMs run now, so not during a capture. Returns the index of the one kept (0: the
        heuristics' own choice)."""
        assert m in self.exact_rows and not self.invariant, m
        n, k = matmul_shape(out, x, w, m)
        types = gemm_types(out, x, w)
        a, b, c = self._layouts_for(m, n, k, types)
        times: dict[int, float] = {}
        candidates = self._heuristics(m, n, k, types, TUNE_CANDIDATES)
        for i, algo in enumerate(candidates):
            if self._matmul(algo, out.ptr, x.ptr, w.ptr, a, b, c, False) != 0:  # untimed; one may refuse this shape
                continue
            times[i] = elapsed(lambda: [self._matmul(algo, out.ptr, x.ptr, w.ptr, a, b, c, False)
                                        for _ in range(TUNE_RUNS)])
        if not times:
            raise RuntimeError(f"cublasLtMatmul(m={m}, n={n}, k={k}): none of the heuristics' algorithms ran")
        best = min(times, key=times.__getitem__)
        self.algos[(n, k, types, m)] = candidates[best]
        return best

    def algorithm(self, m: int, n: int, k: int, types: GemmTypes = BF16_GEMM) -> _Algo:
        """The algorithm of m's class (found by the heuristics at the class's row count, once); batch-invariant: the
        split-free one of INVARIANT_ROWS, whatever m."""
        if self.invariant:
            key = (n, k, types, "invariant")
            if key not in self.algos:
                self.algos[key] = pinned_split_free(self._heuristics(INVARIANT_ROWS, n, k, types)[0])
            return self.algos[key]
        return self._algorithm_at(m if m in self.exact_rows else m_class(m), n, k, types)

    def _algorithm_at(self, rows: int, n: int, k: int, types: GemmTypes) -> _Algo:
        """The heuristics' algorithm for exactly `rows` rows, asked for once."""
        key = (n, k, types, rows)
        algo = self.algos.get(key)
        if algo is None:
            algo = self.algos[key] = self._heuristics(rows, n, k, types)[0]
        return algo

    def gemm(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int, accumulate: bool = False) -> None:
        """Row-major out[:m] = x[:m] . w^T (+ out when accumulate), w [n, k]; the types from the tensors' dtypes
        (gemm_types): bf16 inputs, float32 compute, output bf16 or float32."""
        n, k = matmul_shape(out, x, w, m)
        types = gemm_types(out, x, w)
        algo = self.algorithm(m, n, k, types)
        a, b, c = self._layouts_for(m, n, k, types)
        status = self._matmul(algo, out.ptr, x.ptr, w.ptr, a, b, c, accumulate)
        # the class's algorithm cannot do this m: ask for this m's own (batch-invariant: no other algorithm may run)
        if status == CUBLAS_STATUS_NOT_SUPPORTED and not self.invariant:
            status = self._matmul(self._algorithm_at(m, n, k, types), out.ptr, x.ptr, w.ptr, a, b, c, accumulate)
        check(status, f"cublasLtMatmul(m={m}, n={n}, k={k})")

    def gemm_scaled(self, out: DeviceTensor, x: DeviceTensor, w: DeviceTensor, m: int,
                    accumulate: bool = False) -> bool:
        """FP8: out[:m] = x[:m] . w^T with x's and w's scales (+ out when accumulate), e4m3 x and w, out bf16 or
        float32, in one cuBLASLt call. The scales (scale_kind): per weight row ([n]) and per input row ([m]), times
        the sum; or per 128 x 128 block of w (row-major as checkpoints store them, rows padded: scale_kind) and per
        input row and 128 columns ([ceil(k / 128), m]: the rows' scales of a group one after another; m a multiple
        of 4, else cuBLASLt has no algorithm), within the sum. False where cuBLASLt has no algorithm for that scaling
        (nothing ran: the caller scales itself, or keeps block-scaled weights off this path)."""
        n, k = matmul_shape(out, x, w, m)
        if x.dtype != E4M3 or w.dtype != E4M3 or x.scale is None or w.scale is None or out.dtype not in (BF16, F32):
            raise ValueError("gemm_scaled takes e4m3 inputs and weights with their scales into bf16 or float32")
        if self.invariant:
            return False
        kind = scale_kind(w)
        types = (CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_TYPES[out.dtype])
        rows = m if m in self.exact_rows else m_class(m)
        key = (n, k, types, rows, kind)
        desc = self._scaled_desc(kind)  # this handle's own, also where another handle found the algorithm
        if key not in self.algos:
            self.algos[key] = next(iter(self._query(rows, n, k, types, 1, desc)), None)
        algo = self.algos[key]
        if algo is None:
            return False
        for attribute, tensor in ((CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, w.scale),
                                  (CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, x.scale)):
            _set_desc(desc, attribute, _p(tensor.ptr))
        a, b, c = self._layouts_for(m, n, k, types)
        status = self._matmul(algo, out.ptr, x.ptr, w.ptr, a, b, c, accumulate, desc)
        if status == CUBLAS_STATUS_NOT_SUPPORTED:  # the class's algorithm cannot do this m: ask for its own once
            own = self._query(m, n, k, types, 1, desc)
            if not own:
                return False
            status = self._matmul(own[0], out.ptr, x.ptr, w.ptr, a, b, c, accumulate, desc)
        check(status, f"cublasLtMatmul(m={m}, n={n}, k={k}, fp8 {kind} scales)")
        return True

    def scales_blocks(self, n: int, k: int) -> bool:
        """Whether cuBLASLt has an algorithm for an FP8 product with w [n, k] scaled per 128 x 128 block (asked
        once per shape; never in batch-invariant mode, whose products run one pinned algorithm)."""
        if self.invariant:
            return False
        types = (CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_32F)
        key = (n, k, types, "block-probe")
        if key not in self.algos:
            self.algos[key] = next(iter(self._query(INVARIANT_ROWS, n, k, types, 1, self._scaled_desc("block"))),
                                   None)
        return self.algos[key] is not None

    def _scaled_desc(self, kind: str) -> _p:
        """The descriptor of gemm_scaled for one scale kind: the plain one's, with SCALE_MODES[kind] for A and B
        (their pointers set at each call; the heuristics are asked with placeholders, which they do not read)."""
        if kind not in self.scaled_descs:
            desc = self.scaled_descs[kind] = _matmul_desc()
            for attribute, mode in zip((CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE),
                                       SCALE_MODES[kind]):
                _set_desc(desc, attribute, _i(mode))
            # not null: with null block-scale pointers the heuristics offer no algorithm (measured)
            placeholder = _p(self.workspace.value or SCALE_PLACEHOLDER)
            for attribute in (CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER):
                _set_desc(desc, attribute, placeholder)
        return self.scaled_descs[kind]

    def _matmul(self, algo: _Algo, out: int, x: int, w: int, a: _p, b: _p, c: _p, accumulate: bool,
                desc: _p | None = None) -> int:
        return _lib().cublasLtMatmul(self.handle, desc or self.desc, ctypes.byref(self._alpha), w, a, x, b,
                                     ctypes.byref(self._betas[accumulate]), out, c, out, c, ctypes.byref(algo),
                                     self.workspace, self.workspace_bytes, self.stream)

    def close(self) -> None:
        if self.handle:
            for layout in self._layouts.values():
                check(_lib().cublasLtMatrixLayoutDestroy(layout), "cublasLtMatrixLayoutDestroy")
            self._layouts = {}
            check(_lib().cublasLtMatmulPreferenceDestroy(self.preference), "cublasLtMatmulPreferenceDestroy")
            for desc in (self.desc, *self.scaled_descs.values()):
                check(_lib().cublasLtMatmulDescDestroy(desc), "cublasLtMatmulDescDestroy")
            check(_lib().cublasLtDestroy(self.handle), "cublasLtDestroy")
            self.handle = _p()
