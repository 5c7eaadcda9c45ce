"""Loading a Llama-3.1-8B-shaped bf16 checkpoint in 4 shards: LLM(path) to ready against a plain read of its files.

    python bench/load_8b.py CHECKPOINT_DIR OUT_DIR [--backend cuda] [--shape llama-3.1-8b] [--shards 4]
        [--quantization fp8]

Writes the checkpoint (random bf16 weights, written as made: no float32) to CHECKPOINT_DIR unless it already holds
one of that shape, then measures in this run:
- the time to read every shard file sequentially into one buffer, with the files evicted from the page cache
  (fdatasync, then posix_fadvise DONTNEED; the share of their pages still cached is reported) and again warm;
- LLM(CHECKPOINT_DIR, backend=...) to ready, evicted and warm, each in a fresh interpreter: seconds per start-up
  phase (the weights' part, load_model + the upload, also on its own: without KV allocation or graph capture), and
  the peak host RSS above the resident set just before loading (VmHWM - VmRSS; the CUDA context and the imports are
  in the baseline, as tests/test_loader.py's RSS test counts them).
Goals (issue 14): load <= 2x the sequential read of the same files; peak RSS <= 2 GiB above the baseline.
Prints a table and writes OUT_DIR/load_8b.json. A tiny shape on the numpy backend tries it on a CPU:

    python bench/load_8b.py /tmp/ckpt /tmp/out --backend numpy --shape tiny
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyvllm.model.dummy import PRESETS, RandomBf16Weights, save_hf_model_dir  # noqa: E402

GIB = 1 << 30
READ_CHUNK = 64 << 20

# A fresh interpreter (argv: checkpoint dir, backend, quantization or "") loads the model; prints its phases, RSS
# and, on cuda, the KV cache's blocks and the GPU memory in use besides it, as JSON.
_LOAD_CHILD = """
import json, sys, time
def status_bytes(key):  # VmRSS: resident now; VmHWM: the peak of this process
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
start = time.perf_counter()
from tinyvllm.llm import LLM
from tinyvllm.model.loader import load_model
phases = {"python imports": time.perf_counter() - start}
if sys.argv[2] == "cuda":
    start = time.perf_counter()
    import tinyvllm.backends.cuda.runner  # noqa: F401  (pycuda; the backend times its context itself)
    phases["cuda imports"] = time.perf_counter() - start
baseline = status_bytes("VmRSS")
start = time.perf_counter()
model = load_model(sys.argv[1])
phases["load_model (headers, tokenizer)"] = time.perf_counter() - start
start = time.perf_counter()
llm = LLM(model, backend=sys.argv[2], max_model_len=min(4096, model.config.max_position_embeddings),
          quantization=sys.argv[3] or None)
ready = time.perf_counter() - start
gpu = {}
if sys.argv[2] == "cuda":
    free, total = llm.backend.device.mem_get_info()
    kv = llm.backend.num_blocks * llm.backend.kv_bytes_per_block()
    gpu = {"kv_blocks": llm.backend.num_blocks, "gpu_bytes_besides_kv": total - free - kv}
parts = getattr(llm.backend, "startup_times", {})
phases.update(parts)
phases["LLM, the rest"] = ready - sum(parts.values())
load = phases["load_model (headers, tokenizer)"] + ready
weights = phases["load_model (headers, tokenizer)"] + parts.get("weights upload", ready)
print(json.dumps({"phases": phases, "load_s": load, "weights_s": weights, "rss_baseline": baseline,
                  "rss_peak_above_baseline": status_bytes("VmHWM") - baseline, **gpu}))
"""


def write_checkpoint(path: Path, shape: str, shards: int) -> dict:
    """The checkpoint, written unless `path` already holds one of this shape and shard count."""
    config = PRESETS[shape]()
    marker = path / "load_8b_shape.json"
    wanted = {"shape": shape, "shards": shards}
    if marker.is_file() and json.loads(marker.read_text()) == wanted and shard_files(path):
        return {"written": False}
    for stale in [*shard_files(path), path / "model.safetensors.index.json"]:  # another shape's or shard count's
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    save_hf_model_dir(path, config, RandomBf16Weights(config), dtype="bfloat16", shards=shards)
    marker.write_text(json.dumps(wanted))
    return {"written": True, "write_s": time.perf_counter() - start}


def shard_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (written to the disk first: only clean pages can be dropped)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(files: list[Path]) -> float | None:
    """The share of the files' pages in the page cache (mincore on a mapping that touches none); None if unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        cached = total = 0
        for file in files:
            size = file.stat().st_size
            with open(file, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
                pages = -(-size // page)
                vec = (ctypes.c_ubyte * pages)()
                start = ctypes.c_char.from_buffer(mapped)
                status = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec)
                del start  # the buffer export must end before the map closes
                if status != 0:
                    return None
                cached += int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1))
                total += pages
        return cached / total
    except (OSError, AttributeError, ValueError, TypeError):
        return None


def sequential_read(files: list[Path]) -> dict:
    """Every byte of the files, in order, into one reused buffer: the disk's (or page cache's) plain read rate."""
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": total, "gb_s": total / seconds / 1e9}


