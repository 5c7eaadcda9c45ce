"""Job input and output: streaming readers (JSONL, Parquet, OpenAI batch) and the crash-safe Parquet writer."""

from tinyvllm.errors import JobError
from tinyvllm.io.readers import Row, count_rows, read_rows
from tinyvllm.io.writer import PartsWriter, output_record

__all__ = ["JobError", "Row", "read_rows", "count_rows", "PartsWriter", "output_record"]
