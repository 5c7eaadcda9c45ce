"""Job files (jobs/*.toml): the settings of a run, with command-line flags on top.

The keys are derived from the settings' declarations (`setting()` fields whose `job_key` is set): EngineConfig's and
JobConfig's at the top level, SamplingParams' under [sampling] (the defaults of every row), RayConfig's under [ray].
Values are checked by the same code as flags (the dataclasses' __post_init__); a job file that cannot be used is a
JobUsageError, exit 2, as a bad flag is.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from tinyvllm.config import EngineConfig, Setting, settings
from tinyvllm.errors import JobUsageError
from tinyvllm.jobs.config import JobConfig, RayConfig, job_config
from tinyvllm.names import nearest
from tinyvllm.sampling_params import SamplingParams

PATH_KEYS = ("input", "output", "model", "chat_template")


def toml_type(s: Setting) -> type | tuple:
    """What a TOML value of the setting may be (a float also takes an integer; `str | list[str]` either)."""
    if s.kind is None or s.container is dict:
        return dict  # a table: an own_type's fields (structured_outputs), or {token id: value}
    if s.container is list:
        return (str, list) if s.one_or_list else list
    return (int, float) if s.kind is float else s.kind


def _keys(cls, prefix: str = "") -> dict[str, type | tuple]:
    return {prefix + s.name: toml_type(s) for s in settings(cls) if s.meta["job_key"]}


JOB_FILE_KEYS: dict[str, type | tuple] = {**{k: str for k in PATH_KEYS}, **_keys(JobConfig), **_keys(EngineConfig),
                                          **_keys(SamplingParams, "sampling."), **_keys(RayConfig, "ray.")}


def _type_words(expected: type | tuple) -> str:
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
             dict: "a table"}
    return "a number" if expected == (int, float) else " or ".join(words[t] for t in (
        expected if isinstance(expected, tuple) else (expected,)))


def unknown_key(key: str) -> str:
    """One line for a key no job file takes, naming the key of its table it most likely misspells (names.nearest),
    else those of other tables it may be meant as (a [sampling] key written at the top level)."""
    table, _, name = key.rpartition(".")
    same_table = {k.rpartition(".")[2]: k for k in JOB_FILE_KEYS if k.rpartition(".")[0] == table}
    meant = nearest(name, same_table)
    near = [same_table[meant]] if meant is not None else [
        k for k in JOB_FILE_KEYS if k.rpartition(".")[0] != table and nearest(name, [k.rpartition(".")[2]])]
    hint = f"did you mean {' or '.join(near)}?" if near else "jobs/example.toml lists every key"
    return f"unknown key {key!r} ({hint})"


def load_job_file(path: Path, flags: dict, sampling_flags: dict, ray_flags: dict | None = None) -> JobConfig:
    """A JobConfig from a TOML job file, with the given flags (not None) on top. Relative paths in the file are
    resolved against the file's own folder; flags' paths against the current directory."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise JobUsageError(f"job file not found: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise JobUsageError(f"cannot read job file {path}: {e}") from None
    for table in ("sampling", "ray"):
        if not isinstance(data.get(table, {}), dict):
            raise JobUsageError(f"{path}: [{table}] must be a table")
    sampling, ray = data.pop("sampling", {}), data.pop("ray", None)
    flat = [*data.items(), *(("sampling." + k, v) for k, v in sampling.items()),
            *(("ray." + k, v) for k, v in (ray or {}).items())]
    for key, value in flat:
        expected = JOB_FILE_KEYS.get(key)
        if expected is None:
            raise JobUsageError(f"{path}: {unknown_key(key)}")
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise JobUsageError(f"{path}: {key} = {value!r} has the wrong type (expected {_type_words(expected)})")
    if "logprobs" in sampling:  # the job's `logprobs` setting, spelled as the SamplingParams field
        if data.setdefault("logprobs", sampling["logprobs"]) != sampling["logprobs"]:
            raise JobUsageError(f"{path}: logprobs = {data['logprobs']} and sampling.logprobs = "
                                f"{sampling['logprobs']} disagree: give one")
        del sampling["logprobs"]
    for key in PATH_KEYS:
        if key in data:
            data[key] = Path(os.path.normpath(path.parent / os.path.expanduser(data[key])))
    data.update({k: v for k, v in flags.items() if v is not None})
    sampling.update({k: v for k, v in sampling_flags.items() if v is not None})
    if ray_flags is not None:  # --ray or a Ray flag given
        ray = {**(ray or {}), **ray_flags}
    missing = [k for k in ("input", "output") if k not in data]
    if missing:
        raise JobUsageError(f"{path}: no {' or '.join(missing)} (in the file or as a flag)")
    try:
        return job_config(data, sampling, ray)
    except ValueError as e:
        raise JobUsageError(f"{path}: {e}") from None