def load_in_child(path: Path, backend: str, quantization: str | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", _LOAD_CHILD, str(path), backend, quantization or ""],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if done.returncode != 0:
        raise SystemExit(f"loading {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(path: Path, backend: str, quantization: str | None = None) -> dict:
    files = shard_files(path)
    results: dict = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
    if backend == "cuda":  # kernels compiled (or found in their cache) before anything is timed
        subprocess.run([sys.executable, "-c", "from tinyvllm.backends.cuda.device import Device; Device(0).kernels"],
                       check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    for state in ("cold", "warm"):
        if state == "cold":
            evict(files)
        results[f"cached_before_read_{state}"] = cached_fraction(files)
        results[f"read_{state}"] = sequential_read(files)
    for state in ("cold", "warm"):
        if state == "cold":
            evict(files)
        results[f"cached_before_load_{state}"] = cached_fraction(files)
        results[f"load_{state}"] = load_in_child(path, backend, quantization)
        load, read = results[f"load_{state}"], results[f"read_{state}"]["seconds"]
        load["vs_read"], load["weights_vs_read"] = load["load_s"] / read, load["weights_s"] / read
    return results


def format_table(r: dict) -> str:
    def cached(key: str) -> str:
        return "?" if r[key] is None else f"{r[key]:.0%}"

    lines = [f"{r['files']} shard files, {r['bytes'] / GIB:.2f} GiB",
             f"{'':<36}{'cold':>12}{'warm':>12}",
             f"{'pages cached before the read':<36}{cached('cached_before_read_cold'):>12}"
             f"{cached('cached_before_read_warm'):>12}",
             f"{'sequential read, s':<36}{r['read_cold']['seconds']:>12.2f}{r['read_warm']['seconds']:>12.2f}",
             f"{'sequential read, GB/s':<36}{r['read_cold']['gb_s']:>12.2f}{r['read_warm']['gb_s']:>12.2f}",
             f"{'pages cached before LLM()':<36}{cached('cached_before_load_cold'):>12}"
             f"{cached('cached_before_load_warm'):>12}"]
    cold, warm = r["load_cold"], r["load_warm"]
    for name in dict.fromkeys([*cold["phases"], *warm["phases"]]):
        lines.append(f"{'  ' + name + ', s':<36}{cold['phases'].get(name, float('nan')):>12.2f}"
                     f"{warm['phases'].get(name, float('nan')):>12.2f}")
    lines += [f"{'load (load_model + LLM), s':<36}{cold['load_s']:>12.2f}{warm['load_s']:>12.2f}",
              f"{'load / sequential read (goal <= 2)':<36}{cold['vs_read']:>12.2f}{warm['vs_read']:>12.2f}",
              f"{'load_model + upload, s':<36}{cold['weights_s']:>12.2f}{warm['weights_s']:>12.2f}",
              f"{'  / sequential read':<36}{cold['weights_vs_read']:>12.2f}{warm['weights_vs_read']:>12.2f}",
              f"{'peak RSS above baseline, GiB (<= 2)':<36}{cold['rss_peak_above_baseline'] / GIB:>12.2f}"
              f"{warm['rss_peak_above_baseline'] / GIB:>12.2f}",
              f"{'baseline RSS, GiB':<36}{cold['rss_baseline'] / GIB:>12.2f}{warm['rss_baseline'] / GIB:>12.2f}"]
    if "kv_blocks" in cold:
        lines += [f"{'KV cache blocks':<36}{cold['kv_blocks']:>12}{warm['kv_blocks']:>12}",
                  f"{'GPU memory besides the KV cache, GiB':<36}{cold['gpu_bytes_besides_kv'] / GIB:>12.2f}"
                  f"{warm['gpu_bytes_besides_kv'] / GIB:>12.2f}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="where the checkpoint is written (or found)")
    parser.add_argument("out", type=Path, help="where load_8b.json is written")
    parser.add_argument("--backend", default="cuda", choices=["cuda", "numpy"])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=list(PRESETS))
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--quantization", choices=["fp8"], help="LLM(quantization=...): the bf16 checkpoint in W8A8")
    args = parser.parse_args()
    start = time.perf_counter()
    written = write_checkpoint(args.checkpoint, args.shape, args.shards)
    print(f"checkpoint {args.checkpoint}: " + (f"written in {written['write_s']:.1f} s" if written["written"]
                                                else "already there"), flush=True)
    results = {"shape": args.shape, "backend": args.backend, "quantization": args.quantization, **written,
               **measure(args.checkpoint, args.backend, args.quantization)}
    results["goals_met"] = {"load_vs_read": results["load_cold"]["vs_read"] <= 2,
                            "peak_rss": max(results[f"load_{s}"]["rss_peak_above_baseline"]
                                            for s in ("cold", "warm")) <= 2 * GIB}
    results["total_s"] = time.perf_counter() - start
    print(format_table(results))
    print(f"goals met: {results['goals_met']}; this run took {results['total_s']:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load_8b.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
