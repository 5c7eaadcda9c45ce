"""The driver API calls PyCUDA lacks, through ctypes on libcuda: loading our cubins, launching their kernels with
programmatic dependent launch, and CUDA graphs.

Launches: every kernel goes out through cuLaunchKernelEx, on sm_90 and later with programmatic stream
serialization, so that it may start while the kernel before it on the stream ends (common.cuh says what each
kernel does for that). Graphs: kernels and cuBLAS GEMMs enqueued on a stream between the begin and the end of a
capture are recorded, not run; the instantiated graph replays them with their arguments (device pointers and
scalars) frozen, so replayed work reads its inputs from fixed device buffers. A launch with the attribute captured
in a graph becomes a programmatic edge of the graph, so replays overlap the same way.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable

_p = ctypes.c_void_p


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value (a union; ours are ints)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", _p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_SIGNATURES = {
    "cuModuleLoadData": [ctypes.POINTER(_p), ctypes.c_char_p],
    "cuModuleGetFunction": [ctypes.POINTER(_p), _p, ctypes.c_char_p],
    "cuModuleUnload": [_p],
    "cuLaunchKernelEx": [ctypes.POINTER(_LaunchConfig), _p, ctypes.POINTER(_p), ctypes.POINTER(_p)],
    "cuFuncSetAttribute": [_p, ctypes.c_int, ctypes.c_int],
    "cuStreamBeginCapture_v2": [_p, ctypes.c_int],
    "cuStreamEndCapture": [_p, ctypes.POINTER(_p)],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(_p), _p, ctypes.c_ulonglong],
    "cuGraphLaunch": [_p, _p],
    "cuGraphDestroy": [_p],
    "cuGraphExecDestroy": [_p],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}


@functools.cache
def _lib() -> ctypes.CDLL:
    """libcuda, loaded at the first driver call (importing this module needs no driver)."""
    lib = ctypes.CDLL("libcuda.so.1")
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    return lib


# Thread-local: a capture restricts only its own thread's calls, so one thread may capture while another runs steps.
CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# How each PyCUDA-style argument format letter (ops.Signature.arg_format) reaches the kernel.
_ARGUMENT_TYPES: dict[str, Callable[[object], ctypes._SimpleCData]] = {
    "P": lambda value: _p(int(value)),  # a device pointer: an int or a PyCUDA DeviceAllocation
    "i": lambda value: ctypes.c_int(int(value)),
    "f": lambda value: ctypes.c_float(float(value)),
}


def error_name(status: int) -> str:
    name = ctypes.c_char_p()
    _lib().cuGetErrorName(status, ctypes.byref(name))
    return name.value.decode() if name.value else f"CUresult {status}"


def check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: {error_name(status)}")


def load_module(cubin: bytes) -> int:
    """Load a cubin into the current context (until unload_module)."""
    module = _p()
    check(_lib().cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
    return module.value


def unload_module(module: int) -> None:
    check(_lib().cuModuleUnload(module), "cuModuleUnload")


def get_function(module: int, name: str) -> int:
    function = _p()
    check(_lib().cuModuleGetFunction(ctypes.byref(function), module, name.encode()), f"cuModuleGetFunction({name})")
    return function.value


class Launcher:
    """Launches one kernel: its argument types from a format string ("P", "i", "f" per argument), optionally with
    programmatic dependent launch, with shared_bytes of dynamic shared memory (allowed past the default 48 KB).
    Safe to call from several threads (lazy graph capture launches the kernels the engine's thread launches too)."""

    def __init__(self, function: int, arg_format: str, programmatic: bool, shared_bytes: int = 0) -> None:
        self.function = _p(function)
        self.shared_bytes = shared_bytes
        if shared_bytes:
            check(_lib().cuFuncSetAttribute(self.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            shared_bytes), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        self._launch = _lib().cuLaunchKernelEx
        self.convert = tuple(_ARGUMENT_TYPES[letter] for letter in arg_format)
        self.attribute = None
        if programmatic:
            self.attribute = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            self.attribute.value[0] = 1
        # A launch configuration per thread: ctypes lets go of the GIL during cuLaunchKernelEx, so with one shared
        # struct another thread's next launch can rewrite its grid or stream while the driver reads it (the likely
        # cause of a lazy-capture run that differed in tests/gpu/test_cuda_model.py; tests/test_driver.py).
        self._local = threading.local()

    def _config(self) -> _LaunchConfig:
        config = getattr(self._local, "config", None)
        if config is None:
            config = self._local.config = _LaunchConfig()
            if self.attribute is not None:
                config.attrs = ctypes.pointer(self.attribute)
                config.num_attrs = 1
        return config

    def __call__(self, grid: tuple[int, ...], block: tuple[int, int, int], stream_handle: int, args: tuple,
                 shared_bytes: int | None = None) -> int:
        """Enqueue the kernel with shared_bytes of dynamic shared memory (None: the declared amount, which bounds
        it); returns the CUresult."""
        if len(args) != len(self.convert):
            raise TypeError(f"{len(args)} arguments for a kernel of {len(self.convert)}")
        if shared_bytes is not None and not 0 <= shared_bytes <= self.shared_bytes:
            raise ValueError(f"{shared_bytes} bytes of dynamic shared memory for a kernel declared with "
                             f"{self.shared_bytes}")
        values = [convert(arg) for convert, arg in zip(self.convert, args)]
        params = (_p * len(values))(*[ctypes.addressof(value) for value in values])
        config = self._config()
        config.shared_mem_bytes = self.shared_bytes if shared_bytes is None else shared_bytes
        config.grid[:] = (*grid, 1, 1)[:3]
        config.block[:] = block
        config.stream = stream_handle
        return self._launch(ctypes.byref(config), self.function, params, None)


class Graph:
    """An instantiated CUDA graph of whatever `record` enqueues on the stream."""

    def __init__(self, stream_handle: int, record: Callable[[], None]) -> None:
        check(_lib().cuStreamBeginCapture_v2(stream_handle, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture_v2")
        graph = _p()
        try:
            record()
        finally:  # always leave capture mode, or the stream stays unusable
            status = _lib().cuStreamEndCapture(stream_handle, ctypes.byref(graph))
        check(status, "cuStreamEndCapture")
        self.exec = _p()
        try:
            check(_lib().cuGraphInstantiateWithFlags(ctypes.byref(self.exec), graph, 0), "cuGraphInstantiateWithFlags")
        finally:
            check(_lib().cuGraphDestroy(graph), "cuGraphDestroy")

    def launch(self, stream_handle: int) -> None:
        check(_lib().cuGraphLaunch(self.exec, stream_handle), "cuGraphLaunch")

    def close(self) -> None:
        if self.exec:
            check(_lib().cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            self.exec = _p()
