"""Compile cuda/*.cu for a device's architecture and hand out the kernels, ready to launch.

The files become cubins through kernel_cache.py (cached on disk across runs, compiled by parallel nvcc processes
when missing); driver.py loads them into the current context and launches their kernels, with programmatic
dependent launch on sm_90 and later. Which kernels each file holds, their argument types and the -D defines they
are compiled with come from ops.py, whose launchers launch them. Nothing here touches a GPU at import: a Device
(device.py) loads the kernels into its context and unloads them at its close.

Start-up builds only the kernels a model launches (needed_kernels: one head dim, one KV cache dtype and one decode
tile of the attention kernels' instances), on a thread of its own while the weights upload (build_in_background);
any other kernel is built and loaded at its first lookup (KernelTable). `tinyvllm build-kernels` fills the cache
with every kernel ahead of time (build_every_kernel), so that a first run compiles nothing.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path

from tinyvllm.backends.cuda import driver
from tinyvllm.backends.cuda.kernel_cache import (OPTIONS, CompileJob, build_cubins, compile_jobs,
                                                 default_cache_dir, find_nvcc, job_kernels, job_name)
from tinyvllm.backends.cuda.ops import HEAD_DIMS, SIGNATURES, decode_rows

__all__ = ["Kernel", "KernelTable", "build_every_kernel", "build_in_background", "compile_source",
           "needed_kernels"]

log = logging.getLogger(__name__)

# Files whose kernels a model uses only some of: a kernel of theirs is needed only as needed_kernels says.
ATTENTION_FILES = ("attention_decode", "attention_prefill")
FP8_WEIGHT_FILE = "fp8"  # the FP8 W8A8 kernels: needed only by a model with FP8 weights
COMBINE_QUANTIZE_KERNELS = {"attention_combine_quantize", "attention_combine_quantize_values"}  # and these
# The gate/up GEMVs of each MLP activation (ModelConfig.activation), by name prefix: a model needs its own only
GATED_GEMVS = {"silu": "gemv_swiglu_", "gelu_pytorch_tanh": "gemv_geglu_"}
MOE_FILE = "moe"  # the fused mixture-of-experts kernels: needed only by a model with experts


class Kernel:
    """A loaded kernel, called as launcher(grid, block, stream, *args); launch errors name it."""

    def __init__(self, name: str, function: int, arg_format: str, programmatic: bool, shared_bytes: int = 0) -> None:
        self.name = name
        self.launcher = driver.Launcher(function, arg_format, programmatic, shared_bytes)

    def __call__(self, grid: tuple[int, ...], block: tuple[int, int, int], stream, *args,
                 shared_bytes: int | None = None) -> None:
        """stream: a pycuda Stream, or None for the default stream; shared_bytes: this launch's dynamic shared
        memory (None: the kernel's declared amount)."""
        status = self.launcher(grid, block, stream.handle if stream is not None else 0, args, shared_bytes)
        if status != 0:
            raise RuntimeError(f"CUDA kernel {self.name} grid={grid} block={block} failed to launch: "
                               f"{driver.error_name(status)}")


def needed_kernels(head_dim: int, num_heads: int, num_kv_heads: int, fp8_kv_cache: bool,
                   fp8_weights: bool = False, activation: str = "silu", experts: bool = False,
                   invariant: bool = False) -> list[str]:
    """The kernels a model of these attention shapes launches: every kernel but the attention kernels' instances
    for other head dims, KV cache dtypes, decode tiles and modes (ops.py picks among them by the same rules; the
    batch-invariant forms and their merge with `invariant`), the FP8 weight kernels (and the attention merges that
    quantize) only for FP8 weights, of the gate/up GEMVs only the MLP activation's, and the MoE kernels only for a
    model with experts."""
    fp8, inv = "fp8_" if fp8_kv_cache else "", "_inv" if invariant else ""
    rows = decode_rows(num_heads // num_kv_heads)
    attention = {f"attention_decode_{fp8}d{head_dim}_r{rows}{inv}", f"attention_prefill_{fp8}d{head_dim}{inv}",
                 "attention_combine" + inv} if head_dim in HEAD_DIMS else set()
    if attention and fp8_weights and not invariant:  # the merge that quantizes O's input
        attention |= COMBINE_QUANTIZE_KERNELS
    return [name for name, signature in SIGNATURES.items()
            if (signature.file not in ATTENTION_FILES or name in attention)
            and (signature.file != FP8_WEIGHT_FILE or fp8_weights) and (signature.file != MOE_FILE or experts)
            and not any(name.startswith(prefix) for act, prefix in GATED_GEMVS.items() if act != activation)]


_built: dict[tuple[str, str], bytes] = {}  # (arch, job name) -> cubin, kept for the process
_built_lock = threading.Lock()


def cubins(arch: str, kernels: Iterable[str] | None = None) -> dict[str, bytes]:
    """The cubins of the jobs that build `kernels` (default: all) for `arch`, by job name: from this process's
    memory, else the disk cache, else compiled now (in parallel); host bytes, kept for the process so that a second
    Device of the same kind loads them without asking the cache again."""
    names = list(dict.fromkeys(job_name(kernel) for kernel in (SIGNATURES if kernels is None else kernels)))
    with _built_lock:
        missing = [name for name in names if (arch, name) not in _built]
    if missing:
        built = build_cubins(compile_jobs(kernel for name in missing for kernel in job_kernels(name)), arch)
        with _built_lock:
            _built.update({(arch, name): cubin for name, cubin in built.items()})
    return {name: _built[arch, name] for name in names}


def build_in_background(arch: str, kernels: Iterable[str]) -> Future:
    """Start building the cubins of `kernels` on a thread of its own: host work only (the cache, nvcc processes),
    so the caller goes on meanwhile (uploads the weights). The future's result: cubins(arch, kernels). A missing
    nvcc raises here, at once."""
    find_nvcc()
    kernels = list(kernels)
    future: Future = Future()

    def build() -> None:
        try:
            start = time.perf_counter()
            future.set_result(cubins(arch, kernels))
            log.info("cuda kernels: %d built for %s in %.2f s in the background", len(kernels), arch,
                     time.perf_counter() - start)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the kernels
            future.set_exception(exc)

    threading.Thread(target=build, name="tinyvllm-kernel-build", daemon=True).start()
    return future


class KernelTable(dict):
    """Kernel name -> Kernel, loaded into the current context (of a device of `arch`) job by job: load() loads the
    given kernels' modules; a kernel looked up before its module is loaded is built and loaded then (__missing__),
    so that a lookup of a loaded kernel, at every launch, is a plain dict's. Safe from several threads."""

    def __init__(self, arch: str, programmatic: bool) -> None:
        super().__init__()
        self.arch, self.programmatic = arch, programmatic
        self.modules: dict[str, int] = {}  # job name -> module, for driver.unload_module
        self._lock = threading.Lock()

    def __missing__(self, name: str) -> Kernel:
        if name not in SIGNATURES:
            raise KeyError(name)
        log.info("cuda kernels: %s built at its first launch", name)
        self.load([name])
        return dict.__getitem__(self, name)

    def load(self, kernels: Iterable[str] | None = None) -> None:
        """Load the modules of `kernels` (default: every kernel) not loaded yet."""
        with self._lock:
            wanted = [kernel for kernel in (SIGNATURES if kernels is None else kernels)
                      if job_name(kernel) not in self.modules]
            for name, cubin in cubins(self.arch, wanted).items():
                self.modules[name] = module = driver.load_module(cubin)
                for kernel in job_kernels(name):
                    signature = SIGNATURES[kernel]
                    self[kernel] = Kernel(kernel, driver.get_function(module, kernel), signature.arg_format,
                                          self.programmatic, signature.shared_bytes)


def compile_source(source: str, defines: Mapping[str, int], arch: str):
    """One kernel source (a variant under study, as bench/attention.py compiles), through the same cache, as a
    PyCUDA module of the current context."""
    import pycuda.driver as cuda

    compiled = build_cubins([CompileJob("source", source, defines, OPTIONS)], arch)
    return cuda.module_from_buffer(compiled["source"])


@functools.cache
def gpu_archs() -> list[str]:
    """The architectures (sm_XY) of the GPUs nvidia-smi lists, without a CUDA context; [] without nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    caps = [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []
    return list(dict.fromkeys("sm_" + cap.replace(".", "") for cap in caps if cap.replace(".", "").isdigit()))


def build_every_kernel(arch: str, cache_dir: Path | None = None) -> tuple[int, float, Path]:
    """Every kernel's cubin for `arch` into the cache (cache_dir, default the one runs read): what `tinyvllm
    build-kernels` and `make setup` do where nvcc is, so that a first run compiles nothing. Returns the jobs, the
    seconds taken and the cache directory."""
    start = time.perf_counter()
    directory = cache_dir or default_cache_dir()
    built = build_cubins(compile_jobs(), arch, directory)
    return len(built), time.perf_counter() - start, directory
