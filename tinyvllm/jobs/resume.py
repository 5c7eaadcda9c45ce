"""What lets a killed job resume and a finished one be a no-op.

A job's identity is what must not change between a run and its resumption (the input's content and the settings
that shape the results). `<output>.parts/manifest.json` records it beside the committed pieces; the finished
output's metadata records it too, so that rerunning a finished job finds it done (the job, and rows 0..N-1 each
once) instead of computing it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq

from tinyvllm.errors import JobError
from tinyvllm.io.writer import (atomic_write, clear_parts, output_format, output_rows_problem, parts_dir,
                                schema_digest, summarize_output, summary_path)
from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.dummy import is_dummy
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.version import __version__

__all__ = ["finished_summary", "input_sha256", "input_stamp", "iso_time", "job_identity", "open_parts"]


def job_identity(cfg: JobConfig, defaults: SamplingParams) -> dict:
    """What must not change between a run and its resumption: the input's content and what shapes the results.
    (Scheduling knobs and the backend may change: a job killed for memory can resume with a smaller batch.)"""
    return {"input_size": cfg.input.stat().st_size, "input_sha256": input_sha256(cfg.input),
            "model": str(cfg.model) if is_dummy(cfg.model) else str(Path(cfg.model).resolve()),
            "max_model_len": cfg.engine.max_model_len, "seed": cfg.engine.seed,
            "sampling": asdict(defaults), "chat": cfg.chat, "output_token_ids": cfg.output_token_ids,
            "logprobs": cfg.logprobs,
            "chat_template_sha256": (hashlib.sha256(cfg.chat_template_source.encode()).hexdigest()
                                     if cfg.chat_template_source is not None else None),
            "chat_template_kwargs": cfg.template_kwargs, "allow_unknown_fields": cfg.allow_unknown_fields,
            "keep_columns": cfg.kept_columns, "drop_input_columns": cfg.drop_input_columns,
            **cfg.input_options.identity(), "output_schema": schema_digest()}


def input_sha256(path: Path) -> str | None:
    """The file's sha256; None if it is gone or unreadable (since the job started)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def input_stamp(path: Path) -> tuple | None:
    """What changes whenever the file's content does (its ctime cannot be set back), short of a change within one
    tick of the file system's clock, which the hash at the end of a run catches."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def iso_time(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def finished_summary(cfg: JobConfig, job: dict, num_rows: int) -> dict | None:
    """The summary of `cfg.output` if it is this job's finished output (`already_complete` set), None if there is
    work to do (no output, --overwrite, or pieces of this job pending); JobError if the output is something else."""
    if cfg.overwrite or not cfg.output.exists():
        return None
    problem = _finished_problem(cfg.output, job, num_rows)
    if problem is None:
        summary = _summary_of(cfg.output)
        clear_parts(parts_dir(cfg.output))  # left by a run killed while it removed them
        return summary
    manifest = _read_manifest(parts_dir(cfg.output))
    if manifest is None or manifest["job"] != job:
        raise JobError(f"{cfg.output} exists {problem}; pass --overwrite to replace it")
    return None


def open_parts(cfg: JobConfig, job: dict) -> dict:
    """Create `<output>.parts/` with its manifest, or check that the one there is this job's (to resume); returns
    the manifest."""
    parts = parts_dir(cfg.output)
    try:
        if cfg.overwrite:
            clear_parts(parts)
        manifest = _read_manifest(parts)
        if manifest is not None:
            if manifest["job"] != job:
                raise JobError(f"cannot resume: {parts} holds rows of a different job "
                               f"({_differences(manifest['job'], job)}); rerun with the original input and "
                               "settings, or pass --overwrite to start over")
            return manifest
        if any(parts.glob("piece-*.parquet")):
            raise JobError(f"cannot resume: {parts} has pieces but no manifest.json; pass --overwrite to start over")
        manifest = {"job": job, "input": cfg.input_label or str(cfg.input), "started_at": iso_time(time.time()),
                    "version": __version__}
        atomic_write(parts / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=2).encode() + b"\n"),
                     parts)
    except OSError as e:
        raise JobError(f"cannot prepare {parts}: {e.strerror}") from None
    return manifest


def _finished_problem(output: Path, job: dict, num_rows: int) -> str | None:
    """None if `output` is this job's finished output (its metadata names this job; rows 0..num_rows-1 each once),
    else what it is instead. An OpenAI JSONL output's metadata is in its summary, written after it."""
    try:
        if output_format(output) == "parquet":
            previous = json.loads((pq.read_schema(output).metadata or {})[b"tinyvllm.job"])
        else:
            previous = json.loads(summary_path(output).read_bytes())["metadata"]["job"]
    except Exception:  # not Parquet, or not ours; a JSONL output without its summary
        return "and is not a finished tinyvllm output"
    if previous != job:
        return f"from a different job ({_differences(previous, job)})"
    try:
        problem = output_rows_problem(output, num_rows)
    except Exception as e:  # pyarrow raises several types for damaged data
        problem = f"its rows cannot be read: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
    return None if problem is None else f"but is not complete: {problem}"


def _summary_of(output: Path) -> dict:
    """The summary of a finished output; written again if it is missing or damaged (the output holds it all)."""
    try:
        summary = json.loads(summary_path(output).read_text())
    except (OSError, ValueError):
        summary = summarize_output(output)
        try:
            atomic_write(summary_path(output), lambda f: f.write(json.dumps(summary, indent=2).encode() + b"\n"),
                         parts_dir(output))
        except OSError as e:
            raise JobError(f"cannot write {summary_path(output)}: {e.strerror}") from None
    return {**summary, "already_complete": True}


def _read_manifest(parts: Path) -> dict | None:
    """The manifest of the pieces in `parts` (None: there is none); JobError if it is damaged."""
    path = parts / "manifest.json"
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise JobError(f"cannot resume: {path} is damaged ({e}); pass --overwrite to start over") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("job"), dict):
        raise JobError(f"cannot resume: {path} is damaged (no job in it); pass --overwrite to start over")
    return manifest


def _differences(old: dict, new: dict) -> str:
    """The keys whose values differ, each as `key old -> new` (nested keys dotted, values cut at 60 characters);
    other output columns are said in words (their digest would tell a user nothing)."""
    if old.get("output_schema") != new.get("output_schema"):
        return "its output columns are another tinyvllm version's"
    old, new = _flat(old), _flat(new)
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(f"{k} {str(old.get(k))[:60]} -> {str(new.get(k))[:60]}" for k in keys)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out
