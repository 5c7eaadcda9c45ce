"""A cubin cache on disk and a parallel compile driver for cuda/*.cu (no CUDA needed: kernels.py hands it nvcc).

A compile job is one kernel file, or for the files of SPLIT_FILES (the longest to compile; most hold template
instances of which a model uses a few) one kernel of it: the job defines SELECT_KERNELS and KEEP_<kernel>
(common.cuh), so the file builds that kernel alone. A job costs ~0.7 s of CPU before any kernel (nvcc itself and
the CUDA headers), so the small files stay whole; a start-up waits for its longest job, the jobs run side by side.

An entry is keyed by a SHA-256 of everything that decides the binary: the file's source, every .cuh beside it (a
superset of what it includes), its -D defines and options, the compiler's version and the target arch. Entries live
in $TINYVLLM_KERNEL_CACHE, else $TINYVLLM_CACHE/kernels (default ~/.cache/tinyvllm/kernels, made owner-only if
missing); entries are world-readable, so a directory the users trust can be shared by pointing
TINYVLLM_KERNEL_CACHE at it. Each entry is written to a temporary name and renamed into place, so a reader never
sees half an entry; it carries the SHA-256 of its payload, so a damaged entry (or a symlink, which is never
followed) is a miss that is compiled again and replaced, never an error.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tinyvllm.backends.cuda.ops import DEFINES, SIGNATURES

log = logging.getLogger(__name__)

DIGEST_BYTES = 32  # SHA-256 of the payload, appended to each entry
SUFFIX = ".cubin"
OPTIONS = ("-O3", "-std=c++17")
SPLIT_FILES = ("attention_decode", "attention_prefill", "gemv", "sampling")  # a job per kernel (see the top)


@functools.cache
def cuda_dir() -> Path:
    """cuda/ of the source tree (an editable install), else where a wheel installs it (setup.cfg data_files); looked
    up at the first compile, not at import."""
    for candidate in (Path(__file__).resolve().parents[3] / "cuda", Path(sys.prefix) / "share" / "tinyvllm" / "cuda"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise RuntimeError("cannot find the CUDA kernel sources (cuda/*.cu); reinstall tinyvllm")



class KernelCompileError(RuntimeError):
    pass


def find_nvcc() -> str:
    """nvcc on PATH, else the CUDA toolkit's ($CUDA_HOME or /usr/local/cuda)."""
    found = shutil.which("nvcc")
    if found:
        return found
    candidate = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda") / "bin" / "nvcc"
    if candidate.is_file():
        return str(candidate)
    raise KernelCompileError("cannot find nvcc (the CUDA toolkit's compiler): put it on PATH or set CUDA_HOME")


def compiler_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout


def nvcc_compile(job: CompileJob, nvcc: str, arch: str, include_dir: Path) -> bytes:
    """The job compiled to a cubin for `arch` by an nvcc subprocess."""
    with tempfile.TemporaryDirectory(prefix="tinyvllm-nvcc-") as tmp:
        source, cubin = Path(tmp) / f"{job.name}.cu", Path(tmp) / f"{job.name}.cubin"
        source.write_text(job.source)
        command = [nvcc, "--cubin", f"-arch={arch}", f"-I{include_dir}", *job.options,
                   *(f"-D{name}={value}" for name, value in job.defines.items()), "-o", str(cubin), str(source)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelCompileError(f"compiling cuda/{job.name}.cu failed:\n{done.stderr.strip()}")
        return cubin.read_bytes()


def default_cache_dir() -> Path:
    """$TINYVLLM_KERNEL_CACHE, else the kernels/ folder of $TINYVLLM_CACHE (default ~/.cache/tinyvllm)."""
    if os.environ.get("TINYVLLM_KERNEL_CACHE"):
        return Path(os.environ["TINYVLLM_KERNEL_CACHE"])
    return Path(os.environ.get("TINYVLLM_CACHE") or Path.home() / ".cache" / "tinyvllm") / "kernels"


@dataclass(frozen=True)
class CompileJob:
    """One kernel file to compile: its source and what the compiler is told besides."""

    name: str  # the file's, or for a file of SPLIT_FILES the kernel's
    source: str
    defines: Mapping[str, int]
    options: Sequence[str]
    file: str = ""  # the kernel file (cuda/<file>.cu) the source is, if it is one


def cache_key(job: CompileJob, headers: Mapping[str, str], compiler_version: str, arch: str) -> str:
    """Hex SHA-256 of every input that decides the cubin (headers: name -> text of each .cuh)."""
    h = hashlib.sha256()
    parts = [job.name, job.source, *(f"{name}\0{text}" for name, text in sorted(headers.items())),
             *(f"-D{name}={value}" for name, value in sorted(job.defines.items())), *job.options, compiler_version,
             arch]
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no two part lists hash alike
        h.update(data)
    return h.hexdigest()


class KernelCache:
    """Cubins by key in one directory (created 0700 if missing)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def get(self, key: str) -> bytes | None:
        """The entry's payload, or None if it is missing, a symlink or damaged."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP):
                log.warning("kernel cache: cannot read %s: %s", self.path(key), exc)
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        payload, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
        if len(data) <= DIGEST_BYTES or hashlib.sha256(payload).digest() != digest:
            log.warning("kernel cache: %s is damaged; compiling it again", self.path(key))
            return None
        return payload

    def put(self, key: str, payload: bytes) -> None:
        """Store atomically (a new temporary file, then a rename over whatever is there, symlink included). A cache
        that cannot be written only costs the next run a compile."""
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=SUFFIX)
        except OSError as exc:
            log.warning("kernel cache: cannot write to %s: %s", self.dir, exc)
            return
        try:
            os.fchmod(fd, 0o644)  # readable by the users of a shared directory (mkstemp makes it 0600)
            with os.fdopen(fd, "wb") as f:
                f.write(payload + hashlib.sha256(payload).digest())
            os.replace(tmp, self.path(key))
        except OSError as exc:
            log.warning("kernel cache: cannot write %s: %s", self.path(key), exc)
            Path(tmp).unlink(missing_ok=True)


