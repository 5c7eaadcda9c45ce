"""Peak memory of a job against its input size: streaming input, bounded in-flight requests, pieces on disk.

    python bench/memory.py [--rows 10000,100000,1000000] [--model DIR]   (default: a tiny random model)

Each size runs `tinyvllm run` in a child process (numpy backend, 2 output tokens a row) and reports the child's
peak RSS and wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peak_rss_mib(model: Path, rows: int, workdir: Path) -> tuple[float, float]:
    src = workdir / f"in{rows}.jsonl"
    with open(src, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"row-{i}", "prompt": f"Item {i}: " + "xyz " * (i % 11)}) + "\n")
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "tinyvllm", "run", "--model", str(model),
                           "--input", str(src), "--output", str(workdir / f"out{rows}.parquet"), "--backend",
                           "numpy", "--max-tokens", "2", "--max-num-seqs", "128", "--quiet"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout.split()[-1]) / 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="10000,100000,1000000")
    parser.add_argument("--model", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = args.model
        if model is None:
            from tinyvllm.model.dummy import random_weights, save_hf_model_dir, tiny_config

            config = tiny_config()
            model = save_hf_model_dir(workdir / "tiny", config, random_weights(config))
        for rows in map(int, args.rows.split(",")):
            rss, wall = peak_rss_mib(model, rows, workdir)
            print(f"{rows:>9} rows: peak RSS {rss:7.1f} MiB, {wall:6.1f} s ({rows / wall:,.0f} rows/s)", flush=True)


if __name__ == "__main__":
    main()
