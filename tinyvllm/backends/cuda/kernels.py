"""Compile cuda/*.cu with PyCUDA for this device's architecture and hand out the kernels, ready to launch.

PyCUDA runs on the device's primary context (pycuda.autoprimaryctx), the one the CUDA runtime and so cuBLAS use:
both see the same allocations and streams. Compiled modules are cached on disk by PyCUDA, keyed by source and
options. Which kernels each file holds, their argument types and the -D defines they are compiled with come from
ops.py, whose launchers launch them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from pathlib import Path

import pycuda.autoprimaryctx  # noqa: F401  (makes the primary context current)
import pycuda.driver as cuda
from pycuda.compiler import SourceModule

from tinyvllm.backends.cuda.ops import DEFINES, SIGNATURES


def _cuda_dir() -> Path:
    """cuda/ of the source tree (an editable install), else where a wheel installs it (setup.cfg data_files)."""
    for candidate in (Path(__file__).resolve().parents[3] / "cuda", Path(sys.prefix) / "share" / "tinyvllm" / "cuda"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise RuntimeError("cannot find the CUDA kernel sources (cuda/*.cu); reinstall tinyvllm")


CUDA_DIR = _cuda_dir()


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


def compile_source(source: str, defines: Mapping[str, int]) -> SourceModule:
    """A kernel file's source, compiled with the -D defines of its tile constants."""
    options = ["-O3", "-std=c++17", *(f"-D{name}={value}" for name, value in defines.items())]
    return SourceModule(source, arch=arch(), no_extern_c=True, include_dirs=[str(CUDA_DIR)], options=options)


@functools.cache
def load() -> dict[str, Kernel]:
    """Every kernel of cuda/*.cu, compiled (or taken from PyCUDA's cache) for this device."""
    modules = {}
    for file in dict.fromkeys(signature.file for signature in SIGNATURES.values()):
        try:
            modules[file] = compile_source((CUDA_DIR / f"{file}.cu").read_text(), DEFINES.get(file, {}))
        except cuda.CompileError as exc:
            raise RuntimeError(f"compiling cuda/{file}.cu failed:\n{exc.stderr}") from exc
    return {name: Kernel(name, modules[signature.file].get_function(name), signature.arg_format)
            for name, signature in SIGNATURES.items()}
