"""The `tinyvllm` command: run a batch job (from flags or a job file), report on its output, fetch the default
model."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq

from tinyvllm.config import EngineConfig, setting_type
from tinyvllm.errors import JobError, JobUsageError
from tinyvllm.io.writer import LATENCIES, SUMMARY_COLUMNS, output_schema, sibling, summarize_output
from tinyvllm.jobs.config import SAMPLING_DEFAULTS, JobConfig, RayConfig, job_config
from tinyvllm.jobs.file import load_job_file
from tinyvllm.jobs.guard import OutputBusy
from tinyvllm.jobs.run import JobInterrupted, run_job
from tinyvllm.version import __version__

class JsonObject(click.ParamType):
    name = "JSON"

    def convert(self, value, param, ctx):
        try:
            parsed = json.loads(value) if isinstance(value, str) else value
        except ValueError as e:
            self.fail(f"not JSON: {e}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail("must be a JSON object", param, ctx)
        return parsed


# Defaults for every row's SamplingParams (a row's own fields win; SamplingParams checks the values). The engine's
# --seed is the job seed (a row's `seed` sets its own); the job-level --logprobs adds the logprob columns.
SAMPLING_OPTIONS = [
    click.option("--max-tokens", type=int, help="default per row [default: 16]"),
    click.option("--temperature", type=float, help="default per row; 0 = greedy [default: 1.0]"),
    click.option("--top-p", type=float, help="default per row [default: 1.0]"),
    click.option("--top-k", type=int, help="default per row; 0 = off [default: 0]"),
    click.option("--min-p", type=float, help="default per row [default: 0.0]"),
    click.option("--stop", multiple=True, help="stop string, repeatable (a row's `stop` replaces these)"),
    click.option("--n", type=int, help="completions per row [default: 1]"),
    click.option("--presence-penalty", type=float, help="[default: 0.0]"),
    click.option("--frequency-penalty", type=float, help="[default: 0.0]"),
    click.option("--repetition-penalty", type=float, help="[default: 1.0]"),
    click.option("--min-tokens", type=int, help="EOS and stop token ids cannot end a completion before [default: 0]"),
    click.option("--stop-token-ids", type=int, multiple=True, help="stop token id, repeatable"),
    click.option("--ignore-eos", is_flag=True, default=None, help="generate past EOS, up to max_tokens"),
    click.option("--include-stop-str-in-output", is_flag=True, default=None, help="keep the stop string in the text"),
    click.option("--skip-special-tokens/--keep-special-tokens", "skip_special_tokens", default=None,
                 help="leave special tokens out of the text [default: skip]"),
    click.option("--logit-bias", type=JsonObject(), help='JSON {token id: bias in [-100, 100]}, e.g. \'{"42": -100}\''),
    click.option("--allowed-token-ids", type=int, multiple=True, help="generate only these token ids, repeatable"),
    click.option("--bad-words", multiple=True, help="a word never to generate, repeatable"),
    click.option("--structured-outputs", type=JsonObject(),
                 help='constraint on every output, vLLM\'s fields: \'{"json": {schema}}\', regex, choice, grammar, '
                      "json_object (pip install 'tinyvllm[structured]')"),
    click.option("--json-schema", type=click.Path(dir_okay=False, path_type=Path),
                 help="a JSON schema file every output must match (--structured-outputs '{\"json\": ...}')"),
    click.option("--regex", help="a regex every output must match in full"),
    click.option("--choice", help="every output is one of these strings, comma-separated"),
]
SAMPLING_FLAGS = tuple(k for k in SAMPLING_DEFAULTS if k != "seed")
STRUCTURED_FLAGS = ("structured_outputs", "json_schema", "regex", "choice")  # at most one of these


def _setting_option(f: dataclasses.Field, annotation: str, flag: str | None = None):
    """A click option for a settings field: its flag, type and bounds from the field, its help and default shown.
    The option defaults to None (unset) so that a job file's value is overridden only by a flag given."""
    meta, kind = f.metadata, setting_type(annotation)
    flag = flag or "--" + f.name.replace("_", "-")
    shown = "" if f.default in (None, False) else f" [default: {'on' if f.default is True else f.default}]"
    help_text = meta["help"] + ("" if "[default:" in meta["help"] else shown)
    if kind is bool and f.name.startswith("enable_"):
        name = f.name.removeprefix("enable_").replace("_", "-")
        return click.option(f"--{name}/--no-{name}", f.name, default=None, help=help_text)
    if kind is bool:
        return click.option(flag, f.name, is_flag=True, default=None, help=help_text)
    if meta["choices"]:
        return click.option(flag, f.name, type=click.Choice(meta["choices"]), help=help_text)
    if kind is int:
        return click.option(flag, f.name, type=click.IntRange(meta["low"], meta["high"]), help=help_text)
    if kind is float:
        return click.option(flag, f.name, type=click.FloatRange(meta["low"], meta["high"], min_open=meta["low_open"]),
                            help=help_text)
    return click.option(flag, f.name, help=help_text)


