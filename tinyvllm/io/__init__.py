"""Job input and output: streaming readers (JSONL, Parquet, OpenAI batch) and the crash-safe Parquet writer."""


class JobError(Exception):
    """A problem with the whole job (missing input, unreadable model, unwritable output): one line, non-zero exit."""


# Imported after JobError: both modules raise it.
from tinyvllm.io.readers import Row, count_rows, read_rows  # noqa: E402
from tinyvllm.io.writer import PartsWriter, output_record  # noqa: E402

__all__ = ["JobError", "Row", "read_rows", "count_rows", "PartsWriter", "output_record"]
