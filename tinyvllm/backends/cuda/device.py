"""One NVIDIA GPU as an object: its context, streams, compiled kernels, cuBLAS handles, SM count, and every
allocation made on it (device and pinned host memory), so that close() gives all of it back.

Nothing is chosen at import. Device(index) makes the device's primary context (the one the CUDA runtime, and so
cuBLAS, use: all see the same allocations and streams) current on the calling thread, until close(). Everything the
backend holds on the GPU is allocated through its Device and is freed by close(), which a CudaBackend calls from
its own close() and when it is garbage collected.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Protocol

import numpy as np
import pycuda.driver as cuda

from tinyvllm.backends.cuda import driver, kernels
from tinyvllm.backends.cuda.cublas import Cublas
from tinyvllm.backends.cuda.ops import Ops
from tinyvllm.backends.cuda.tensors import NUMPY_DTYPES, DeviceTensor, nbytes

log = logging.getLogger(__name__)

L2_BYTES_UNKNOWN = 64 << 20  # the L2 assumed where pycuda does not say (H100 and H200 have 50 MiB)


class Closable(Protocol):
    def close(self) -> None: ...


class DeviceClosedError(RuntimeError):
    pass


class Device:
    """GPU `index`, its primary context current on this thread. programmatic_launch: launch the kernels with
    programmatic dependent launch where the GPU has it (sm_90+); False measures without it (docs/PERFORMANCE.md's
    A/B). Its kernels, and one Ops per stream (with the SM count, which gemv chooses its form by), are made at first
    use. prepare: kernels to start building at once (prepare_kernels), before the context is made (~0.3 s)."""

    def __init__(self, index: int = 0, programmatic_launch: bool = True, prepare: Iterable[str] | None = None) -> None:
        cuda.init()
        if not 0 <= index < cuda.Device.count():
            raise ValueError(f"no CUDA device {index}: {cuda.Device.count()} visible")
        # an LLM dropped while caught in a reference cycle frees its memory now, before this one counts what is free
        gc.collect()
        self.index = index
        self.handle = cuda.Device(index)
        self.name = self.handle.name()
        self.compute_capability = self.handle.compute_capability()
        self.arch = "sm_{}{}".format(*self.compute_capability)
        self.num_sms = self.handle.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
        l2 = getattr(cuda.device_attribute, "L2_CACHE_SIZE", None)  # its bytes: overwritten to time a cold weight
        self.l2_bytes = self.handle.get_attribute(l2) if l2 is not None else L2_BYTES_UNKNOWN
        self.programmatic_launch = programmatic_launch and self.compute_capability >= (9, 0)
        self._building: tuple[list[str], Future] | None = None  # prepare_kernels' kernels and their build
        if prepare is not None:
            self._start_build(prepare)
        self.context = self.handle.retain_primary_context()
        self.context.push()
        self._thread = threading.get_ident()
        self._allocations: dict[int, tuple[cuda.DeviceAllocation, int]] = {}  # address -> (allocation, bytes)
        self._pinned: dict[int, np.ndarray] = {}  # by id
        self._workers: list[Closable] = []  # threads launching work here: stopped first
        self._closables: list[Closable] = []  # cuBLAS handles, graphs: closed next, newest first
        self._streams: list[cuda.Stream] = []
        self._kernels: kernels.KernelTable | None = None
        self.kernel_wait = 0.0  # seconds the kernels property waited for prepare_kernels' build and loaded them
        self._ops: dict[int, Ops] = {}
        self.closed = False
        atexit.register(self.close)  # a device left open is closed before the interpreter goes (its push popped)

    # ---- what runs on it -------------------------------------------------------------------------------------------

    def prepare_kernels(self, names: Iterable[str]) -> None:
        """Start building these kernels (from the disk cache, else by nvcc) on a thread while the caller goes on (the
        weight upload); the kernels property then waits for them and loads only them, any other kernel at its first
        use."""
        self.check_open()
        names = list(names)
        if self._building is None or self._building[0] != names:  # not already under way
            self._start_build(names)

    def _start_build(self, names: Iterable[str]) -> None:
        names = list(names)
        self._building = (names, kernels.build_in_background(self.arch, names))

    @property
    def kernels(self) -> kernels.KernelTable:
        """The kernels of cuda/*.cu by name, loaded into this device's context at the first use: those of
        prepare_kernels once their build is done, else every kernel (built in parallel)."""
        self.check_open()
        if self._kernels is None:
            self._kernels = kernels.KernelTable(self.arch, self.programmatic_launch)
            if self._building is None:
                self._kernels.load()
        if self._building is not None:
            (names, build), self._building = self._building, None
            start = time.perf_counter()
            build.result()
            self._kernels.load(names)
            self.kernel_wait += time.perf_counter() - start
        return self._kernels

    def ops(self, stream: cuda.Stream | None) -> Ops:
        """The launchers on `stream` (None: the default stream), one Ops per stream."""
        key = stream.handle if stream is not None else 0
        if key not in self._ops:
            self._ops[key] = Ops(self.kernels, stream, self.num_sms)
        return self._ops[key]

    def stream(self, non_blocking: bool = False) -> cuda.Stream:
        """A new stream (non_blocking: no implicit synchronization with the default stream's work)."""
        self.check_open()
        stream = cuda.Stream(flags=1 if non_blocking else 0)
        self._streams.append(stream)
        return stream

    def cublas(self, stream: cuda.Stream, workspace: DeviceTensor, exact_rows: frozenset[int] = frozenset(),
               algos: dict | None = None, invariant: bool = False) -> Cublas:
        """A cuBLASLt handle on `stream` with a fixed workspace, destroyed at close() (or by release());
        invariant: batch-invariant algorithms (cublas.py)."""
        self.check_open()
        return self.own(Cublas(stream.handle, workspace.ptr, workspace.nbytes, exact_rows=exact_rows, algos=algos,
                               invariant=invariant))

    def own(self, closable: Closable, worker: bool = False):
        """Close `closable` at close(), before the memory goes (graphs, handles); a worker (a thread that launches
        work here) is closed before everything else. Returns it."""
        (self._workers if worker else self._closables).append(closable)
        return closable

    def release(self, closable: Closable) -> None:
        """Close one owned object now."""
        closable.close()
        self._workers = [c for c in self._workers if c is not closable]
        self._closables = [c for c in self._closables if c is not closable]

    # ---- memory ----------------------------------------------------------------------------------------------------

    def alloc(self, size: int) -> int:
        """`size` bytes of device memory (freed at close() or by free())."""
        self.check_open()
        allocation = cuda.mem_alloc(max(size, 1))
        self._allocations[int(allocation)] = (allocation, max(size, 1))
        return int(allocation)

    def empty(self, dtype: str, shape: tuple[int, ...]) -> DeviceTensor:
        return DeviceTensor(self.alloc(nbytes(dtype, shape)), dtype, tuple(shape))

    def upload(self, array: np.ndarray, dtype: str) -> DeviceTensor:
        """A copy of `array` (numpy's storage of `dtype`: bf16 as uint16 bit patterns) in device memory."""
        array = np.ascontiguousarray(array)
        if array.dtype != np.dtype(NUMPY_DTYPES[dtype]):
            raise TypeError(f"a {dtype} device tensor is uploaded from {NUMPY_DTYPES[dtype]}, not {array.dtype}")
        tensor = self.empty(dtype, array.shape)
        cuda.memcpy_htod(tensor.ptr, array)
        return tensor

    def free(self, memory: DeviceTensor | int) -> None:
        """Free one allocation now (a DeviceTensor, or the address alloc() returned)."""
        address = memory.ptr if isinstance(memory, DeviceTensor) else memory
        cuda.Context.synchronize()  # no queued work may still use it
        self._allocations.pop(address)[0].free()

    def pinned(self, size: int, dtype: type) -> np.ndarray:
        """A page-locked host array (what asynchronous copies need), freed at close() or by free_pinned()."""
        self.check_open()
        array = cuda.pagelocked_empty(size, dtype)
        self._pinned[id(array)] = array
        return array

    def free_pinned(self, array: np.ndarray) -> None:
        cuda.Context.synchronize()  # no queued copy may still read it
        self._pinned.pop(id(array)).base.free()

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        self.check_open()
        return cuda.mem_get_info()

    @property
    def allocated_bytes(self) -> int:
        """Device memory held through alloc() now (tests check it returns to zero)."""
        return sum(size for _, size in self._allocations.values())

    # ---- giving it back --------------------------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.closed:
            raise DeviceClosedError(f"CUDA device {self.index} ({self.name}) was closed: its memory was given back")

    def close(self) -> None:
        """Give everything back: stop and close what was owned (graphs, capture threads, cuBLAS handles), free every
        allocation and pinned buffer, unload the kernels, drop the streams, and leave the context. Idempotent."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        here = threading.get_ident() == self._thread
        if not here:
            self.context.push()  # the frees need the context current on this thread
        errors: list[BaseException] = []
        _each(errors, list(self._workers), lambda worker: worker.close())
        _each(errors, [self.context.synchronize], lambda step: step())
        _each(errors, list(reversed(self._closables)), lambda closable: closable.close())
        _each(errors, list(self._allocations.values()), lambda entry: entry[0].free())
        _each(errors, list(self._pinned.values()), lambda array: array.base.free())
        _each(errors, list(self._kernels.modules.values()) if self._kernels is not None else [], driver.unload_module)
        self._workers, self._closables, self._allocations, self._pinned, self._building = [], [], {}, {}, None
        self._kernels, self._ops, self._streams = None, {}, []
        _each(errors, [cuda.Context.pop], lambda step: step())  # this thread's push (the open's, or the one above)
        if not here and self._thread == threading.main_thread().ident:
            atexit.register(cuda.Context.pop)  # the main thread's push, which only the main thread can pop
        elif not here:
            log.warning("cuda: device %d closed on a thread other than the one that opened it", self.index)
        self.context = None
        if errors:
            raise RuntimeError(f"closing CUDA device {self.index}: {errors[0]}") from errors[0]


def _each(errors: list[BaseException], items, release: Callable) -> None:
    """release(item) for every item, going on past a failure (the first is raised when all is done)."""
    for item in items:
        try:
            release(item)
        except Exception as exc:  # noqa: BLE001 - the rest is still given back
            errors.append(exc)
