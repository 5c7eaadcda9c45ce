"""What lets a killed job resume and a finished one be a no-op.

A job's identity is what must not change between a run and its resumption (the input's content and the settings
that shape the results). `<output>.parts/manifest.json` records it beside the committed pieces, and each piece
records it too (so a lost or damaged manifest is written again from them); the finished output's metadata records
it as well, so that rerunning a finished job finds it done (the job, and rows 0..N-1 each once) instead of
computing it again. Everything here that decides whether a job may start only reads, so that a run decides before
it loads the model and writes anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq

from tinyvllm.errors import JobError, JobUsageError
from tinyvllm.io.writer import (atomic_write, clear_parts, output_format, output_rows_problem, parts_dir,
                                schema_digest, summarize_output, summary_path)
from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.dummy import is_dummy
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.version import __version__

__all__ = ["finished_summary", "input_sha256", "input_stamp", "iso_time", "job_identity", "mark_retrying", "open_parts",
           "work_to_do"]


def job_identity(cfg: JobConfig, defaults: SamplingParams) -> dict:
    """What must not change between a run and its resumption: the input's content and what shapes the results.
    (Scheduling knobs and the backend may change: a job killed for memory can resume with a smaller batch; with
    batch_invariant on, its rows come out bitwise the same whatever the batch.)"""
    return {"input_size": cfg.input.stat().st_size, "input_sha256": input_sha256(cfg.input),
            "model": str(cfg.model) if is_dummy(cfg.model) else str(Path(cfg.model).resolve()),
            "max_model_len": cfg.engine.max_model_len, "seed": cfg.engine.seed,
            "sampling": asdict(defaults), "chat": cfg.chat, "output_token_ids": cfg.output_token_ids,
            "logprobs": cfg.logprobs,
            # how the OpenAI output names tokens (the identity of a job without it stays as it was)
            **({"return_tokens_as_token_ids": True} if cfg.return_tokens_as_token_ids else {}),
            "chat_template_sha256": (hashlib.sha256(cfg.chat_template_source.encode()).hexdigest()
                                     if cfg.chat_template_source is not None else None),
            "chat_template_kwargs": cfg.template_kwargs, "allow_unknown_fields": cfg.allow_unknown_fields,
            "keep_columns": cfg.kept_columns, "drop_input_columns": cfg.drop_input_columns,
            **cfg.input_options.identity(), "output_schema": schema_digest(),
            # on, it shapes the results bitwise (and the identity of a job without it stays as it was)
            **({"batch_invariant": True} if cfg.engine.batch_invariant else {})}


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


def work_to_do(cfg: JobConfig, job: dict, num_rows: int) -> bool:
    """Whether the job has rows to compute (False: `cfg.output` is its finished output, with no error rows to
    retry); JobError if the output, or the rows its parts folder holds, are another job's. It only reads, so that a
    run checks this before it loads the model, and again (finished_summary) once it holds the lock."""
    return not _is_finished(cfg, job, num_rows) or (cfg.retry_errors and _error_rows(cfg.output) > 0)


def finished_summary(cfg: JobConfig, job: dict, num_rows: int) -> dict | None:
    """The summary of `cfg.output` if it is this job's finished output (`already_complete` set), None if there is
    work to do (no output, --overwrite, or pieces of this job pending); JobError if the output is something else.
    (With --retry-errors and error rows in it, the caller takes the output's rows back.)"""
    if not _is_finished(cfg, job, num_rows):
        return None
    summary = _summary_of(cfg.output)
    clear_parts(parts_dir(cfg.output))  # left by a run killed while it removed them
    return summary


def _is_finished(cfg: JobConfig, job: dict, num_rows: int) -> bool:
    """Whether `cfg.output` is this job's finished output (False: there is work to do); JobError if the output or
    its parts' rows are another job's, or if --retry-errors cannot take the output's rows back."""
    if cfg.overwrite:
        return False
    if not cfg.output.exists():
        _parts_of(parts_dir(cfg.output), job)  # raises if they hold rows of another job
        return False
    problem = _finished_problem(cfg.output, job, num_rows)
    manifest, _ = _read_manifest(parts_dir(cfg.output))
    if problem is None and manifest is not None and manifest["job"] == job and manifest.get("retrying"):
        return False  # a --retry-errors run was stopped: its pieces hold the output's rows, some computed again
    if problem is None:
        if cfg.retry_errors:
            _error_rows(cfg.output)
        return True
    manifest, _, ours = _parts_of(parts_dir(cfg.output), job)
    if manifest is None and not ours:
        raise JobError(f"{cfg.output} exists {problem}; pass --overwrite to replace it")
    return False


def _error_rows(output: Path) -> int:
    """The error rows of this job's finished output; JobUsageError for an OpenAI JSONL output that has some: its
    lines do not keep what the output's other rows need (so --retry-errors cannot take them back)."""
    if output_format(output) == "parquet":
        column = pq.read_table(output, columns=["error"]).column("error")
        return len(column) - column.null_count
    errors = json.loads(summary_path(output).read_bytes())["error_rows"]
    if errors:
        raise JobUsageError(f"--retry-errors cannot take back the rows of the finished {output}: an OpenAI batch "
                            "output does not keep them whole; rerun with --overwrite, or write a .parquet output")
    return 0


def open_parts(cfg: JobConfig, job: dict) -> dict:
    """Create `<output>.parts/` with its manifest, or check that the one there is this job's (to resume); returns
    the manifest. A missing or damaged manifest is written again from the pieces, which record their job; a
    manifest of another job with no committed rows beside it is replaced."""
    parts = parts_dir(cfg.output)
    try:
        if cfg.overwrite:
            clear_parts(parts)
        manifest, damage, ours = _parts_of(parts, job)
        if manifest is not None:
            return manifest
        if ours:
            print(f"note: {damage or f'{parts} has no manifest.json'}: resuming from its {len(ours)} pieces, which "
                  "record this job", file=sys.stderr)
        manifest = {"job": job, "input": cfg.input_label or str(cfg.input),
                    "started_at": iso_time(min(ours.values(), default=time.time())), "version": __version__}
        _write_manifest(parts, manifest)
    except OSError as e:
        raise JobError(f"cannot prepare {parts}: {e.strerror}") from None
    return manifest


def _write_manifest(parts: Path, manifest: dict) -> None:
    atomic_write(parts / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=2).encode() + b"\n"), parts)