def _settings_options(cls, flags: dict[str, str] | None = None) -> list:
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    return [_setting_option(f, str(hints[f.name]), (flags or {}).get(f.name))
            for f in dataclasses.fields(cls) if "help" in f.metadata and (flags is None or f.name in flags)]


JOB_OPTIONS = [
    click.option("--model", type=click.Path(path_type=Path),
                 help="HF model dir or .gguf [default: the fetched default model]"),
    *_settings_options(EngineConfig),
    *SAMPLING_OPTIONS,
    *_settings_options(JobConfig),
    click.option("--ray", is_flag=True, default=None, help="run on a Ray cluster (pip install 'tinyvllm[ray]')"),
    *_settings_options(RayConfig, {"address": "--ray-address", "num_replicas": "--num-replicas",
                                   "batch_size": "--ray-batch-size", "cpus_per_replica": "--ray-cpus-per-replica"}),
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
              help="prompts: .jsonl (plain or OpenAI batch) or .parquet; - reads standard input")
@click.option("--output", required=True, type=click.Path(path_type=Path),
              help="the file to write: .parquet, or .jsonl for the OpenAI Batch API's output format")
@job_options
def run(input_: Path, output: Path, **options) -> None:
    """Run every row of INPUT through the model and write OUTPUT (Parquet or OpenAI batch JSONL) plus a
    .summary.json.

    Killed or interrupted? Run the same command again: it resumes where it stopped."""
    flags, sampling, ray = _split(options)
    try:
        cfg = job_config({"input": input_, "output": output, **flags}, sampling, ray)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    _run(cfg)


@main.command()
@click.argument("job_file", type=click.Path(path_type=Path))
@click.option("--input", "input_", type=click.Path(path_type=Path), help="replaces the job file's input")
@click.option("--output", type=click.Path(path_type=Path), help="replaces the job file's output")
@job_options
def job(job_file: Path, input_: Path | None, output: Path | None, **options) -> None:
    """Run the job described by JOB_FILE (TOML, see jobs/example.toml); flags override its values.

    Relative paths inside the file are resolved against the file's folder, those of flags against the current
    directory. Rerunning a finished job does nothing; rerunning an interrupted one resumes it."""
    flags, sampling, ray = _split(options)
    try:
        cfg = load_job_file(job_file, {"input": input_, "output": output, **flags}, sampling, ray)
    except JobError as e:
        raise click.ClickException(str(e)) from None
    _run(cfg)


