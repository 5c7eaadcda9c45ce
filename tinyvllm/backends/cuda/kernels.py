"""Compile cuda/*.cu for this device's architecture and hand out the kernels, ready to launch.

PyCUDA runs on the device's primary context (pycuda.autoprimaryctx), the one the CUDA runtime and so cuBLAS use:
all see the same allocations and streams. The files become cubins through kernel_cache.py (cached on disk across
runs, compiled by parallel nvcc processes when missing); driver.py loads them and launches their kernels, with
programmatic dependent launch on sm_90 and later. Which kernels each file holds, their argument types and the -D
defines they are compiled with come from ops.py, whose launchers launch them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import pycuda.autoprimaryctx  # noqa: F401  (makes the primary context current)
import pycuda.driver as cuda

from tinyvllm.backends.cuda import driver
from tinyvllm.backends.cuda.kernel_cache import CUDA_DIR, OPTIONS, CompileJob, build_cubins, compile_jobs
from tinyvllm.backends.cuda.ops import SIGNATURES

__all__ = ["CUDA_DIR", "Kernel", "arch", "compile_source", "load"]

# Launch with programmatic dependent launch where the GPU has it (sm_90+). Set False before load() to measure
# without it (docs/PERFORMANCE.md's A/B).
PROGRAMMATIC_LAUNCH = True


class Kernel:
    """A loaded kernel, called as launcher(grid, block, stream, *args); launch errors name it."""

    def __init__(self, name: str, function: int, arg_format: str, programmatic: bool) -> None:
        self.name = name
        self.launcher = driver.Launcher(function, arg_format, programmatic)

    def __call__(self, grid: tuple[int, ...], block: tuple[int, int, int], stream: cuda.Stream | None, *args) -> None:
        status = self.launcher(grid, block, stream.handle if stream is not None else 0, args)
        if status != 0:
            raise RuntimeError(f"CUDA kernel {self.name} grid={grid} block={block} failed to launch: "
                               f"{driver.error_name(status)}")


def compute_capability() -> tuple[int, int]:
    return cuda.Context.get_device().compute_capability()


def arch() -> str:
    major, minor = compute_capability()
    return f"sm_{major}{minor}"


def compile_source(source: str, defines: Mapping[str, int]) -> cuda.Module:
    """One kernel source (a variant under study, as bench/attention.py compiles), through the same cache, as a
    PyCUDA module."""
    cubins = build_cubins([CompileJob("source", source, defines, OPTIONS)], arch())
    return cuda.module_from_buffer(cubins["source"])


@functools.cache
def load() -> dict[str, Kernel]:
    """Every kernel of cuda/*.cu for this device, from the cubin cache or compiled now (in parallel)."""
    modules = {name: driver.load_module(cubin) for name, cubin in build_cubins(compile_jobs(), arch()).items()}
    programmatic = PROGRAMMATIC_LAUNCH and compute_capability() >= (9, 0)
    return {name: Kernel(name, driver.get_function(modules[signature.file], name), signature.arg_format,
                         programmatic)
            for name, signature in SIGNATURES.items()}