def mark_retrying(output: Path) -> None:
    """Note in the manifest that the pieces hold all of the finished output's rows but its error rows, which this
    run computes again (--retry-errors): a rerun resumes from the pieces instead of finding the output finished."""
    parts = parts_dir(output)
    try:
        manifest = {**json.loads((parts / "manifest.json").read_bytes()), "retrying": True}
        _write_manifest(parts, manifest)
    except (OSError, ValueError) as e:
        raise JobError(f"cannot update {parts / 'manifest.json'}: {getattr(e, 'strerror', None) or e}") from None


def _parts_of(parts: Path, job: dict) -> tuple[dict | None, str | None, dict[Path, float]]:
    """What `parts` holds for this job, reading only: (its manifest if it is this job's, what is wrong with the
    manifest there if it is damaged, {piece: its run's start} of the pieces that record this job). JobError if a
    piece holds rows of another job, or if pieces that record no job (whose job only a manifest can tell) are
    there without this job's manifest. Unreadable pieces count as none (the writer sets them aside)."""
    ours, unrecorded = {}, []
    for piece in sorted(parts.glob("piece-*.parquet")) if parts.is_dir() and not parts.is_symlink() else []:
        try:
            metadata = pq.read_schema(piece).metadata or {}
            started = json.loads(metadata[b"tinyvllm.run_started"])
            other = json.loads(metadata[b"tinyvllm.job"]) if b"tinyvllm.job" in metadata else None
        except Exception:  # pyarrow raises several types for a damaged file; a foreign one lacks our metadata
            continue
        if other is None:
            unrecorded.append(piece)
        elif other != job:
            raise JobError(f"cannot resume: {piece} holds rows of a different job ({_differences(other, job)}); rerun "
                           "with the original input and settings, or pass --overwrite to start over")
        else:
            ours[piece] = float(started)
    manifest, damage = _read_manifest(parts)
    if manifest is not None and manifest["job"] == job:
        return manifest, None, ours
    if unrecorded and manifest is not None:
        raise JobError(f"cannot resume: {parts} holds rows of a different job "
                       f"({_differences(manifest['job'], job)}); rerun with the original input and settings, "
                       "or pass --overwrite to start over")
    if unrecorded:
        raise JobError(f"cannot resume: {damage or f'{parts} has pieces but no manifest.json'}; pass --overwrite "
                       "to start over")
    return None, damage, ours


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


def _read_manifest(parts: Path) -> tuple[dict | None, str | None]:
    """The manifest in `parts` and None; (None, what is wrong with it) if it is damaged; (None, None) if there is
    none."""
    path = parts / "manifest.json"
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"{path} is damaged ({e})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("job"), dict):
        return None, f"{path} is damaged (no job in it)"
    return manifest, None


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
