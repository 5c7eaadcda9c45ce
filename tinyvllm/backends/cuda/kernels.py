"""Compile cuda/*.cu with PyCUDA for this device's architecture and hand out the kernels, ready to launch.

PyCUDA runs on the device's primary context (pycuda.autoprimaryctx), the one the CUDA runtime and so cuBLAS use:
both see the same allocations and streams. Compiled modules are cached on disk by PyCUDA, keyed by source.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pycuda.autoprimaryctx  # noqa: F401  (makes the primary context current)
import pycuda.driver as cuda
from pycuda.compiler import SourceModule


def _cuda_dir() -> Path:
    """cuda/ of the source tree (an editable install), else where a wheel installs it (setup.cfg data_files)."""
    for candidate in (Path(__file__).resolve().parents[3] / "cuda", Path(sys.prefix) / "share" / "tinyvllm" / "cuda"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise RuntimeError("cannot find the CUDA kernel sources (cuda/*.cu); reinstall tinyvllm")


CUDA_DIR = _cuda_dir()

# file -> {kernel name: argument format (P pointer, i int32, f float32)}
SIGNATURES: dict[str, dict[str, str]] = {
    "embedding": {"embedding": "PPPi", "resolve_tokens": "PPPi"},
    "norm": {"rms_norm": "PPPPif"},
    "rope": {"rope": "PPPiii"},
    "activation": {"silu_and_mul": "PPi"},
    "cache": {"reshape_and_cache": "PPPPiii"},
    "attention_decode": {"attention_combine": "PPPi",
                         **{f"attention_decode_d{d}_r{r}": "PPPPPPPPPfiiiii" for d in (64, 128) for r in (8, 16)}},
    "attention_prefill": {f"attention_prefill_d{d}": "PPPPPiPPPPfiiii" for d in (64, 128)},
    "sampling": {"sample": "PPiPPPPP", "logprobs": "PPPPPii"},
    "gemv": {"gemv_bf16": "PPPiiiii", "gemv_f32": "PPPiiiii"},
}


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


@functools.cache
def load() -> dict[str, Kernel]:
    """Every kernel of cuda/*.cu, compiled (or taken from PyCUDA's cache) for this device."""
    kernels = {}
    for file, names in SIGNATURES.items():
        source = (CUDA_DIR / f"{file}.cu").read_text()
        try:
            module = SourceModule(source, arch=arch(), no_extern_c=True, include_dirs=[str(CUDA_DIR)],
                                  options=["-O3", "-std=c++17"])
        except cuda.CompileError as exc:
            raise RuntimeError(f"compiling cuda/{file}.cu failed:\n{exc.stderr}") from exc
        for name, arg_format in names.items():
            kernels[name] = Kernel(name, module.get_function(name), arg_format)
    return kernels