@main.command()
@click.argument("output", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def report(output: Path) -> None:
    """Print the figures of a finished OUTPUT and plot latency histograms and tokens over time next to it."""
    _check_report_input(output)
    try:
        summary = summarize_output(output)
        click.echo(json.dumps(summary, indent=2))
        try:
            import matplotlib
        except ImportError:
            click.echo("plots skipped: matplotlib is not installed (pip install 'tinyvllm[report]' or "
                       "pip install matplotlib)", err=True)
            return
        matplotlib.use("Agg")  # files only, no display
        for path in _plots(output):
            click.echo(f"wrote {path}", err=True)
    except (OSError, pa.ArrowException) as e:  # data pages damaged behind a readable footer
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise click.ClickException(f"cannot read {output}: {reason}") from None


def _check_report_input(output: Path) -> None:
    """ClickException (one line, exit 1) unless OUTPUT is a Parquet file with what a tinyvllm output holds."""
    try:
        schema = pq.read_schema(output)
    except (OSError, pa.ArrowException):
        raise click.ClickException(f"{output} is not a Parquet file") from None
    try:
        counts = json.loads((schema.metadata or {})[b"tinyvllm.counts"])
    except (KeyError, ValueError):
        counts = None
    if not isinstance(counts, dict):
        raise click.ClickException(f"{output} is not a tinyvllm output (no tinyvllm.counts metadata)")
    expected = output_schema()
    wrong = [name for name in SUMMARY_COLUMNS
             if name not in schema.names or schema.field(name).type != expected.field(name).type]
    if wrong:
        raise click.ClickException(f"{output} is not a tinyvllm output (columns missing or mistyped: "
                                   f"{', '.join(wrong)})")


@main.command()
@click.option("--model", type=click.Path(exists=True, path_type=Path), help="a real model instead of dummy weights")
@click.option("--dummy-weights", default="llama-3.2-1b", show_default=True,
              help="random weights of a known shape: llama-3.1-8b, qwen2.5-7b, llama-3.2-1b, smollm2-135m or tiny")
@click.option("--backend", type=click.Choice(["auto", "numpy", "cuda"]), default="auto", show_default=True)
@click.option("--workloads", default="W1,W2,W3,W4,W5", show_default=True, help="comma-separated subset")
@click.option("--scale", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="shrink the workloads' counts and lengths (e.g. 0.05 on a CPU)")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="also write the results as JSON")
@_settings_options(EngineConfig, {"cuda_graph_capture": "--cuda-graph-capture"})[0]
@click.option("--startup", is_flag=True,
              help="instead: time each start-up phase of --model (default: the fetched default model), twice in "
                   "fresh processes, the first with an empty kernel cache")
def bench(model: Path | None, dummy_weights: str, backend: str, workloads: str, scale: float, max_num_seqs: int,
          max_num_batched_tokens: int, json_path: Path | None, cuda_graph_capture: str, startup: bool) -> None:
    """Throughput and latency workloads (W1-W6, J1) against the machine's measured limits.

    HF transformers peers on the same requests: `python bench/run.py --peers static,compiled`."""
    if startup:
        _bench_startup(model, backend, json_path)
        return
    from tinyvllm.benchmark import dummy_model, format_results, run_benchmark
    from tinyvllm.llm import LLM
    from tinyvllm.model.loader import load_model

    try:
        loaded = load_model(model) if model else dummy_model(dummy_weights, text="J1" in workloads.split(","))
    except ValueError as e:  # an unknown --dummy-weights, or a model that does not load
        raise click.ClickException(str(e)) from None
    llm = LLM(loaded, backend=backend, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              max_model_len=min(4096, loaded.config.max_position_embeddings),
              **({"cuda_graph_capture": cuda_graph_capture} if cuda_graph_capture else {}))
    results = run_benchmark(llm, workloads.split(","), scale)
    click.echo(format_results(results))
    if json_path:
        json_path.write_text(json.dumps({**results, "llm": llm.info()}, indent=2, default=str))


def _bench_startup(model: Path | None, backend: str, json_path: Path | None) -> None:
    import os
    import tempfile

    from tinyvllm.benchmark import format_startup, run_startup
    from tinyvllm.fetch import default_model_path

    model = model or default_model_path()
    if model is None:
        raise click.ClickException("no model: give --model, or fetch the default one (tinyvllm fetch-default-model)")
    with tempfile.TemporaryDirectory(prefix="tinyvllm-kernels-") as kernels:
        env = {**os.environ, "TINYVLLM_KERNEL_CACHE": kernels}
        try:
            runs = {"1st (cold)": run_startup(str(model), backend, env),
                    "2nd (warm)": run_startup(str(model), backend, env)}
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
    click.echo(f"start-up of {model} on backend {backend}, seconds per phase:")
    click.echo(format_startup(runs))
    if json_path:
        json_path.write_text(json.dumps(runs, indent=2))


