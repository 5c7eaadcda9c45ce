"""An input read from standard input (`--input -`): copied whole to a temporary file, which the job then reads like
any other input (two passes, its hash for the job's identity, Parquet's footer at its end).

The job is known by the content: piping the same bytes again resumes the job or finds it finished; other bytes
are another job. The copy is a JSONL or a Parquet file by its first bytes (Parquet's magic `PAR1`), in the
temporary folder ($TMPDIR), and is removed when the job ends.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tinyvllm.errors import JobError, JobUsageError

STDIN = "-"
PARQUET_MAGIC = b"PAR1"


def is_stdin(path: str | Path | None) -> bool:
    return path is not None and str(path) == STDIN


@contextmanager
def spooled_stdin(stream=None) -> Iterator[Path]:
    """The path of a temporary copy of all of `stream` (default: stdin's bytes), removed on exit. JobUsageError if
    stdin is a terminal (nothing piped in), JobError if the copy cannot be written."""
    stream = stream if stream is not None else sys.stdin.buffer
    if stream.isatty():
        raise JobUsageError("--input -: standard input is a terminal; pipe the input in, e.g. "
                            "`cat prompts.jsonl | tinyvllm run --input - ...`")
    head = stream.read(len(PARQUET_MAGIC))
    suffix = ".parquet" if head == PARQUET_MAGIC else ".jsonl"
    fd, name = tempfile.mkstemp(prefix="tinyvllm-stdin-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as copy:
            copy.write(head)
            shutil.copyfileobj(stream, copy, 1 << 20)
    except OSError as e:
        os.unlink(name)
        raise JobError(f"--input -: cannot copy standard input to {name}: {e.strerror}") from None
    try:
        yield Path(name)
    finally:
        os.unlink(name)
