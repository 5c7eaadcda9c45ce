"""LLMProcessor: completions for a Ray Dataset you already have, one LLM per Ray replica (see docs/RAY.md).

It shares the job executor's replicas (jobs/ray_executor.py): a replica that dies is restarted and its batch run
again, in ever smaller chunks if it keeps dying, until a row that kills it every time becomes an error row.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pyarrow as pa

from tinyvllm.config import EngineConfig
from tinyvllm.io import Row
from tinyvllm.io.readers import BadRow, missing_as_none, parse_request
from tinyvllm.jobs.config import JobConfig, job_config
from tinyvllm.jobs import ray_executor
from tinyvllm.sampling_params import SamplingParams

__all__ = ["LLMProcessor"]

# The settings LLMProcessor takes: the engine's, the rows' sampling defaults and the result-shaping ones.
PROCESSOR_OPTIONS = (*(f.name for f in fields(EngineConfig)), "sampling", "chat", "output_token_ids", "logprobs")


class LLMProcessor:
    """Completions for a Ray Dataset you already have: `ds = LLMProcessor("model-dir", num_replicas=4)(ds)`.

    Rows are read like a job's input rows (`prompt` or `messages`, optional sampling columns such as `max_tokens`,
    or OpenAI batch `custom_id`/`body`); the dataset comes back, lazily, with its columns kept and the job output's
    result columns added (completion, finish_reason, prompt_tokens, completion_tokens, error, latencies, ...); a bad
    row gets finish_reason "error". Options: EngineConfig's fields (backend, max_num_seqs, seed, ...), `sampling={...}`
    (the rows' defaults), chat, output_token_ids, logprobs. A row without a seed of its own (nor in `sampling`) samples freshly.
    """

    def __init__(self, model: str | Path, *, num_replicas: int | None = None, batch_size: int | None = None,
                 cpus_per_replica: float = 1.0, **options) -> None:
        unknown = sorted(set(options) - set(PROCESSOR_OPTIONS))
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(unknown)} (known: {', '.join(PROCESSOR_OPTIONS)})")
        # JobConfig carries the engine and sampling settings; a processor has no input or output file of its own.
        sampling = options.pop("sampling", {})
        self.cfg = job_config({"input": Path(), "output": Path(), "model": Path(model), **options}, sampling, None)
        self.defaults = self.cfg.sampling_params()  # ValueError now, not later
        self.num_replicas, self.cpus_per_replica = num_replicas, cpus_per_replica
        self.batch_size = batch_size or self.cfg.in_flight_limit

    def __call__(self, ds):
        ray = ray_executor.import_ray()
        ray_executor.connect(ray, None)  # as Ray Data would on first use: the GPU count below needs the cluster
        gpus = ray_executor.gpus_per_replica(self.cfg.engine.backend)
        replicas = self.num_replicas or ray_executor.default_replicas(gpus, self.cpus_per_replica)
        log = ray.remote(num_cpus=0)(ray_executor.BatchLog).remote()
        return ray_executor.map_replicas(ds, _DatasetReplica, self.cfg, self.defaults, replicas, self.batch_size,
                                         self.cpus_per_replica, gpus, log=log)


class _DatasetReplica(ray_executor.Replica):
    """A user's batch in, the same batch out with the result columns added."""

    def __init__(self, cfg: JobConfig, defaults: SamplingParams, log) -> None:
        super().__init__(cfg, defaults, log)
        # The job output's columns but the row's number, id and prompt: the dataset has its own.
        self.results = [f for f in self.schema if f.name not in ("row", "id", "prompt")]
        self.rng = np.random.default_rng()  # fresh entropy: replicas must not all draw the same seeds

    def __call__(self, batch: pa.Table) -> pa.Table:
        clash = [f.name for f in self.results if f.name in batch.column_names]
        if clash:
            raise ValueError(f"the dataset already has column(s) {', '.join(clash)}: rename or drop them first")
        objs = batch.to_pylist()
        rows = [self._row(i, obj) for i, obj in enumerate(objs)]
        # A retried batch has the same content: its digest names it in the log.
        key = hashlib.blake2b(json.dumps(objs, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
        records = self.complete_logged(rows, key)
        for f in self.results:
            batch = batch.append_column(f, pa.array([r.get(f.name) for r in records], f.type))
        return batch

    def _row(self, i: int, obj: dict) -> Row:
        try:
            request = parse_request(missing_as_none(obj))
        except BadRow as e:
            return Row(i, str(i), error=str(e))
        if self.defaults.seed is None and "seed" not in request.overrides:
            request.overrides["seed"] = int(self.rng.integers(1 << 62))
        return Row(i, str(i), request.prompt, request.messages, request.overrides, request.chat_options)
