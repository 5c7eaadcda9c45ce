"""A job on a Ray cluster (Ray Data, one LLM per replica), and LLMProcessor for a Ray Dataset you already have.

A job (`tinyvllm run --ray`): the driver reads and checks the input exactly as a single-machine run does (bad rows
become error rows right there), puts the good rows into Ray's object store in blocks of `batch_size` rows, and Ray
Data streams the blocks through a pool of actors that each hold one LLM (one GPU each on cuda). Finished batches
stream back to the driver, which commits them with the single-machine writer: same output file, schema, metadata,
summary, lock and resume.

Exactly once, per input row: a replica returns a batch's records only when the whole batch is done, so a replica
that dies mid-batch has emitted none of it; Ray Data restarts the actor and runs the batch again. Rows sample with
seeds derived from the job seed and the row number, so a rerun row gives the text the lost attempt would have. The
driver keeps the first record of each row number (any repeat is dropped) and will not finish the job while a row
is missing. A driver that dies keeps its committed rows: the same command resumes.

A row that kills its replica every time (the OOM killer, a crash in the backend) would have its batch retried
forever; instead a batch that killed a replica is run again in ever smaller chunks (halved each attempt), the
finished chunks' records kept in a small actor beside the driver (BatchLog), until the row is run alone: if it
kills the replica again, it becomes an error row and the job goes on. LLMProcessor does the same for a dataset.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterable

import pyarrow as pa

from tinyvllm.errors import JobError
from tinyvllm.io import Row, output_record
from tinyvllm.io.writer import output_schema
from tinyvllm.jobs.config import JobConfig, RayConfig
from tinyvllm.jobs.run import complete_rows, load_job_tokenizer, load_llm, record_extras
from tinyvllm.sampling_params import SamplingParams

__all__ = ["RayExecutor"]

INSTALL_HINT = "pip install 'tinyvllm[ray]'"
STAGED_SCHEMA = pa.schema([("row", pa.int64()), ("id", pa.string()), ("request", pa.string())])
# A job replica's {"replica", "info": LLM.info(), "stats": LLM.stats()} on the first row of each batch: the driver
# keeps the latest per replica (a restarted actor counts as a new one) for the output's metadata.
ENGINE_COLUMN = "__tinyvllm_engine"


class RayExecutor:
    """jobs.run.LocalExecutor's counterpart: rows through a pool of Ray actors holding one LLM each."""

    def __init__(self, ray_cfg: RayConfig) -> None:
        self.ray = import_ray()  # no Ray: say how to install it before anything else
        self.ray_cfg = ray_cfg
        self.started_ray = False

    def __enter__(self) -> RayExecutor:
        # Entered before the job's signal handlers: ray.init installs its own SIGTERM handler.
        self.started_ray = connect(self.ray, self.ray_cfg.address)
        return self

    def __exit__(self, *exc) -> None:
        if self.started_ray:
            self.ray.shutdown()

    def start(self, cfg: JobConfig) -> None:
        """Nothing to load here: each replica loads the model when it starts."""

    def tokenizer(self, cfg: JobConfig):
        """The job's tokenizer, read here (the OpenAI output's logprobs name tokens by their text)."""
        return load_job_tokenizer(cfg)

    def run(self, cfg: JobConfig, defaults: SamplingParams, rows: Iterable[Row], num_rows: int,
            emit: Callable[[dict], None], commit: Callable[..., None],
            stopped: Callable[[], bool], columns: pa.Schema) -> tuple[dict, dict]:
        import ray
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False  # the job's bar shows rows and tok/s
        ray_cfg = self.ray_cfg
        gpus = gpus_per_replica(cfg.engine.backend)
        replicas = ray_cfg.num_replicas or default_replicas(gpus, ray_cfg.cpus_per_replica)
        batch_size = ray_cfg.batch_size or max(1, min(cfg.in_flight_limit, -(-num_rows // replicas)))
        reports: dict[str, dict] = {}
        try:
            blocks, staged = _stage(rows, batch_size, columns, emit)
            if blocks and not stopped():
                log = ray.remote(num_cpus=0)(BatchLog).remote()
                ds = map_replicas(ray.data.from_arrow_refs(blocks), _JobReplica, cfg, defaults, min(replicas, len(blocks)),
                          batch_size, ray_cfg.cpus_per_replica, gpus, log=log)
                batches = ds.iter_batches(batch_format="pyarrow", batch_size=None)
                reports = _collect(batches, staged, emit, lambda: commit(force=True), stopped)
        except ray.exceptions.RayError as e:  # a replica that cannot start or raises: the job stops, rows stay
            raise JobError(f"Ray job failed: {_first_error(str(e))[:300]}") from None
        ray_info = {"address": ray_cfg.address, "num_replicas": replicas, "batch_size": batch_size,
                    "cpus_per_replica": ray_cfg.cpus_per_replica, "gpus_per_replica": gpus}
        reports = list(reports.values())
        info = {**(reports[0]["info"] if reports else {}), "ray": ray_info}
        return info, _merged_stats([r["stats"] for r in reports]) if reports else None


def _stage(rows: Iterable[Row], batch_size: int, columns: pa.Schema,
           emit: Callable[[dict], None]) -> tuple[list, int]:
    """Put the good rows into the object store, `batch_size` a block, their carried `columns` beside the request;
    emit() the error rows' records. The blocks stay referenced (by the driver) until the job ends: a batch whose
    replica dies is read again."""
    import ray

    schema = pa.schema(list(STAGED_SCHEMA) + list(columns))
    blocks, chunk, staged = [], [], 0
    for row in rows:
        if row.error is not None:
            emit(output_record(row.index, row.id, None, error=row.error, extras=record_extras(row)))
            continue
        request = {"prompt": row.prompt, "messages": row.messages, "overrides": row.overrides,
                   "chat_options": row.chat_options, "ignored_fields": row.ignored_fields}
        chunk.append({"row": row.index, "id": row.id, "request": json.dumps(request), **row.columns})
        staged += 1
        if len(chunk) == batch_size:
            blocks.append(ray.put(pa.Table.from_pylist(chunk, schema=schema)))
            chunk = []
    if chunk:
        blocks.append(ray.put(pa.Table.from_pylist(chunk, schema=schema)))
    return blocks, staged


def _collect(batches: Iterable[pa.Table], expected: int, emit: Callable[[dict], None], commit: Callable[[], None],
             stopped: Callable[[], bool]) -> dict[str, dict]:
    """Emit the first record of each row (a batch run twice may repeat rows), commit each batch as it comes, and
    check that all `expected` rows came. Returns each replica's latest {"info", "stats"}."""
    seen: set[int] = set()
    replicas: dict[str, dict] = {}
    for table in batches:
        for report in table.column(ENGINE_COLUMN).drop_null().to_pylist():
            report = json.loads(report)
            replicas[report.pop("replica")] = report
        now = time.time()  # the driver's clock, not each node's: the summary's wall time compares it with the start
        for record in table.drop_columns([ENGINE_COLUMN]).to_pylist():
            if record["row"] in seen:
                continue
            seen.add(record["row"])
            emit({**record, "finished_at": now})
        commit()
        if stopped():
            return replicas
    if len(seen) != expected:
        raise JobError(f"{expected - len(seen)} of {expected} rows never came back from the Ray replicas; "
                       "run the same command again to finish them")
    return replicas


def _first_error(traceback: str) -> str:
    """The root error of a Ray traceback (printed first, as "SomeError: why"), else its last line."""
    lines = [line.strip() for line in traceback.strip().splitlines()]
    return next((line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)), lines[-1])


def _merged_stats(stats: list[dict]) -> dict:
    """The replicas' LLM.stats() as one: counters summed, the prefix-cache hit rate averaged over engine steps."""
    steps = sum(s["num_steps"] for s in stats)
    rate = sum(s["prefix_cache_hit_rate"] * s["num_steps"] for s in stats) / steps if steps else 0.0
    summed = ("num_preemptions", "structured_output_grammars", "structured_output_compile_s")
    return {"prefix_cache_hit_rate": round(rate, 4), **{k: sum(s[k] for s in stats) for k in summed},
            "num_steps": steps, "replicas": len(stats)}


class BatchLog:
    """What survives a replica's death, per batch (a job's: its first row number; a dataset's: a digest of its
    content): how many times it was started, the records of the rows already done on a retry, and the row being run
    alone when the replica died. A Ray actor living with the driver (ray.remote(BatchLog))."""

    def __init__(self) -> None:
        self.batches: dict[int | str, dict] = {}

    def _batch(self, key: int | str) -> dict:
        return self.batches.setdefault(key, {"attempts": 0, "done": {}, "alone": None})

    def begin(self, key: int | str) -> tuple[int, dict[int, dict], int | None]:
        batch = self._batch(key)
        batch["attempts"] += 1
        return batch["attempts"], batch["done"], batch["alone"]

    def done(self, key: int | str, records: list[dict]) -> None:
        self._batch(key)["done"].update((r["row"], r) for r in records)

    def alone(self, key: int | str, row: int) -> None:
        self._batch(key)["alone"] = row

    def end(self, key: int | str) -> None:
        self.batches.pop(key, None)


class Replica:
    """One LLM in one Ray actor; Ray Data makes one per replica and calls it once per batch."""

    def __init__(self, cfg: JobConfig, defaults: SamplingParams, log) -> None:
        self.cfg, self.defaults = cfg, defaults
        self.log = log  # a BatchLog actor
        self.llm = load_llm(cfg)
        self.info = self.llm.info()
        self.schema = output_schema(cfg.output_token_ids)

    def complete(self, rows: list[Row]) -> list[dict]:
        """One output record per row, in order: the engine's completion, or an error record."""
        position = {row.index: i for i, row in enumerate(rows)}
        records: list[dict | None] = [None] * len(rows)

        def emit(record: dict) -> None:
            records[position[record["row"]]] = record

        complete_rows(self.llm, rows, self.defaults, self.cfg, emit, max_in_flight=len(rows))
        return records

    def complete_logged(self, rows: list[Row], key: int | str) -> list[dict]:
        """complete(), but a batch that killed a replica before is run in ever smaller chunks (see _isolate)."""
        import ray

        attempt, done, alone = ray.get(self.log.begin.remote(key))
        records = self.complete(rows) if attempt == 1 else self._isolate(rows, key, attempt, done, alone)
        self.log.end.remote(key)
        return records

    def _isolate(self, rows: list[Row], key: int | str, attempt: int, done: dict[int, dict],
                 alone: int | None) -> list[dict]:
        """This batch killed a replica attempt - 1 times: run the rows not done yet in chunks of len / 2^(attempt-1),
        keeping each chunk's records in the log; a row that killed the replica while run alone becomes an error."""
        import ray

        size = max(1, len(rows) >> (attempt - 1))
        todo = [row for row in rows if row.index not in done]
        records = dict(done)
        for start in range(0, len(todo), size):
            chunk = todo[start: start + size]
            if size == 1 and chunk[0].index == alone:
                row = chunk[0]
                got = [output_record(row.index, row.id, None, error=(
                    f"the replica running this row died {attempt - 1} times (out of memory? a crash in the "
                    "backend?); the row was run alone the last time"), extras=record_extras(row))]
            else:
                if size == 1:
                    ray.get(self.log.alone.remote(key, chunk[0].index))
                got = self.complete(chunk)
            ray.get(self.log.done.remote(key, got))
            records.update((r["row"], r) for r in got)
        return [records[row.index] for row in rows]


class _JobReplica(Replica):
    """A block of staged rows in, their output records out (plus this replica's report on the first row)."""

    def __init__(self, cfg: JobConfig, defaults: SamplingParams, log) -> None:
        super().__init__(cfg, defaults, log)
        self.replica = uuid.uuid4().hex  # per incarnation: a restarted actor's counters start again from zero

    def __call__(self, batch: pa.Table) -> pa.Table:
        carried = [f for f in batch.schema if f.name not in STAGED_SCHEMA.names]
        rows = [Row(r.pop("row"), r.pop("id"), **json.loads(r.pop("request")), columns=r) for r in batch.to_pylist()]
        table = pa.Table.from_pylist(self.complete_logged(rows, rows[0].index),
                                     schema=pa.schema(list(self.schema) + carried))
        report = {"replica": self.replica, "info": self.info, "stats": self.llm.stats()}
        engine = [json.dumps(report, default=str)] + [None] * (table.num_rows - 1)
        return table.append_column(ENGINE_COLUMN, pa.array(engine, pa.string()))


def map_replicas(ds, replica: type, cfg: JobConfig, defaults: SamplingParams, replicas: int, batch_size: int, cpus: float,
         gpus: int, **replica_kwargs):
    """ds through a fixed pool of `replicas` actors of class `replica`. Ray Data restarts an actor that dies and
    retries the batch it held (its defaults for actor pools: max_restarts=-1, max_task_retries=-1)."""
    import ray.data

    return ds.map_batches(replica, batch_size=batch_size, batch_format="pyarrow",
                          compute=ray.data.ActorPoolStrategy(size=replicas), num_cpus=cpus, num_gpus=gpus,
                          fn_constructor_kwargs={"cfg": cfg, "defaults": defaults, **replica_kwargs})


def gpus_per_replica(backend: str) -> int:
    import ray

    return 1 if backend == "cuda" or (backend == "auto" and ray.cluster_resources().get("GPU", 0) >= 1) else 0


def default_replicas(gpus: int, cpus_per_replica: float) -> int:
    import ray

    resources = ray.cluster_resources()
    if gpus:
        return max(1, int(resources.get("GPU", 0)))
    return max(1, int(resources.get("CPU", 1) // cpus_per_replica)) if cpus_per_replica else 1


def import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise JobError(f"--ray needs Ray Data, which is not installed: {INSTALL_HINT}") from None
    return ray


def connect(ray, address: str | None) -> bool:
    """Join the Ray cluster at `address` (or $RAY_ADDRESS, or start a local one) unless already connected;
    True when this call connected, so the caller disconnects."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address)
    except Exception as e:  # ConnectionError, ValueError, ...: the cluster is the job's problem
        raise JobError(f"cannot connect to Ray{f' at {address}' if address else ''}: {e}".splitlines()[0]) from None
    return True