def build_all(jobs: Sequence[CompileJob], compile_job: Callable[[CompileJob], bytes], cache: KernelCache,
              headers: Mapping[str, str], compiler_version: str, arch: str,
              max_workers: int | None = None) -> dict[str, bytes]:
    """Every job's cubin: from the cache, else compiled (the misses in parallel, one compiler process per thread)
    and stored. A compile error propagates from the first job that failed."""
    keys = {job.name: cache_key(job, headers, compiler_version, arch) for job in jobs}
    cubins: dict[str, bytes] = {}
    misses = []
    for job in jobs:
        cached = cache.get(keys[job.name])
        if cached is None:
            misses.append(job)
        else:
            cubins[job.name] = cached
    if misses:
        misses.sort(key=lambda job: -len(job.source))  # the longest first (with fewer cores than jobs)
        workers = max_workers or min(len(misses), os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for job, cubin in zip(misses, pool.map(compile_job, misses)):
                cache.put(keys[job.name], cubin)
                cubins[job.name] = cubin
    log.info("cuda kernels: %d from the cache, %d compiled", len(jobs) - len(misses), len(misses))
    return cubins


def job_name(kernel: str) -> str:
    """The compile job that builds `kernel` (a name of SIGNATURES)."""
    file = SIGNATURES[kernel].file
    return kernel if file in SPLIT_FILES else file


def job_kernels(name: str) -> list[str]:
    """The kernels (of SIGNATURES) that the compile job `name` builds."""
    return [kernel for kernel in SIGNATURES if job_name(kernel) == name]


def compile_jobs(kernels: Iterable[str] | None = None) -> list[CompileJob]:
    """The jobs that build `kernels` (default: every kernel SIGNATURES names), each once, with the file's -D defines
    (and a split file's kernel selection)."""
    names = dict.fromkeys(job_name(kernel) for kernel in (SIGNATURES if kernels is None else kernels))
    jobs = []
    for name in names:
        file = SIGNATURES[job_kernels(name)[0]].file
        select = {"SELECT_KERNELS": 1, f"KEEP_{name}": 1} if name != file else {}
        jobs.append(CompileJob(name, (cuda_dir() / f"{file}.cu").read_text(), {**DEFINES.get(file, {}), **select},
                               OPTIONS, file))
    return jobs


def build_cubins(jobs: Sequence[CompileJob], arch: str, cache_dir: Path | None = None) -> dict[str, bytes]:
    """The jobs' cubins for `arch` through nvcc and the cache in cache_dir (default: default_cache_dir())."""
    nvcc, include_dir = find_nvcc(), cuda_dir()
    headers = {path.name: path.read_text() for path in sorted(include_dir.glob("*.cuh"))}
    return build_all(jobs, lambda job: nvcc_compile(job, nvcc, arch, include_dir),
                     KernelCache(cache_dir or default_cache_dir()), headers, compiler_version(nvcc), arch)
