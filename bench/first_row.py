"""Wall time of a job until its first row is done, and to its end: what a user waits for.

    python bench/first_row.py [--repeat N] -- tinyvllm run --input examples/prompts.jsonl --output /tmp/x.parquet ...

Runs the command (N times, default 1) and watches its progress bar on stderr: the first row is done when the bar
first shows "1/". Prints one line per run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time

FIRST_ROW = re.compile(rb"\b1/\d+\b")


def first_row_seconds(command: list[str]) -> tuple[float | None, float, int]:
    """(seconds to the first finished row or None, seconds to the end, exit code) of one run of command."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen, first = b"", None
    while chunk := child.stderr.read1(4096):
        seen = seen[-64:] + chunk  # the bar redraws with \r: a match may straddle two reads
        if first is None and FIRST_ROW.search(seen):
            first = time.perf_counter() - start
    return first, time.perf_counter() - start, child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the job command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    for _ in range(args.repeat):
        first, total, code = first_row_seconds(command)
        shown = "-" if first is None else f"{first:.2f} s"
        print(f"first row {shown}, all rows {total:.2f} s, exit code {code}", flush=True)


if __name__ == "__main__":
    main()
