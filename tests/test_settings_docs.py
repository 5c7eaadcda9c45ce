"""The docs agree with the settings' declarations: README's tables of SamplingParams' fields and EngineConfig's
settings, README's CLI block, and jobs/example.toml's keys (every job-file key, and no other)."""

import re
from pathlib import Path

from tinyvllm.cli import main
from tinyvllm.config import EngineConfig, settings
from tinyvllm.fetch import DEFAULT_MODEL_FILE
from tinyvllm.jobs.file import JOB_FILE_KEYS
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
EXAMPLE = (ROOT / "jobs" / "example.toml").read_text()


def table_rows(cls) -> list[str]:
    """README's rows for a settings dataclass, as made from its declarations."""
    rows = []
    for s in settings(cls):
        flag = s.meta["flag"]
        flag = "-" if flag is False else f"`{flag or '--' + s.name.replace('_', '-')}`"
        meaning = s.meta["help"].replace("|", "\\|")  # a cell's own | (as in <|im_end|>) escaped
        rows.append(f"| `{s.name}` | `{s.default!r}` | {meaning} | {flag} |")
    return rows


def readme_rows(first_cell: str) -> list[str]:
    """The rows of README's table whose header row begins with `first_cell`."""
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_cell} | default |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_readme_tables_are_the_declarations():
    for cls, header in ((SamplingParams, "field"), (EngineConfig, "setting")):
        expected = table_rows(cls)
        assert readme_rows(header) == expected, (
            f"README's {cls.__name__} table differs from the declarations; it should read:\n" + "\n".join(expected))


def example_keys() -> set[str]:
    """Every key example.toml names, set or commented out, with its table's prefix (structured_outputs' fields
    apart)."""
    keys, table = set(), ""
    for line in EXAMPLE.splitlines():
        header = re.match(r"#?\s*\[([a-z_.]+)\]\s*$", line)
        if header:
            table = header.group(1)
            if "." in table:  # a key whose value is a table: [sampling.structured_outputs]
                keys.add(table)
            continue
        key = re.match(r"#?\s*([a-z_]+) = ", line)
        if key:
            keys.add(f"{table}.{key.group(1)}" if table else key.group(1))
    return keys


def test_example_job_file_names_every_key_and_no_other():
    keys = example_keys()
    structured = {k for k in keys if k.startswith("sampling.structured_outputs.")}
    assert set(JOB_FILE_KEYS) - keys == set(), "job-file keys example.toml does not show"
    assert keys - structured - set(JOB_FILE_KEYS) == set(), "keys in example.toml that no job file takes"
    fields = {f"sampling.structured_outputs.{name}" for name in StructuredOutputsParams.__dataclass_fields__}
    assert structured and structured <= fields


def test_example_model_is_where_the_fetch_puts_it():
    model = re.search(r'^# model = "([^"]+)"', EXAMPLE, re.M).group(1)
    assert model == f"~/.cache/tinyvllm/{DEFAULT_MODEL_FILE}"  # fetch.default_model_cache_dir without $TINYVLLM_CACHE


def test_readme_cli_block_names_every_run_flag():
    block = README.split("## CLI", 1)[1].split("```", 2)[1]
    flags = [opt for p in main.commands["run"].params for opt in (*p.opts, *p.secondary_opts) if opt != "--help"]
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![a-z-])", block)]
    assert missing == [], f"flags README's CLI block does not show: {missing}"
