"""The `tinyvllm` command: run a batch job (from flags or a job file), report on its output, fetch the default
model."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import NoReturn

import click
import pyarrow as pa
import pyarrow.parquet as pq

from tinyvllm.config import EngineConfig, Setting, settings
from tinyvllm.errors import JobError
from tinyvllm.io.writer import (LATENCIES, SUMMARY_COLUMNS, output_schema, sibling, summarize_output,
                                summary_path)
from tinyvllm.jobs.config import JobConfig, RayConfig, job_config
from tinyvllm.jobs.file import load_job_file
from tinyvllm.jobs.run import JobInterrupted, run_job
from tinyvllm.model.dummy import PRESETS
from tinyvllm.sampling_params import SamplingParams
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


# The structured_outputs flag's shorthands (at most one of the four is given).
STRUCTURED_SHORTHANDS = [
    click.option("--json-schema", type=click.Path(dir_okay=False, path_type=Path),
                 help="a JSON schema file every output must match (--structured-outputs '{\"json\": ...}')"),
    click.option("--regex", help="a regex every output must match in full"),
    click.option("--choice", help="every output is one of these strings, comma-separated"),
]
STRUCTURED_FLAGS = ("structured_outputs", "json_schema", "regex", "choice")
# SamplingParams fields with a flag: the defaults of every row (a row's own fields win).
SAMPLING_FLAGS = tuple(s.name for s in settings(SamplingParams) if s.meta["flag"] is not False)
SAMPLING_PREFIX = "row default: "


def _setting_option(s: Setting, ranges: bool = True, shown: object = None, prefix: str = ""):
    """A click option for a setting: its flag, type and (with `ranges`) bounds from the declaration, its help with
    the default shown (`shown` instead of the declared default; False: none shown). The option defaults to None
    (unset), so that a job file's value is overridden only by a flag given."""
    meta, flag = s.meta, s.meta["flag"] or "--" + s.name.replace("_", "-")
    help_text = prefix + re.sub(r" \[default: [^]]*]", "", meta["help"]) if shown is not None else prefix + meta["help"]
    default = s.default if shown is None else shown
    hidden = default is None or default is False or (isinstance(default, (list, str)) and not default)
    if not hidden and "[default:" not in help_text:
        word = flag.partition("/")[0 if default else 2] if "/" in flag else "on" if default is True else default
        help_text += f" [default: {word}]"
    if s.kind is bool:
        pair = {} if "/" in flag else {"is_flag": True}
        return click.option(flag, s.name, **pair, default=None, help=help_text)
    if s.kind is None or s.container is dict:
        return click.option(flag, s.name, type=JsonObject(), help=help_text)
    if s.container is list:
        return click.option(flag, s.name, type=s.kind, multiple=True, help=help_text + " (repeatable)")
    if meta["choices"]:
        return click.option(flag, s.name, type=click.Choice(meta["choices"]), help=help_text)
    if s.kind is int and ranges:
        return click.option(flag, s.name, type=click.IntRange(meta["low"], meta["high"]), help=help_text)
    if s.kind is float and ranges:
        return click.option(flag, s.name, type=click.FloatRange(meta["low"], meta["high"], min_open=meta["low_open"]),
                            help=help_text)
    return click.option(flag, s.name, type=s.kind, help=help_text)


def _settings_options(cls, *, ranges: bool = True, show_defaults: bool = True, names=None, shown=None,
                      prefix: str = "") -> list:
    """The click options of a settings dataclass's fields that have a flag (`names`: only those)."""
    return [_setting_option(s, ranges, (shown or {}).get(s.name, None if show_defaults else False), prefix)
            for s in settings(cls) if s.meta["flag"] is not False and (names is None or s.name in names)]


