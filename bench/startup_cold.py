"""`LLM(MODEL)` start-up, seconds per phase, each run in a fresh interpreter (benchmark.run_startup): with an empty
kernel cache ("cold"), then warm; empty again with the model file dropped from the page cache ("cold, disk": a
fresh machine); and after `tinyvllm build-kernels` ("prebuilt": what `make setup` runs where nvcc is), whose own
time is given too.

    python bench/startup_cold.py MODEL [--backend cuda] [--json FILE]

Rows as `tinyvllm bench --startup`'s, and: `harness imports` (tinyvllm.benchmark's own: pyarrow, jobs; its
--startup counts them in `python start`), `exit` (after the tokens: the device closed, the interpreter's teardown;
in `python start` there too) and `LLM() ready`: from the process's start to LLM() returning, less the harness.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.benchmark import format_startup  # noqa: E402

# benchmark._STARTUP_CHILD, with the benchmark module's own imports (pyarrow, jobs: not LLM()'s) timed apart
CHILD = """
import json, sys, time
start = time.perf_counter()
import tinyvllm.llm
imports = time.perf_counter() - start
from tinyvllm.benchmark import startup_phases
harness = time.perf_counter() - start - imports
phases = startup_phases(sys.argv[1], sys.argv[2])
print(json.dumps({"python imports": imports, "harness imports": harness, **phases}))
"""
NOT_LLM = ("harness imports", "first token (one prompt)", "8 tokens (one prompt)")  # not part of LLM() ready


def drop_from_page_cache(model: Path) -> None:
    for path in model.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_startup(model: str, backend: str, env: dict[str, str]) -> dict[str, float]:
    """benchmark.run_startup's phases, with the process's exit apart: the child prints its phases once its tokens
    are out, and what comes after (the device closed, the interpreter's teardown) is `exit`; `LLM() ready` is the
    wall time from the process's start to LLM() returning, less the harness's own imports."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as errors:
        child = subprocess.Popen([sys.executable, "-c", CHILD, model, backend], stdout=subprocess.PIPE,
                                 stderr=errors, text=True, env=env)
        line = next((line for line in child.stdout if line.startswith("{")), None)
        printed = time.perf_counter() - start
        child.communicate()
        wall = time.perf_counter() - start
        if child.returncode != 0 or line is None:
            errors.seek(0)
            raise RuntimeError(f"start-up run failed: {(errors.read().strip().splitlines() or ['?'])[-1]}")
    phases = json.loads(line)
    ready = printed - sum(phases[name] for name in NOT_LLM if name in phases)
    return {"python start": printed - sum(phases.values()), **phases, "exit": wall - printed, "total": wall,
            "LLM() ready": ready}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # bytecode compiled once beforehand: a run measures start-up, not the first import of a fresh checkout
    subprocess.run([sys.executable, "-c", "import tinyvllm.llm, tinyvllm.benchmark"], check=True)
    runs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tinyvllm-kernels-") as root:
        def env(cache: str) -> dict[str, str]:
            return {**os.environ, "TINYVLLM_KERNEL_CACHE": str(Path(root) / cache)}

        def run(title: str, cache: str) -> None:
            runs[title] = run_startup(str(args.model), args.backend, env(cache))
            print(f"{title}: {runs[title]['total']:.2f} s", flush=True)

        run("cold", "a")
        run("warm", "a")
        drop_from_page_cache(args.model)
        run("cold, disk", "b")  # the file read from disk too
        start = time.perf_counter()
        built = subprocess.run([sys.executable, "-m", "tinyvllm", "build-kernels"], env=env("c"),
                               capture_output=True, text=True)
        build_seconds = time.perf_counter() - start
        print(f"tinyvllm build-kernels: {build_seconds:.2f} s, {(built.stdout + built.stderr).strip()}", flush=True)
        if built.returncode == 0:
            run("prebuilt", "c")  # after build-kernels
    print(f"start-up of {args.model} on backend {args.backend}, seconds per phase:")
    print(format_startup(runs))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "build-kernels seconds": build_seconds,
                                         "build-kernels output": (built.stdout + built.stderr).strip()}, indent=2))


if __name__ == "__main__":
    main()
