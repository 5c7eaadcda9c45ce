"""The `tinyvllm` command: run a batch job, fetch the default model."""

from __future__ import annotations

from pathlib import Path

import click

from tinyvllm import __version__
from tinyvllm.io.writer import PIECE_ROWS
from tinyvllm.runner import JobConfig, JobError, run_job

SAMPLING_OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop")

# Every option defaults to None (flags to False) so that a job file's value is overridden only by a flag given.
JOB_OPTIONS = [
    click.option("--model", type=click.Path(path_type=Path), help="HF model dir or .gguf [default: the fetched default model]"),
    click.option("--backend", type=click.Choice(["auto", "numpy", "cuda"]), help="[default: auto]"),
    click.option("--batching", type=click.Choice(["continuous", "static"]), help="[default: continuous]"),
    click.option("--max-num-seqs", type=click.IntRange(min=1), help="sequences per batch [default: 256]"),
    click.option("--max-num-batched-tokens", type=click.IntRange(min=1), help="tokens per step [default: 8192]"),
    click.option("--block-size", type=click.IntRange(min=1), help="KV cache block size in tokens [default: 16]"),
    click.option("--num-kv-blocks", type=click.IntRange(min=1), help="KV cache size [default: from memory]"),
    click.option("--max-model-len", type=click.IntRange(min=2), help="[default: the model's]"),
    click.option("--max-tokens", type=int, help="default per row [default: 16]"),
    click.option("--temperature", type=float, help="default per row; 0 = greedy [default: 1.0]"),
    click.option("--top-p", type=float, help="default per row [default: 1.0]"),
    click.option("--top-k", type=int, help="default per row; 0 = off [default: 0]"),
    click.option("--min-p", type=float, help="default per row [default: 0.0]"),
    click.option("--stop", multiple=True, help="stop string, repeatable (a row's `stop` replaces these)"),
    click.option("--seed", type=int, help="engine seed [default: 0]"),
    click.option("--chat", is_flag=True, default=None, help="send each `prompt` text as one user chat message"),
    click.option("--output-token-ids", is_flag=True, default=None, help="add a completion_token_ids column"),
    click.option("--logprobs", type=click.IntRange(min=0), help="add logprob columns with the top N per token"),
    click.option("--max-in-flight", type=click.IntRange(min=1), help="requests in the engine at once [default: 4 x max-num-seqs]"),
    click.option("--piece-rows", type=click.IntRange(min=1), help=f"rows per committed piece [default: {PIECE_ROWS}]"),
    click.option("--quiet", is_flag=True, help="no progress bar or final line"),
]


def job_options(f):
    for option in reversed(JOB_OPTIONS):
        f = option(f)
    return f


@click.group()
@click.version_option(__version__, prog_name="tinyvllm")
def main() -> None:
    """tinyvllm: offline batch inference for Llama-family models."""


@main.command()
@click.option("--input", "input_", required=True, type=click.Path(path_type=Path),
              help="prompts: .jsonl (plain or OpenAI batch) or .parquet")
@click.option("--output", required=True, type=click.Path(path_type=Path), help="the .parquet file to write")
@job_options
def run(input_: Path, output: Path, model: Path | None, quiet: bool, **options) -> None:
    """Run every row of INPUT through the model and write OUTPUT (Parquet) plus a .summary.json."""
    sampling = {k: options.pop(k) for k in SAMPLING_OPTIONS}
    sampling["stop"] = list(sampling["stop"]) or None
    cfg = JobConfig(input=input_, output=output, model=model or _default_model(), quiet=quiet,
                    sampling={k: v for k, v in sampling.items() if v is not None},
                    **{k: v for k, v in options.items() if v is not None})
    _run(cfg)


@main.command("fetch-default-model")
def fetch_default_model_cmd() -> None:
    """Download the default model (once) and print its path."""
    from tinyvllm.fetch import fetch_default_model

    click.echo(fetch_default_model())


def _run(cfg: JobConfig) -> None:
    try:
        summary = run_job(cfg)
    except JobError as e:
        raise click.ClickException(str(e)) from None
    if not cfg.quiet:
        tps = summary["output_tok_per_s"]
        click.echo(f"wrote {summary['rows']} rows ({summary['error_rows']} errors) to {cfg.output} in "
                   f"{summary['wall_time_s']:.1f}s, {tps if tps is not None else '-'} output tok/s", err=True)


def _default_model() -> Path:
    from tinyvllm.fetch import default_model_path

    path = default_model_path()
    if path is None:
        raise click.ClickException("no --model given and the default model is not fetched: "
                                   "run `tinyvllm fetch-default-model` (or `make run`) first")
    return path
