"""A job's settings: JobConfig (files, job knobs, the EngineConfig, sampling defaults) and RayConfig.

Settings only: nothing here runs a job, so the CLI, job files and both executors can import it. The CLI flags and
job-file keys are derived from these fields and EngineConfig's (cli.py, jobs/file.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from tinyvllm.config import EngineConfig, check_settings, setting
from tinyvllm.io.readers import REQUEST_FIELDS, InputOptions
from tinyvllm.io.writer import PIECE_ROWS
from tinyvllm.sampling_params import SamplingParams

@dataclass
class RayConfig:
    address: str | None = setting(None, "Ray cluster address [default: $RAY_ADDRESS, else a local Ray]",
                                  flag="--ray-address")
    num_replicas: int | None = setting(None, "Ray: LLM replicas [default: one per GPU (cuda) or CPU (numpy)]",
                                       low=1, high=1 << 16)
    batch_size: int | None = setting(None, "Ray: rows per batch, the unit a dead replica's work is retried in "
                                     "[default: min(4 x max_num_seqs, an even share)]", low=1, high=1 << 24,
                                     flag="--ray-batch-size")
    cpus_per_replica: float = setting(1.0, "Ray: CPUs reserved per replica", low=0.0, high=1 << 16,
                                      flag="--ray-cpus-per-replica")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass
class JobConfig:
    input: Path
    output: Path
    model: Path | None = None  # None: the fetched default model
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: dict = field(default_factory=dict)  # SamplingParams fields: the defaults every row starts from
    chat: bool = setting(False, "send each `prompt` text as one user chat message")
    chat_template: str | None = setting(None, "a Jinja chat template file to use instead of the model's")
    chat_template_kwargs: str | None = setting(None, "template variables for every chat, a JSON object, e.g. "
                                               "'{\"enable_thinking\": false}' (a row's own keys win)")
    allow_unknown_fields: bool = setting(False, "drop unsupported request fields with one warning each, instead "
                                         "of making their rows error rows")
    keep_columns: str | None = setting(None, "carry only these input columns to the output (comma-separated) "
                                       "[default: all]")
    drop_input_columns: bool = setting(False, "carry none of the input's columns to the output")
    prompt_column: str | None = setting(None, "the input column that holds each row's prompt [default: prompt]")
    messages_column: str | None = setting(None, "the input column that holds each row's chat messages "
                                          "[default: messages]")
    limit: int | None = setting(None, "run only the first N rows of the input, for a quick look (a different job "
                                "from the whole input's: its output is not the whole job's)", low=1, high=1 << 62)
    output_token_ids: bool = setting(False, "add a completion_token_ids column")
    return_tokens_as_token_ids: bool = setting(False, "OpenAI batch output: name logprobs' tokens token_id:N "
                                               "(vLLM's flag), not by their text and bytes")
    logprobs: int | None = setting(None, "rows' default logprobs: fill the logprob columns with the top N per token",
                                   low=0, high=1 << 20)
    max_in_flight: int | None = setting(None, "requests in the engine at once [default: 4 x max_num_seqs]",
                                        low=1, high=1 << 24)
    piece_rows: int = setting(PIECE_ROWS, "rows per committed piece", low=1, high=1 << 24)
    prepare_workers: int | None = setting(None, "processes that read, chat-template and tokenize the rows ahead of "
                                          "the engine, off its Python thread (0: a thread of the job's process "
                                          "does it) [default: 1 for a job of 1000 rows or more to do, else 0]",
                                          low=0, high=1)
    overwrite: bool = setting(False, "start over: drop committed rows, replace a finished output")
    retry_errors: bool = setting(False, "compute the error rows of a finished (or interrupted) output again, "
                                 "keeping its other rows")
    quiet: bool = setting(False, "no progress bar or final line")
    ray: RayConfig | None = None  # set: run the engine work on Ray replicas
    chat_template_source: str | None = None  # the chat_template file's content (run_job reads it)
    input_label: str | None = None  # the input's name in the output's metadata where not its path ("-": stdin)

    def __post_init__(self) -> None:
        if isinstance(self.chat_template, Path):  # a job file's paths are resolved to Paths
            self.chat_template = str(self.chat_template)
        check_settings(self)
        if self.keep_columns is not None and self.drop_input_columns:
            raise ValueError("keep_columns and drop_input_columns contradict each other: give one")
        if self.overwrite and self.retry_errors:
            raise ValueError("overwrite and retry_errors contradict each other: give one")
        if self.keep_columns is not None and not self.kept_columns:
            raise ValueError(f"invalid keep_columns={self.keep_columns!r}: name at least one column")
        self.template_kwargs  # noqa: B018 (raises ValueError unless it is a JSON object)
        self._check_column_options()

    def _check_column_options(self) -> None:
        """prompt_column and messages_column name two different columns, neither another request field."""
        given = {"prompt_column": self.prompt_column, "messages_column": self.messages_column}
        for name, column in given.items():
            if column is not None and (not column or column in REQUEST_FIELDS - {name.removesuffix("_column")}):
                raise ValueError(f"invalid {name}={column!r}: " + ("name a column" if not column else
                                                                  "it is the name of another request field"))
        if self.prompt_column is not None and self.prompt_column == self.messages_column:
            raise ValueError(f"prompt_column and messages_column are both {self.prompt_column!r}: give two columns")

    @property
    def input_options(self) -> InputOptions:
        """How the job reads its input (which columns hold prompts and messages, how many rows)."""
        return InputOptions(self.prompt_column, self.messages_column, self.limit)

    @property
    def kept_columns(self) -> list[str] | None:
        """The input columns to carry, or None: all of them."""
        if self.keep_columns is None:
            return None
        return [name.strip() for name in self.keep_columns.split(",") if name.strip()]

    @property
    def template_kwargs(self) -> dict:
        """chat_template_kwargs as a dict; ValueError if it is not a JSON object."""
        if self.chat_template_kwargs is None:
            return {}
        try:
            kwargs = json.loads(self.chat_template_kwargs)
        except ValueError as e:
            raise ValueError(f"invalid chat_template_kwargs: not JSON ({e})") from None
        if not isinstance(kwargs, dict):
            raise ValueError("invalid chat_template_kwargs: must be a JSON object")
        return kwargs

    def sampling_params(self) -> SamplingParams:
        """The SamplingParams every row starts from (its own fields win); ValueError names a bad default."""
        logprobs = {} if self.logprobs is None else {"logprobs": self.logprobs}  # the job's setting wins
        return SamplingParams(**{**self.sampling, **logprobs})

    @property
    def in_flight_limit(self) -> int:
        """Requests inside one engine at once: enough queued to keep every batch slot busy."""
        return self.max_in_flight or 4 * self.engine.max_num_seqs


def job_config(settings: dict, sampling: dict, ray: dict | None) -> JobConfig:
    """A JobConfig from flat settings (JobConfig's and EngineConfig's fields side by side), as flags and job files
    give them. ValueError names a bad value."""
    engine_names = {f.name for f in fields(EngineConfig)}
    engine = EngineConfig(**{k: v for k, v in settings.items() if k in engine_names})
    job = {k: v for k, v in settings.items() if k not in engine_names}
    return JobConfig(**job, engine=engine, sampling=sampling, ray=RayConfig(**ray) if ray is not None else None)
