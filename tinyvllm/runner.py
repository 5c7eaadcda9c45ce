"""A batch job: read rows -> submit to the engine (a bounded number in flight) -> write rows as they finish.

Memory stays bounded whatever the input size: rows are read lazily, at most `max_in_flight` requests live in the
engine, and finished rows go to disk in small pieces (see io/writer.py). The runner knows nothing of kernels.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from tinyvllm import __version__
from tinyvllm.io import JobError, PartsWriter, Row, count_rows, output_record, read_rows
from tinyvllm.io.writer import PIECE_ROWS, output_schema
from tinyvllm.sampling_params import SamplingParams

__all__ = ["JobConfig", "JobError", "run_job"]


@dataclass
class JobConfig:
    input: Path
    output: Path
    model: Path
    backend: str = "auto"
    batching: str = "continuous"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    seed: int = 0  # the engine's seed; a row's own `seed` makes a sampled row reproducible on its own
    sampling: dict = field(default_factory=dict)  # SamplingParams fields: the defaults every row starts from
    chat: bool = False  # a `prompt` text is sent as one user message through the chat template
    output_token_ids: bool = False
    logprobs: int | None = None
    max_in_flight: int | None = None  # requests inside the engine at once; default 4 x max_num_seqs
    piece_rows: int = PIECE_ROWS
    quiet: bool = False


def run_job(cfg: JobConfig) -> dict:
    """Run the job to the end; return its summary. Raises JobError for problems of the job as a whole."""
    try:
        defaults = SamplingParams(**cfg.sampling, logprobs=cfg.logprobs)
    except (TypeError, ValueError) as e:
        raise JobError(f"bad sampling defaults: {e}") from None
    rows = read_rows(cfg.input)  # checks the input now, before the model loads
    _check_output(cfg.output)
    llm = _load_llm(cfg)
    started = time.time()
    writer = PartsWriter(cfg.output, output_schema(cfg.output_token_ids, cfg.logprobs is not None), started,
                         piece_rows=cfg.piece_rows)
    done = writer.committed_rows()
    engine = llm.llm_engine
    max_in_flight = cfg.max_in_flight or 4 * cfg.max_num_seqs
    in_flight: dict[str, tuple[int, str, str | list[int]]] = {}  # request id -> (row, id, prompt sent)
    bar = tqdm(total=count_rows(cfg.input), initial=len(done), unit="row", file=sys.stderr, disable=cfg.quiet,
               dynamic_ncols=True)
    tokens = 0

    def finish(record: dict) -> None:
        nonlocal tokens
        writer.add(record)
        tokens += record["completion_tokens"]
        bar.update(1)

    def step() -> None:
        for out in engine.step():
            index, row_id, prompt = in_flight.pop(out.request_id)
            finish(output_record(index, row_id, prompt, out))
        writer.maybe_flush()
        bar.set_postfix_str(f"{tokens / max(time.time() - started, 1e-9):.1f} tok/s", refresh=False)
        if in_flight and not engine.has_unfinished_requests():
            raise RuntimeError(f"engine lost {len(in_flight)} request(s)")

    try:
        for row in rows:
            if row.index in done:
                continue
            if row.error is not None:
                finish(output_record(row.index, row.id, None, error=row.error))
                continue
            try:
                prompt, templated, params = _prepare(row, llm.tokenizer, defaults, cfg.chat)
            except ValueError as e:
                finish(output_record(row.index, row.id, None, error=str(e)))
                continue
            request_id = str(row.index)  # unique even where ids repeat
            engine.add_request(request_id, prompt, params, prompt_is_templated=templated)
            in_flight[request_id] = (row.index, row.id, prompt)
            while len(in_flight) >= max_in_flight:
                step()
        while in_flight:
            step()
    finally:
        writer.flush()
        bar.close()
    info = llm.info()
    metadata = {"model": info.get("model", str(cfg.model)), "backend": info.get("backend", cfg.backend),
                "batching": info.get("batching", cfg.batching), "engine": info, "sampling": asdict(defaults),
                "chat": cfg.chat, "input": str(cfg.input), "version": __version__,
                "start_time": _iso(started), "end_time": _iso(time.time())}
    return writer.finalize(metadata)


def _prepare(row: Row, tokenizer, defaults: SamplingParams, chat: bool) -> tuple[str | list[int], bool, SamplingParams]:
    """What to send for a row: (prompt, already templated?, its SamplingParams). ValueError: the row is bad."""
    params = defaults.with_overrides(row.overrides)
    messages = row.messages
    if messages is None and chat and isinstance(row.prompt, str):
        messages = [{"role": "user", "content": row.prompt}]
    if messages is None:
        return row.prompt, False, params
    try:
        return tokenizer.apply_chat_template(messages), True, params
    except Exception as e:  # a template may raise anything (jinja's raise_exception): it is this row's problem
        raise ValueError(f"chat template failed: {e}") from None


def _check_output(output: Path) -> None:
    if output.is_dir():
        raise JobError(f"output is a directory: {output}")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(f"cannot create output directory {output.parent}: {e.strerror}") from None
    if not os.access(output.parent, os.W_OK | os.X_OK):
        raise JobError(f"output directory is not writable: {output.parent}")


def _load_llm(cfg: JobConfig):
    if not Path(cfg.model).exists():
        raise JobError(f"model not found: {cfg.model}")
    from tinyvllm.llm import LLM  # heavy: only once the job is known to be runnable

    try:
        return LLM(cfg.model, backend=cfg.backend, batching=cfg.batching, max_num_seqs=cfg.max_num_seqs,
                   max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size,
                   max_model_len=cfg.max_model_len, num_kv_blocks=cfg.num_kv_blocks, seed=cfg.seed)
    except Exception as e:  # a bad config, missing weights, no GPU for backend=cuda, ...: the job cannot run
        raise JobError(f"cannot load model {cfg.model}: {e}".splitlines()[0]) from None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")
