"""Job input and output: streaming readers (JSONL, Parquet, OpenAI batch) and the crash-safe writer (Parquet, or
the OpenAI batch output JSONL)."""

from tinyvllm.errors import JobError
from tinyvllm.io.readers import Row, count_rows, input_columns, read_rows
from tinyvllm.io.writer import PartsWriter, output_record

__all__ = ["JobError", "Row", "read_rows", "count_rows", "input_columns", "PartsWriter", "output_record"]
