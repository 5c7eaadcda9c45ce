"""Job files (jobs/*.toml): the settings of a run, with command-line flags on top."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from tinyvllm.io import JobError
from tinyvllm.runner import JobConfig


def load_job_file(path: Path, flags: dict, sampling_flags: dict) -> JobConfig:
    """A JobConfig from a TOML job file, with the given flags (not None) on top. Relative paths in the file are
    resolved against the file's own folder; flags' paths against the current directory."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise JobError(f"job file not found: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise JobError(f"cannot read job file {path}: {e}") from None
    sampling = data.pop("sampling", {})
    if not isinstance(sampling, dict):
        raise JobError(f"{path}: [sampling] must be a table")
    ray_table = data.pop("ray", None)
    if ray_table is not None:
        from tinyvllm.ray_runner import RayConfig  # imports no ray: only the settings

        if not isinstance(ray_table, dict):
            raise JobError(f"{path}: [ray] must be a table")
        ray_table = RayConfig.from_table(ray_table, str(path))
    for key, value in [*data.items(), *(("sampling." + k, v) for k, v in sampling.items())]:
        expected = JOB_FILE_KEYS.get(key)
        if expected is None:
            raise JobError(f"{path}: unknown key {key!r} (known: {', '.join(JOB_FILE_KEYS)})")
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise JobError(f"{path}: {key} = {value!r} has the wrong type "
                           f"(expected {getattr(expected, '__name__', 'a number')})")
    for key in ("input", "output", "model"):
        if key in data:
            data[key] = Path(os.path.normpath(path.parent / data[key]))
    if ray_table is not None:
        data["ray"] = ray_table
    data.update({k: v for k, v in flags.items() if v is not None})
    sampling.update({k: v for k, v in sampling_flags.items() if v is not None})
    missing = [k for k in ("input", "output") if k not in data]
    if missing:
        raise JobError(f"{path}: no {' or '.join(missing)} (in the file or as a flag)")
    return JobConfig(**data, sampling=sampling)


JOB_FILE_KEYS: dict[str, type] = {
    "model": str, "input": str, "output": str, "backend": str, "batching": str, "max_num_seqs": int,
    "max_num_batched_tokens": int, "block_size": int, "num_kv_blocks": int, "max_model_len": int, "seed": int,
    "gpu_memory_utilization": (int, float), "enable_prefix_caching": bool, "enable_chunked_prefill": bool,
    "chat": bool, "output_token_ids": bool, "logprobs": int, "max_in_flight": int, "piece_rows": int,
    "sampling.max_tokens": int, "sampling.temperature": (int, float), "sampling.top_p": (int, float),
    "sampling.top_k": int, "sampling.min_p": (int, float), "sampling.seed": int, "sampling.stop": list,
}
