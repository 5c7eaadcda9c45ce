"""Compile cuda/*.cu for this device's architecture and hand out the kernels, ready to launch through PyCUDA.

PyCUDA runs on the device's primary context (pycuda.autoprimaryctx), the one the CUDA runtime and so cuBLAS use:
both see the same allocations and streams. The files become cubins through kernel_cache.py (cached on disk across
runs, compiled by parallel nvcc processes when missing), loaded with module_from_buffer. Which kernels each file
holds, their argument types and the -D defines they are compiled with come from ops.py, whose launchers launch them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import pycuda.autoprimaryctx  # noqa: F401  (makes the primary context current)
import pycuda.driver as cuda

from tinyvllm.backends.cuda.kernel_cache import CUDA_DIR, OPTIONS, CompileJob, build_cubins, compile_jobs
from tinyvllm.backends.cuda.ops import SIGNATURES

__all__ = ["CUDA_DIR", "Kernel", "arch", "compile_source", "load"]


class Kernel:
    """A prepared kernel; launch errors name it."""

    def __init__(self, name: str, func: cuda.Function, arg_format: str) -> None:
        self.name = name
        self.func = func
        func.prepare(arg_format)

    def __call__(self, grid: tuple[int, ...], block: tuple[int, int, int], stream: cuda.Stream, *args) -> None:
        try:
            self.func.prepared_async_call(grid, block, stream, *args)
        except cuda.Error as exc:
            raise RuntimeError(f"CUDA kernel {self.name} grid={grid} block={block} failed to launch: {exc}") from exc


def arch() -> str:
    major, minor = cuda.Context.get_device().compute_capability()
    return f"sm_{major}{minor}"


def build(jobs: list[CompileJob]) -> dict[str, cuda.Module]:
    """The jobs' modules, loaded from cached or freshly compiled cubins."""
    return {name: cuda.module_from_buffer(cubin) for name, cubin in build_cubins(jobs, arch()).items()}


def compile_source(source: str, defines: Mapping[str, int]) -> cuda.Module:
    """One kernel source (a variant under study, as bench/attention.py compiles), through the same cache."""
    return build([CompileJob("source", source, defines, OPTIONS)])["source"]


@functools.cache
def load() -> dict[str, Kernel]:
    """Every kernel of cuda/*.cu for this device, from the cubin cache or compiled now (in parallel)."""
    modules = build(compile_jobs())
    return {name: Kernel(name, modules[signature.file].get_function(name), signature.arg_format)
            for name, signature in SIGNATURES.items()}