def _job_options(show_defaults: bool) -> list:
    """Every setting's flag. Sampling flags are left to SamplingParams' checks (no click ranges), so that a bad
    default reads like a bad row."""
    return [
        click.option("--model", type=click.Path(path_type=Path),
                     help="HF model dir or .gguf" + (" [default: the fetched default model]" if show_defaults else "")),
        *_settings_options(EngineConfig, show_defaults=show_defaults),
        *_settings_options(SamplingParams, ranges=False, show_defaults=show_defaults, prefix=SAMPLING_PREFIX),
        *STRUCTURED_SHORTHANDS,
        *_settings_options(JobConfig, show_defaults=show_defaults),
        click.option("--ray", is_flag=True, default=None, help="run on a Ray cluster (pip install 'tinyvllm[ray]')"),
        *_settings_options(RayConfig, show_defaults=show_defaults),
    ]


def _with(options: list):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


class OneLineGroup(click.Group):
    """The commands, whose usage errors (a flag's bad value, an unknown or missing flag, flags a command's own checks
    refuse) are one line, `Error: ...` and where the flags are listed, exit 2, instead of click's usage, hint and
    error lines."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            if e.ctx is None or isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):
                raise
            hint = f" (see {e.ctx.command_path} --help)" if e.ctx.command.get_help_option(e.ctx) else ""
            raise click.UsageError(e.format_message() + hint) from None


@click.group(cls=OneLineGroup)
@click.version_option(__version__, prog_name="tinyvllm")
def main() -> None:
    """tinyvllm: offline batch inference for Llama-family models."""


@main.command()
@click.option("--input", "input_", required=True, type=click.Path(path_type=Path),
              help="prompts: .jsonl (plain or OpenAI batch) or .parquet; - reads standard input")
@click.option("--output", required=True, type=click.Path(path_type=Path),
              help="the file to write: .parquet, or .jsonl for the OpenAI Batch API's output format")
@_with(_job_options(show_defaults=True))
def run(input_: Path, output: Path, **options) -> None:
    """Run every row of INPUT through the model and write OUTPUT (Parquet or OpenAI batch JSONL) plus a
    .summary.json.

    Killed or interrupted? Run the same command again: it resumes where it stopped."""
    flags, sampling, ray = _split(options)
    try:
        cfg = job_config({"input": input_, "output": output, **flags}, sampling, ray)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    _run(cfg)


@main.command()
@click.argument("job_file", type=click.Path(path_type=Path))
@click.option("--input", "input_", type=click.Path(path_type=Path), help="replaces the job file's input")
@click.option("--output", type=click.Path(path_type=Path), help="replaces the job file's output")
@_with(_job_options(show_defaults=False))
def job(job_file: Path, input_: Path | None, output: Path | None, **options) -> None:
    """Run the job described by JOB_FILE (TOML; jobs/example.toml lists every key).

    The values come from the file. A flag given overrides the file's key of the same name: top-level keys for the
    engine and job flags, [sampling] for the row defaults (--max-tokens: max_tokens), [ray] for the Ray flags
    (--ray-address: address). A key neither in the file nor given as a flag takes its default (`tinyvllm run
    --help` shows them). Relative paths inside the file are resolved against the file's folder, those of flags
    against the current directory. Rerunning a finished job does nothing; rerunning an interrupted one resumes
    it."""
    flags, sampling, ray = _split(options)
    try:
        cfg = load_job_file(job_file, {"input": input_, "output": output, **flags}, sampling, ray)
    except JobError as e:
        _fail(e)
    _run(cfg)


@main.command()
@click.argument("output", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def report(output: Path) -> None:
    """Print the figures of a finished OUTPUT (.parquet, or .jsonl with its summary file) and plot latency
    histograms and tokens over time next to it."""
    openai = output.suffix == ".jsonl"
    if openai:
        _check_openai_output(output)
    else:
        _check_report_input(output)
    try:
        summary = _openai_summary(output) if openai else summarize_output(output)
        click.echo(json.dumps(summary, indent=2))
        try:
            import matplotlib
        except ImportError:
            click.echo("plots skipped: matplotlib is not installed (pip install 'tinyvllm[report]' or "
                       "pip install matplotlib)", err=True)
            return
        matplotlib.use("Agg")  # files only, no display
        table = _openai_plot_table(output) if openai else pq.read_table(output, columns=PLOT_COLUMNS)
        for path in _plots(output, table):
            click.echo(f"wrote {path}", err=True)
    except (OSError, ValueError, pa.ArrowException) as e:  # data pages damaged behind a readable footer
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise click.ClickException(f"cannot read {output}: {reason}") from None


PLOT_COLUMNS = ["finish_reason", "completion_tokens", "finished_at", *LATENCIES]


def _check_openai_output(output: Path) -> None:
    """ClickException (one line, exit 1) unless OUTPUT starts as a tinyvllm OpenAI batch output does."""
    try:
        with open(output, encoding="utf-8") as f:
            first = f.readline()
        line = json.loads(first) if first.strip() else {"id": "batch_req_", "custom_id": None, "response": None}
    except (OSError, UnicodeDecodeError, ValueError):
        line = None
    if not (isinstance(line, dict) and str(line.get("id", "")).startswith("batch_req_") and "custom_id" in line):
        raise click.ClickException(f"{output} is not a tinyvllm output (its first line is not an OpenAI batch "
                                   "output line)")


def _openai_summary(output: Path) -> dict:
    """The figures of a .jsonl output: its summary file, which the job wrote beside it (JSONL has no metadata of
    its own to hold the wall time and the settings)."""
    path = summary_path(output)
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise click.ClickException(f"{output} has no summary file {path}: it is written when the job finishes "
                                   "(run the job's command again to finish it)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise click.ClickException(f"cannot read {path}: {e}") from None
    if not isinstance(summary, dict) or "rows" not in summary:
        raise click.ClickException(f"{path} is not a tinyvllm summary (no rows count)")
    return summary


def _openai_plot_table(output: Path) -> pa.Table:
    """PLOT_COLUMNS of a .jsonl output's answered requests (an error line adds no tokens and has no latencies).
    finished_at is the body's `created`: whole seconds."""
    rows = []
    with open(output, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                response = json.loads(line).get("response")
            except (ValueError, AttributeError):
                raise ValueError(f"line {number} is not an OpenAI batch output line") from None
            body = response.get("body") if isinstance(response, dict) else None
            if not isinstance(body, dict):
                continue
            metrics, choices = body.get("metrics") or {}, body.get("choices") or [{}]
            rows.append({"finish_reason": choices[0].get("finish_reason"),
                         "completion_tokens": (body.get("usage") or {}).get("completion_tokens"),
                         "finished_at": body.get("created"), **{name: metrics.get(name) for name in LATENCIES}})
    schema = pa.schema([("finish_reason", pa.string()), ("completion_tokens", pa.int64()),
                        ("finished_at", pa.float64()), *((name, pa.float64()) for name in LATENCIES)])
    return pa.Table.from_pylist(rows, schema=schema)


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


# The engine settings the benchmarks take: all but the seed (the benchmarks' --seed makes their requests and weights).
BENCH_SETTINGS = tuple(s.name for s in settings(EngineConfig) if s.name != "seed")


def bench_options(workloads: str, json_path: str | None):
    """The options of `tinyvllm bench` and bench/run.py: what to run, and BENCH_SETTINGS' flags, shown with the
    benchmarks' defaults."""
    from tinyvllm.benchmark import BENCH_ENGINE, BENCH_MAX_MODEL_LEN

    shown = {**BENCH_ENGINE, "max_model_len": f"the model's, at most {BENCH_MAX_MODEL_LEN}"}
    return _with([
        click.option("--model", type=click.Path(exists=True, path_type=Path),
                     help="a real model instead of dummy weights"),
        click.option("--dummy-weights", default="llama-3.2-1b", show_default=True,
                     help=f"random weights of a known shape: {', '.join(PRESETS)}"),
        click.option("--workloads", default=workloads, show_default=True, help="comma-separated subset"),
        click.option("--scale", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
                     help="shrink the workloads' counts and lengths (e.g. 0.05 on a CPU)"),
        click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
                     help="of the workloads' random prompts and of the dummy weights"),
        click.option("--json", "json_path", type=click.Path(path_type=Path), default=json_path,
                     show_default=json_path is not None, help="also write the results as JSON"),
        *_settings_options(EngineConfig, names=BENCH_SETTINGS, shown=shown),
    ])


