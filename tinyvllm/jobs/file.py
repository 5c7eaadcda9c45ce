"""Job files (jobs/*.toml): the settings of a run, with command-line flags on top.

The keys are derived from the settings' dataclasses: EngineConfig's and JobConfig's fields at the top level,
SamplingParams' defaults under [sampling], RayConfig's under [ray]. Values are checked by the same code as flags
(the dataclasses' __post_init__).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

from tinyvllm.config import EngineConfig, setting_type
from tinyvllm.errors import JobError
from tinyvllm.jobs.config import SAMPLING_DEFAULTS, JobConfig, RayConfig, job_config
from tinyvllm.sampling_params import SamplingParams

PATH_KEYS = ("input", "output", "model", "chat_template")


def _keys(cls, names=None) -> dict[str, type | tuple]:
    """TOML types of a settings dataclass's fields (a float setting also takes an integer)."""
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    out = {}
    for name in names or [f.name for f in dataclasses.fields(cls) if "help" in f.metadata]:
        text = str(hints[name])
        kind = list if text.startswith("list") else dict if text.startswith("dict") else setting_type(text)
        out[name] = (int, float) if kind is float else kind
    return out


ENGINE_KEYS = _keys(EngineConfig)
JOB_KEYS = {**{k: str for k in PATH_KEYS}, **_keys(JobConfig)}
SAMPLING_KEYS = {**_keys(SamplingParams, [k for k in SAMPLING_DEFAULTS if k != "structured_outputs"]),
                 "structured_outputs": dict}  # a table of StructuredOutputsParams' fields
RAY_KEYS = _keys(RayConfig)
JOB_FILE_KEYS: dict[str, type | tuple] = {**JOB_KEYS, **ENGINE_KEYS, **{f"sampling.{k}": v for k, v in SAMPLING_KEYS.items()},
                                          **{f"ray.{k}": v for k, v in RAY_KEYS.items()}}


def load_job_file(path: Path, flags: dict, sampling_flags: dict, ray_flags: dict | None = None) -> JobConfig:
    """A JobConfig from a TOML job file, with the given flags (not None) on top. Relative paths in the file are
    resolved against the file's own folder; flags' paths against the current directory."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise JobError(f"job file not found: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise JobError(f"cannot read job file {path}: {e}") from None
    for table in ("sampling", "ray"):
        if not isinstance(data.get(table, {}), dict):
            raise JobError(f"{path}: [{table}] must be a table")
    sampling, ray = data.pop("sampling", {}), data.pop("ray", None)
    flat = [*data.items(), *(("sampling." + k, v) for k, v in sampling.items()),
            *(("ray." + k, v) for k, v in (ray or {}).items())]
    for key, value in flat:
        expected = JOB_FILE_KEYS.get(key)
        if expected is None:
            raise JobError(f"{path}: unknown key {key!r} (known: {', '.join(JOB_FILE_KEYS)})")
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise JobError(f"{path}: {key} = {value!r} has the wrong type "
                           f"(expected {getattr(expected, '__name__', 'a number')})")
    for key in PATH_KEYS:
        if key in data:
            data[key] = Path(os.path.normpath(path.parent / data[key]))
    data.update({k: v for k, v in flags.items() if v is not None})
    sampling.update({k: v for k, v in sampling_flags.items() if v is not None})
    if ray_flags is not None:  # --ray or a Ray flag given
        ray = {**(ray or {}), **ray_flags}
    missing = [k for k in ("input", "output") if k not in data]
    if missing:
        raise JobError(f"{path}: no {' or '.join(missing)} (in the file or as a flag)")
    try:
        return job_config(data, sampling, ray)
    except ValueError as e:
        raise JobError(f"{path}: {e}") from None