@main.command("eval", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("lm_eval_args", nargs=-1, type=click.UNPROCESSED)
def eval_(lm_eval_args: tuple[str, ...]) -> None:
    """Run lm-evaluation-harness tasks on tinyvllm (pip install 'tinyvllm[eval]'): `lm_eval run`'s options with
    --model tinyvllm, e.g. `tinyvllm eval --model_args pretrained=PATH,backend=numpy --tasks hellaswag`;
    model_args take LLM's keyword arguments. `tinyvllm eval --help` lists lm-eval's options."""
    try:
        from tinyvllm.eval.lm_eval_model import main as lm_eval_main
    except ImportError as e:
        raise click.ClickException(f"tinyvllm eval needs lm-eval: pip install 'tinyvllm[eval]' ({e})") from None
    try:
        lm_eval_main(list(lm_eval_args))
    except (ValueError, TypeError, OSError) as e:  # a bad model path, setting or model_args key
        raise click.ClickException(str(e).splitlines()[0]) from None


@main.command("fetch-default-model")
def fetch_default_model_cmd() -> None:
    """Download the default model (once) and print its path."""
    from tinyvllm.fetch import fetch_default_model

    click.echo(fetch_default_model())


def _split(options: dict) -> tuple[dict, dict, dict | None]:
    """CLI options -> (settings given, sampling defaults given, Ray settings given or None: no Ray)."""
    use_ray = options.pop("ray")
    ray = {f.name: options.pop(f.name) for f in dataclasses.fields(RayConfig)}
    ray = {k: v for k, v in ray.items() if v is not None}
    structured = _structured_flag({k: options.pop(k) for k in STRUCTURED_FLAGS})
    sampling = {k: options.pop(k) for k in SAMPLING_FLAGS if k != "structured_outputs"}
    sampling["structured_outputs"] = structured
    for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):  # repeatable: () when not given
        sampling[name] = list(sampling[name]) or None
    flags = {k: v for k, v in options.items() if v is not None}
    return flags, {k: v for k, v in sampling.items() if v is not None}, ray if use_ray or ray else None


def _structured_flag(given: dict) -> dict | None:
    """The structured_outputs default from whichever one of its flags was given."""
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise click.UsageError(f"give one of {', '.join('--' + k.replace('_', '-') for k in given)}")
    if "json_schema" in given:
        try:
            return {"json": json.loads(given["json_schema"].read_text())}
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise click.UsageError(f"--json-schema {given['json_schema']}: {e}") from None
    if "regex" in given:
        return {"regex": given["regex"]}
    if "choice" in given:
        return {"choice": [c for c in given["choice"].split(",") if c]}
    return given.get("structured_outputs")


def _run(cfg: JobConfig) -> None:
    try:
        if cfg.ray is not None:
            from tinyvllm.jobs.ray_executor import RayExecutor

            summary = run_job(cfg, RayExecutor(cfg.ray))
        else:
            summary = run_job(cfg)
    except JobInterrupted as e:
        click.echo(str(e), err=True)
        sys.exit(e.exit_code)
    except (OutputBusy, JobUsageError) as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(e.exit_code)
    except JobError as e:
        raise click.ClickException(str(e)) from None
    if summary.get("already_complete"):
        click.echo(f"already complete: {cfg.output} has {summary['rows']} rows ({summary['error_rows']} errors); "
                   "nothing to do (--overwrite to run it again)", err=True)
    elif not cfg.quiet:
        tps = summary["output_tok_per_s"]
        click.echo(f"wrote {summary['rows']} rows ({summary['error_rows']} errors) to {cfg.output} in "
                   f"{summary['wall_time_s']:.1f}s, {tps if tps is not None else '-'} output tok/s", err=True)
        if summary.get("structured_output_incomplete"):
            click.echo(f"{summary['structured_output_incomplete']} rows ran out of max_tokens (or met a stop string) "
                       "before their structured output was complete: see structured_output_complete", err=True)


def _plots(output: Path) -> list[Path]:
    import matplotlib.pyplot as plt
    import pyarrow.compute as pc

    table = pq.read_table(output, columns=["finish_reason", "completion_tokens", "finished_at", *LATENCIES])
    ok = table.filter(pc.not_equal(table.column("finish_reason"), "error"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, name in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms")):
        ax.hist(ok.column(name).drop_null().to_numpy(), bins=40)
        ax.set(title=name[:-3].upper(), xlabel="ms", ylabel="requests")
    latency = sibling(output, ".latency.png")
    fig.tight_layout()
    fig.savefig(latency, dpi=100)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    done = table.sort_by("finished_at")
    times = done.column("finished_at").to_numpy()
    ax.plot(times - times[0] if len(times) else times, done.column("completion_tokens").to_numpy().cumsum())
    ax.set(title="output tokens over time", xlabel="s since first row", ylabel="tokens (cumulative)")
    tokens = sibling(output, ".tokens.png")
    fig.tight_layout()
    fig.savefig(tokens, dpi=100)
    plt.close("all")
    return [latency, tokens]