def bench_llm(options: dict):
    """The LLM of a benchmark's options (benchmark.bench_llm); ClickException (one line) if it cannot be made.
    Takes the model and engine options out of `options`, leaving the rest."""
    from tinyvllm.benchmark import bench_llm as build

    engine = {name: options.pop(name) for name in BENCH_SETTINGS}
    try:
        return build(options.pop("model"), options.pop("dummy_weights"), options["workloads"].split(","),
                     options["seed"], **engine)
    # an unknown --dummy-weights, a model that does not load, a setting it cannot meet; weights that do not fit
    except (ValueError, MemoryError) as e:
        raise click.ClickException(str(e).splitlines()[0]) from None


@main.command()
@bench_options("W1,W2,W3,W4,W5", None)
@click.option("--startup", is_flag=True,
              help="instead: time each start-up phase of --model (default: the fetched default model), twice in "
                   "fresh processes, the first with an empty kernel cache")
def bench(startup: bool, **options) -> None:
    """Throughput and latency workloads (W1-W6, J1) against the machine's measured limits.

    HF transformers peers on the same requests: `python bench/run.py --peers static,compiled` (the same options)."""
    if startup:
        _bench_startup(options["model"], options["backend"] or "auto", options["json_path"])
        return
    from tinyvllm.benchmark import format_results, run_benchmark

    llm = bench_llm(options)
    results = run_benchmark(llm, options["workloads"].split(","), options["scale"], options["seed"])
    click.echo(format_results(results))
    if options["json_path"]:
        options["json_path"].write_text(json.dumps({**results, "llm": llm.info()}, indent=2, default=str))


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
    # a bad model path, setting or model_args key; a backend this machine cannot run (its hint names run's flag); a
    # model that does not fit
    except (ValueError, TypeError, OSError, RuntimeError, ImportError, MemoryError) as e:
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = "--device cpu (or backend=numpy in --model_args)"
        raise click.ClickException(line.replace("--backend numpy", hint)) from None


