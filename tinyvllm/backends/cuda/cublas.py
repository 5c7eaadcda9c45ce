"""A ctypes binding of the few cuBLAS calls tinyvllm needs (scikit-cuda style): every status checked by name.

All our matrices are row-major; cuBLAS is column-major. A row-major [m, n] matrix is the column-major [n, m] one,
so the row-major product Y[m, n] = X[m, k] . W[n, k]^T is computed as the column-major Y^T = W^T(op T) . X^T:
cublasGemmEx(OP_T, OP_N, n, m, k, W, lda=k, X, ldb=k, Y, ldc=n). "TN" is also cuBLAS's fastest layout.
"""

from __future__ import annotations

import ctypes
import ctypes.util

CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1
STATUS_NAMES = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
                7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
                13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
                15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR"}


def _load_library() -> ctypes.CDLL:
    names = ["libcublas.so.13", "libcublas.so.12", ctypes.util.find_library("cublas")]
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("cuBLAS not found (tried libcublas.so.13, libcublas.so.12): install the CUDA toolkit or "
                       "put its lib64 directory on LD_LIBRARY_PATH")


_lib = _load_library()
_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "cublasCreate_v2": [ctypes.POINTER(_p)],
    "cublasDestroy_v2": [_p],
    "cublasSetStream_v2": [_p, _p],
    "cublasSetWorkspace_v2": [_p, _p, ctypes.c_size_t],
    "cublasGemmEx": [_p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _p, _i, _i, _p, _p, _i, _i, _i, _i],
}
for _name, _args in _SIGNATURES.items():
    getattr(_lib, _name).argtypes = _args
    getattr(_lib, _name).restype = _i


def check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: {STATUS_NAMES.get(status, f'cuBLAS status {status}')}")


class Cublas:
    """A cuBLAS handle bound to one stream and a fixed workspace (so that GEMMs can be captured in CUDA graphs)."""

    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int) -> None:
        self.handle = _p()
        check(_lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate_v2")
        check(_lib.cublasSetStream_v2(self.handle, stream_handle), "cublasSetStream_v2")
        check(_lib.cublasSetWorkspace_v2(self.handle, workspace_ptr, workspace_bytes), "cublasSetWorkspace_v2")
        self._alpha = _f(1.0)
        self._betas = {0.0: _f(0.0), 1.0: _f(1.0)}

    def gemm(self, out: int, x: int, w: int, m: int, n: int, k: int, out_fp32: bool = False,
             accumulate: bool = False) -> None:
        """Row-major out[m, n] = x[m, k] . w[n, k]^T (+ out when accumulate); bf16 inputs, float32 compute,
        output bf16 or float32."""
        status = _lib.cublasGemmEx(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, ctypes.byref(self._alpha), w, CUDA_R_16BF, k,
            x, CUDA_R_16BF, k, ctypes.byref(self._betas[1.0 if accumulate else 0.0]), out,
            CUDA_R_32F if out_fp32 else CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        check(status, f"cublasGemmEx(m={m}, n={n}, k={k})")

    def close(self) -> None:
        if self.handle:
            check(_lib.cublasDestroy_v2(self.handle), "cublasDestroy_v2")
            self.handle = _p()
