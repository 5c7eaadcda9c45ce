"""nvcc time of each kernel compile job, and the wall time of compiling a set of them side by side (no GPU needed).

    python bench/kernel_compile.py [--arch sm_90] [--workers N] [--parallel] [--json FILE]

Three sets: every kernel as whole files (one job per cuda/*.cu, every template instance in it), every kernel as the
cache builds them (kernel_cache.SPLIT_FILES split into a job per kernel: `tinyvllm build-kernels`), and the kernels
Llama-3.2-1B launches (kernels.needed_kernels: what `LLM()` waits for on an empty cache). Each job is compiled alone,
one after another (its own nvcc time); the set's wall on N workers is then estimated by handing the longest job
first to the first free worker, and with --parallel also measured (N nvcc processes, an empty cache).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.backends.cuda import kernel_cache  # noqa: E402
from tinyvllm.backends.cuda.kernels import needed_kernels  # noqa: E402
from tinyvllm.backends.cuda.ops import DEFINES, SIGNATURES  # noqa: E402


def whole_files() -> list[kernel_cache.CompileJob]:
    files = dict.fromkeys(signature.file for signature in SIGNATURES.values())
    return [kernel_cache.CompileJob(file, (kernel_cache.cuda_dir() / f"{file}.cu").read_text(), DEFINES.get(file, {}),
                                    kernel_cache.OPTIONS, file) for file in files]


def estimated_wall(seconds: list[float], workers: int) -> float:
    """The longest job first, each to the worker free first."""
    free = [0.0] * workers
    for s in sorted(seconds, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free)


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=1, help="each job's time: the least of this many compiles")
    parser.add_argument("--parallel", action="store_true", help="also measure each set compiled on --workers")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    nvcc, include = kernel_cache.find_nvcc(), kernel_cache.cuda_dir()
    headers = {path.name: path.read_text() for path in sorted(include.glob("*.cuh"))}
    sets = {"every kernel, whole files": whole_files(), "every kernel, as cached": kernel_cache.compile_jobs(),
            "Llama-3.2-1B's kernels": kernel_cache.compile_jobs(needed_kernels(64, 32, 8, False))}
    times: dict[str, float] = {}
    cpu: dict[str, float] = {}  # the nvcc processes' CPU seconds (user + system): what a loaded machine distorts least
    results = {}
    for title, jobs in sets.items():
        for job in jobs:
            if job.name not in times or title == "every kernel, whole files":
                before = child_cpu()
                times[job.name] = min(timed(lambda: kernel_cache.nvcc_compile(job, nvcc, args.arch, include))
                                      for _ in range(args.repeat))
                cpu[job.name] = (child_cpu() - before) / args.repeat
                print(f"  {job.name:<32} {times[job.name]:6.2f} s, CPU {cpu[job.name]:5.2f} s", flush=True)
        seconds = [times[job.name] for job in jobs]
        result = {"jobs": len(jobs), "nvcc seconds, one after another": sum(seconds),
                  "nvcc CPU seconds": sum(cpu[job.name] for job in jobs), "longest job": max(seconds),
                  f"estimated wall on {args.workers} workers": estimated_wall(seconds, args.workers)}
        if args.parallel:
            with tempfile.TemporaryDirectory() as cache:
                result[f"measured wall on {args.workers} workers"] = timed(lambda: kernel_cache.build_all(
                    jobs, lambda job: kernel_cache.nvcc_compile(job, nvcc, args.arch, include),
                    kernel_cache.KernelCache(Path(cache)), headers, kernel_cache.compiler_version(nvcc), args.arch,
                    max_workers=args.workers))
        results[title] = result
        print(f"{title}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in result.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"per job": times, "per job, CPU": cpu, "sets": results}, indent=2))


if __name__ == "__main__":
    main()