@main.command("fetch-default-model")
def fetch_default_model_cmd() -> None:
    """Download the default model (once) and print its path."""
    from tinyvllm.fetch import fetch_default_model

    click.echo(fetch_default_model())


@main.command("build-kernels")
@click.option("--arch", "archs", multiple=True, metavar="sm_XY",
              help="the GPU architecture to build for (repeatable); default: those of the GPUs nvidia-smi lists")
def build_kernels_cmd(archs: tuple[str, ...]) -> None:
    """Compile every CUDA kernel into the kernel cache (needs nvcc, no GPU), so that a first run compiles none."""
    from tinyvllm.backends.cuda.kernel_cache import KernelCompileError
    from tinyvllm.backends.cuda.kernels import build_every_kernel, gpu_archs

    archs = archs or tuple(gpu_archs())
    if not archs:
        raise click.ClickException("no NVIDIA GPU listed by nvidia-smi: give the architecture, e.g. --arch sm_90")
    for arch in archs:  # every one checked before any compiles
        if not re.fullmatch(r"sm_\d+[a-z]?", arch):
            raise click.UsageError(f"--arch {arch!r} is not an architecture such as sm_90")
    for arch in archs:
        try:
            jobs, seconds, directory = build_every_kernel(arch)
        except KernelCompileError as e:
            raise click.ClickException(" ".join(str(e).splitlines()[:2])) from None
        click.echo(f"{jobs} kernel cubins for {arch} in {directory} ({seconds:.1f} s)")


