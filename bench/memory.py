"""Peak memory of a job against its input size: streaming input, bounded in-flight requests, pieces on disk.

    python bench/memory.py [--rows 10000,100000,1000000] [--model DIR]   (default: a tiny random model)

Each size runs `tinyvllm run` in a child process (numpy backend, 2 output tokens a row) and reports the child's
peak RSS and wall time.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tinyvllm.benchmark import job_peak_rss


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
            rss, wall, _ = job_peak_rss(model, rows, workdir)
            print(f"{rows:>9} rows: peak RSS {rss:7.1f} MiB, {wall:6.1f} s ({rows / wall:,.0f} rows/s)", flush=True)


if __name__ == "__main__":
    main()
