"""Compile cuda/*.cu for a device's architecture and hand out the kernels, ready to launch.

The files become cubins through kernel_cache.py (cached on disk across runs, compiled by parallel nvcc processes
when missing); driver.py loads them into the current context and launches their kernels, with programmatic
dependent launch on sm_90 and later. Which kernels each file holds, their argument types and the -D defines they
are compiled with come from ops.py, whose launchers launch them. Nothing here touches a GPU at import: a Device
(device.py) loads the kernels into its context and unloads them at its close.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from tinyvllm.backends.cuda import driver
from tinyvllm.backends.cuda.kernel_cache import OPTIONS, CompileJob, build_cubins, compile_jobs
from tinyvllm.backends.cuda.ops import SIGNATURES

__all__ = ["Kernel", "compile_source", "load"]


class Kernel:
    """A loaded kernel, called as launcher(grid, block, stream, *args); launch errors name it."""

    def __init__(self, name: str, function: int, arg_format: str, programmatic: bool) -> None:
        self.name = name
        self.launcher = driver.Launcher(function, arg_format, programmatic)

    def __call__(self, grid: tuple[int, ...], block: tuple[int, int, int], stream, *args) -> None:
        """stream: a pycuda Stream, or None for the default stream."""
        status = self.launcher(grid, block, stream.handle if stream is not None else 0, args)
        if status != 0:
            raise RuntimeError(f"CUDA kernel {self.name} grid={grid} block={block} failed to launch: "
                               f"{driver.error_name(status)}")


@functools.cache
def cubins(arch: str) -> dict[str, bytes]:
    """Every kernel file's cubin for `arch`, from the disk cache or compiled now (in parallel); host bytes, kept for
    the process so that a second Device of the same kind loads them without asking the cache again."""
    return build_cubins(compile_jobs(), arch)


def compile_source(source: str, defines: Mapping[str, int], arch: str):
    """One kernel source (a variant under study, as bench/attention.py compiles), through the same cache, as a
    PyCUDA module of the current context."""
    import pycuda.driver as cuda

    compiled = build_cubins([CompileJob("source", source, defines, OPTIONS)], arch)
    return cuda.module_from_buffer(compiled["source"])


def load(arch: str, programmatic: bool) -> tuple[dict[str, Kernel], list[int]]:
    """Every kernel of cuda/*.cu, loaded into the current context (of a device of `arch`), launched with
    programmatic dependent launch when `programmatic`; and the modules loaded, for driver.unload_module."""
    modules = {name: driver.load_module(cubin) for name, cubin in cubins(arch).items()}
    kernels = {name: Kernel(name, driver.get_function(modules[signature.file], name), signature.arg_format,
                            programmatic)
               for name, signature in SIGNATURES.items()}
    return kernels, list(modules.values())
