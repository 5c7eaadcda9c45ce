"""CUDA graphs through the driver API (ctypes on libcuda): capture a stream's work once, replay it with one launch.

PyCUDA has no graph API. Kernels launched with PyCUDA and GEMMs issued by cuBLAS on the same stream between
begin_capture and end_capture are recorded, not run; the instantiated graph replays them with their arguments
(device pointers and scalars) frozen, so replayed work reads its inputs from fixed device buffers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

_lib = ctypes.CDLL("libcuda.so.1")
_p = ctypes.c_void_p
_SIGNATURES = {
    "cuStreamBeginCapture_v2": [_p, ctypes.c_int],
    "cuStreamEndCapture": [_p, ctypes.POINTER(_p)],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(_p), _p, ctypes.c_ulonglong],
    "cuGraphLaunch": [_p, _p],
    "cuGraphDestroy": [_p],
    "cuGraphExecDestroy": [_p],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}
for _name, _args in _SIGNATURES.items():
    getattr(_lib, _name).argtypes = _args
    getattr(_lib, _name).restype = ctypes.c_int
CU_STREAM_CAPTURE_MODE_GLOBAL = 0


def check(status: int, call: str) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        _lib.cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {name.value.decode() if name.value else f'CUresult {status}'}")


class Graph:
    """An instantiated CUDA graph of whatever `record` enqueues on the stream."""

    def __init__(self, stream_handle: int, record: Callable[[], None]) -> None:
        check(_lib.cuStreamBeginCapture_v2(stream_handle, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture_v2")
        graph = _p()
        try:
            record()
        finally:  # always leave capture mode, or the stream stays unusable
            status = _lib.cuStreamEndCapture(stream_handle, ctypes.byref(graph))
        check(status, "cuStreamEndCapture")
        self.exec = _p()
        try:
            check(_lib.cuGraphInstantiateWithFlags(ctypes.byref(self.exec), graph, 0), "cuGraphInstantiateWithFlags")
        finally:
            check(_lib.cuGraphDestroy(graph), "cuGraphDestroy")

    def launch(self, stream_handle: int) -> None:
        check(_lib.cuGraphLaunch(self.exec, stream_handle), "cuGraphLaunch")

    def close(self) -> None:
        if self.exec:
            check(_lib.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            self.exec = _p()