def _split(options: dict) -> tuple[dict, dict, dict | None]:
    """CLI options -> (settings given, sampling defaults given, Ray settings given or None: no Ray)."""
    use_ray = options.pop("ray")
    ray = {f.name: options.pop(f.name) for f in dataclasses.fields(RayConfig)}
    ray = {k: v for k, v in ray.items() if v is not None}
    structured = _structured_flag({k: options.pop(k) for k in STRUCTURED_FLAGS})
    sampling = {k: options.pop(k) for k in SAMPLING_FLAGS if k != "structured_outputs"}
    sampling["structured_outputs"] = structured
    for s in settings(SamplingParams):  # a repeatable flag: () when not given
        if s.container is list and s.name in sampling:
            sampling[s.name] = list(sampling[s.name]) or None
    flags = {k: v for k, v in options.items() if v is not None}
    return flags, {k: v for k, v in sampling.items() if v is not None}, ray if use_ray or ray else None


def _structured_flag(given: dict) -> dict | None:
    """The structured_outputs default from whichever one of its flags was given."""
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise click.UsageError(f"give one of {', '.join('--' + k.replace('_', '-') for k in given)}")
    if "json_schema" in given:
        path = given["json_schema"]
        try:
            return {"json": json.loads(path.read_text())}
        except OSError as e:
            raise click.UsageError(f"cannot read --json-schema {path}: {e.strerror or e}") from None
        except (UnicodeDecodeError, ValueError) as e:
            raise click.UsageError(f"--json-schema {path} is not JSON: {e}") from None
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
    except JobError as e:
        _fail(e)
    if summary.get("already_complete"):
        click.echo(f"already complete: {cfg.output} has {_count(summary['rows'], 'row')} "
                   f"({_count(summary['error_rows'], 'error')}); nothing to do (--overwrite to run it again)",
                   err=True)
    elif not cfg.quiet:
        tps = summary["output_tok_per_s"]
        click.echo(f"wrote {_count(summary['rows'], 'row')} ({_count(summary['error_rows'], 'error')}) to "
                   f"{cfg.output} in {_seconds(summary)}, {tps if tps is not None else '-'} output tok/s", err=True)
        if summary.get("structured_output_incomplete"):
            click.echo(f"{_count(summary['structured_output_incomplete'], 'row')} ran out of max_tokens (or met a "
                       "stop string) before the structured output was complete: see structured_output_complete",
                       err=True)
        if summary.get("error_messages"):
            click.echo(_errors(summary), err=True)


def _fail(e: JobError) -> NoReturn:
    """One line, and the error's exit code: 2 for the settings (JobUsageError), 75 for a busy output, else 1."""
    click.echo(f"Error: {e}", err=True)
    sys.exit(e.exit_code)


def _seconds(summary: dict) -> str:
    """The job's wall time; after a resume, this run's and the sum over the runs that made the output."""
    total = f"{summary['wall_time_s']:.1f}s"
    if summary.get("runs", 1) <= 1:
        return total
    return f"{summary['run_wall_time_s']:.1f}s (this run; {total} over {summary['runs']} runs)"


def _errors(summary: dict, width: int = 60) -> str:
    """What the error rows were: the most common messages with their counts, each cut to about `width`."""
    messages = summary["error_messages"]
    named = [f'{n} x "{_shorten(message, width)}"' for message, n in messages]
    rest = summary["error_rows"] - sum(n for _, n in messages)
    if rest:
        named.append(f"{rest} other{'s' * (rest != 1)}")
    return f"{_count(summary['error_rows'], 'error row')}: {', '.join(named)}"


def _shorten(message: str, width: int) -> str:
    """The message on one line, cut at a word near `width` characters ("..." added)."""
    text = " ".join(message.split())
    if len(text) <= width:
        return text
    cut = text[:width - 3]
    space = cut.rfind(" ")
    return (cut[:space] if space > width // 2 else cut).rstrip(" ,;:") + "..."


def _count(n: int, noun: str) -> str:
    """'1 row', '2 rows'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _plots(output: Path, table: pa.Table) -> list[Path]:
    """Latency histograms and tokens over time of `table` (PLOT_COLUMNS), written next to the output."""
    import matplotlib.pyplot as plt
    import pyarrow.compute as pc

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
