"""--ray on a local Ray instance (2 CPUs, numpy backend, tiny model): the output equals a single-process run row for
row, a replica killed mid-job loses and repeats no row, a failed job resumes, and LLMProcessor adds completions to
a Ray Dataset. Without Ray installed only the checks that need no cluster run."""

import json
import os
import signal
import sys
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tinyvllm.jobs import processor as processor_module
from tinyvllm.jobs import ray_executor
from tinyvllm.io import JobError
from tinyvllm.io.writer import parts_dir
from tinyvllm.config import EngineConfig
from tinyvllm.jobs.config import JobConfig, RayConfig
from tinyvllm.jobs.file import load_job_file
from tinyvllm.jobs.processor import LLMProcessor
from tinyvllm.jobs.ray_executor import ENGINE_COLUMN, RayExecutor, _collect
from tinyvllm.jobs.run import run_job
from tinyvllm.sampling_params import SamplingParams

try:
    import ray
    import ray.data
except ImportError:
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason="ray is not installed (pip install 'tinyvllm[ray]')")

# Everything but the timings (latencies, finished_at), which differ between any two runs.
SAME = ["row", "id", "prompt", "completion", "finish_reason", "prompt_tokens", "completion_tokens", "error",
        "completion_token_ids"]


@pytest.fixture(scope="module")
def ray_local():
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(num_cpus=2, object_store_memory=256 << 20, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()
    signal.signal(signal.SIGTERM, sigterm)  # ray.init installed its own


@pytest.fixture
def job_input(tmp_path):
    """Greedy and sampled rows (seeded by row number), chat, token ids, and rows bad for the reader or the engine."""
    rows = [{"id": f"p{i}", "prompt": f"Row {i} says", "max_tokens": 2 + i % 5,
             **({"temperature": 0} if i % 2 else {})} for i in range(12)]
    rows += [{"id": "chat", "messages": [{"role": "user", "content": "hi there"}]},
             {"id": "ids", "prompt": [5, 6, 7, 8], "max_tokens": 3},
             {"id": "seeded", "prompt": "Once upon", "seed": 7, "temperature": 0.9},
             {"id": "too-long", "prompt": "x", "max_tokens": 500},  # > max_model_len: fails in the replica
             {"id": "p3", "prompt": "a duplicate id"},
             {"id": "cold", "prompt": "x", "temperature": -1}]
    lines = [json.dumps(r) for r in rows] + ["{not json"]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def config(model, input_path, output, **kw) -> JobConfig:
    return JobConfig(input=input_path, output=output, model=model,
                     engine=EngineConfig(backend="numpy", max_model_len=128), sampling={"max_tokens": 6}, output_token_ids=True, quiet=True, **kw)


def run_ray_job(cfg: JobConfig, ray_cfg: RayConfig | None = None) -> dict:
    return run_job(cfg, RayExecutor(ray_cfg or RayConfig()))


def meta(table: pa.Table) -> dict:
    return {k.decode(): json.loads(v) for k, v in table.schema.metadata.items() if k.startswith(b"tinyvllm.")}


def assert_same_output(ray_out, local_out):
    got, want = pq.read_table(ray_out), pq.read_table(local_out)
    assert got.schema.remove_metadata() == want.schema.remove_metadata()
    assert got.select(SAME).to_pylist() == want.select(SAME).to_pylist()
    got_meta, want_meta = meta(got), meta(want)
    assert got_meta.keys() == want_meta.keys()
    for key in ("tinyvllm.job", "tinyvllm.sampling", "tinyvllm.model", "tinyvllm.backend", "tinyvllm.chat"):
        assert got_meta[key] == want_meta[key], key
    counts = {k: v for k, v in got_meta["tinyvllm.counts"].items() if k != "wall_time_s"}
    assert counts == {k: v for k, v in want_meta["tinyvllm.counts"].items() if k != "wall_time_s"}
    assert not parts_dir(ray_out).exists() and ray_out.with_suffix(".summary.json").exists()
    return got_meta


@pytest.fixture
def local_output(tiny_model_dir, job_input, tmp_path):
    out = tmp_path / "local.parquet"
    run_job(config(tiny_model_dir, job_input, out))
    return out


@needs_ray
def test_ray_job_equals_single_process(ray_local, tiny_model_dir, job_input, local_output, tmp_path):
    out = tmp_path / "ray.parquet"
    summary = run_ray_job(config(tiny_model_dir, job_input, out), RayConfig(num_replicas=2, batch_size=3))
    assert summary["rows"] == 19 and summary["error_rows"] == 4
    got_meta = assert_same_output(out, local_output)
    assert got_meta["tinyvllm.engine"]["ray"]["num_replicas"] == 2
    assert got_meta["tinyvllm.engine"]["max_model_len"] == 128
    errors = {r["id"]: r["error"] for r in pq.read_table(out).to_pylist() if r["error"]}
    assert "max_model_len" in errors["too-long"] and "duplicate id" in errors["p3"]
    # Finished: running it again does nothing.
    assert run_ray_job(config(tiny_model_dir, job_input, out), RayConfig(num_replicas=1))["already_complete"]


@needs_ray
def test_batch_invariant_ray_job_equals_single_process_bitwise(ray_local, tiny_model_dir, tmp_path):
    """batch_invariant=True: replicas of 3-row batches give the single process's tokens and logprobs (prompt ones
    too) bit for bit, sampled rows included."""
    rows = [{"id": f"r{i}", "prompt": f"Row {i} says", "max_tokens": 5, "logprobs": 2, "prompt_logprobs": 1,
             **({"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0})} for i in range(10)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = ["row", "id", "completion", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs"]

    def job(out, **kw):
        cfg = config(tiny_model_dir, src, out, **kw)
        cfg.engine = EngineConfig(backend="numpy", max_model_len=128, batch_invariant=True)
        return cfg

    run_job(job(tmp_path / "local.parquet"))
    run_ray_job(job(tmp_path / "ray.parquet"), RayConfig(num_replicas=2, batch_size=3))
    got, want = (pq.read_table(tmp_path / name).select(results).to_pylist() for name in ("ray.parquet", "local.parquet"))
    assert got == want and all(r["logprobs"] for r in got)


@needs_ray
def test_ray_openai_output_names_logprob_tokens_by_text(ray_local, tiny_model_dir, tmp_path):
    """The driver, which holds no LLM, reads the tokenizer to name the OpenAI output's logprobs tokens."""
    from tinyvllm.model.loader import load_tokenizer
    from tinyvllm.tokenizer import TokenNames

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Row {i} says", "logprobs": 1}) + "\n"
                           for i in range(4)))
    out = tmp_path / "ray.jsonl"
    run_ray_job(config(tiny_model_dir, src, out), RayConfig(num_replicas=2, batch_size=2))
    names = TokenNames(load_tokenizer(tiny_model_dir))
    for line in map(json.loads, out.read_text().splitlines()):
        choice = line["response"]["body"]["choices"][0]
        assert choice["logprobs"]["tokens"] == [names(t)[0] for t in choice["token_ids"]] != []


def use_replica(monkeypatch, replica: type) -> None:
    """Jobs map their batches through `replica` (a _JobReplica subclass defined in a test: Ray ships it by value)."""
    real_map = ray_executor.map_replicas
    monkeypatch.setattr(ray_executor, "map_replicas", lambda ds, _, *args, **kw: real_map(ds, replica, *args, **kw))


@needs_ray
def test_replica_killed_mid_job_loses_and_repeats_nothing(ray_local, tiny_model_dir, job_input, local_output,
                                                          tmp_path, monkeypatch):
    died = tmp_path / "died"

    class DiesOnce(ray_executor._JobReplica):
        """Kills its process (no exception, no cleanup) on its second batch, the first time any replica gets there."""

        calls = 0

        def __call__(self, batch):
            self.calls += 1
            if self.calls == 2:
                try:
                    os.close(os.open(died, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    os._exit(1)
            return super().__call__(batch)

    use_replica(monkeypatch, DiesOnce)
    out = tmp_path / "ray.parquet"
    run_ray_job(config(tiny_model_dir, job_input, out), RayConfig(num_replicas=2, batch_size=2))
    assert died.exists()
    assert pq.read_table(out).column("row").to_pylist() == list(range(19))
    assert_same_output(out, local_output)


@needs_ray
def test_a_row_that_kills_its_replica_every_time_becomes_an_error_row(ray_local, tiny_model_dir, job_input,
                                                                      local_output, tmp_path, monkeypatch):
    deaths = tmp_path / "deaths"
    deaths.mkdir()

    class DiesOnRow5(ray_executor._JobReplica):
        """Kills its process whenever it is asked to complete row 5 (as the OOM killer would, every time); past
        6 deaths it raises instead, failing the job rather than letting a broken isolation retry forever."""

        def complete(self, rows):
            if any(row.index == 5 for row in rows):
                if len(list(deaths.iterdir())) >= 6:
                    raise RuntimeError("row 5 was retried without end")
                (deaths / str(uuid.uuid4())).touch()
                os._exit(1)
            return super().complete(rows)

    use_replica(monkeypatch, DiesOnRow5)
    out = tmp_path / "ray.parquet"
    summary = run_ray_job(config(tiny_model_dir, job_input, out), RayConfig(num_replicas=1, batch_size=4))
    got, want = pq.read_table(out).select(SAME).to_pylist(), pq.read_table(local_output).select(SAME).to_pylist()
    assert [r["row"] for r in got] == list(range(19))
    assert got[5]["finish_reason"] == "error" and "died 3 times" in got[5]["error"] and got[5]["completion"] is None
    assert got[:5] + got[6:] == want[:5] + want[6:]  # the rest of its batch, and every other row, as on one machine
    assert summary["error_rows"] == sum(r["error"] is not None for r in want) + 1
    assert len(list(deaths.iterdir())) == 3  # its batch of 4, then halves, then row 5 alone


@needs_ray
def test_failed_job_keeps_committed_batches_and_resumes(ray_local, tiny_model_dir, job_input, local_output, tmp_path,
                                                        monkeypatch):
    class Raises(ray_executor._JobReplica):
        """Fails the job (a Python error is not retried) once it has finished a few batches."""

        calls = 0

        def __call__(self, batch):
            self.calls += 1
            if self.calls == 4:
                raise RuntimeError("boom")
            return super().__call__(batch)

    use_replica(monkeypatch, Raises)
    out = tmp_path / "ray.parquet"
    with pytest.raises(JobError, match="Ray job failed.*boom"):
        run_ray_job(config(tiny_model_dir, job_input, out), RayConfig(num_replicas=1, batch_size=2))
    committed = [r for piece in sorted(parts_dir(out).glob("piece-*.parquet"))
                 for r in pq.read_table(piece).column("row").to_pylist()]
    # The rows the reader refused, and whichever batches reached the driver before the failure: each once.
    assert {16, 17, 18} <= set(committed) and len(set(committed)) == len(committed) < 19
    monkeypatch.undo()
    run_ray_job(config(tiny_model_dir, job_input, out), RayConfig(num_replicas=2, batch_size=2))
    assert_same_output(out, local_output)


@needs_ray
def test_processor_adds_completions_to_a_dataset(ray_local, tiny_model_dir):
    from tinyvllm.llm import LLM

    items = [{"prompt": "The sky is", "messages": None, "max_tokens": 4, "note": "a"},
             {"prompt": None, "messages": [{"role": "user", "content": "hello"}], "max_tokens": None, "note": "b"},
             {"prompt": "", "messages": None, "max_tokens": None, "note": "c"}]
    processor = LLMProcessor(tiny_model_dir, num_replicas=1, backend="numpy", max_model_len=128,
                             sampling={"max_tokens": 5, "temperature": 0})
    rows = processor(ray.data.from_items(items)).take_all()
    assert [r["note"] for r in rows] == ["a", "b", "c"]  # the dataset's own columns stay
    llm = LLM(tiny_model_dir, backend="numpy", max_model_len=128)
    want = [llm.generate("The sky is", SamplingParams(max_tokens=4, temperature=0))[0],
            llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=5, temperature=0))[0]]
    for row, out in zip(rows, want):
        assert row["error"] is None and row["completion"] == out.outputs[0].text
        assert row["completion_tokens"] == len(out.outputs[0].token_ids) and row["e2e_ms"] > 0
    assert rows[2]["finish_reason"] == "error" and "empty" in rows[2]["error"] and rows[2]["completion"] is None
    with pytest.raises(TypeError, match="unknown option"):
        LLMProcessor(tiny_model_dir, output="x.parquet")


@needs_ray
def test_processor_turns_a_row_that_kills_its_replica_into_an_error(ray_local, tiny_model_dir, tmp_path, monkeypatch):
    deaths = tmp_path / "deaths"
    deaths.mkdir()

    class DiesOnPoison(processor_module._DatasetReplica):
        def complete(self, rows):
            if any(row.prompt == "poison" for row in rows):
                if len(list(deaths.iterdir())) >= 6:
                    raise RuntimeError("the poison row was retried without end")
                (deaths / str(uuid.uuid4())).touch()
                os._exit(1)
            return super().complete(rows)

    use_replica(monkeypatch, DiesOnPoison)
    items = [{"prompt": p} for p in ("one", "two", "poison", "four")]
    processor = LLMProcessor(tiny_model_dir, num_replicas=1, batch_size=4, backend="numpy", max_model_len=128,
                             sampling={"max_tokens": 3, "temperature": 0})
    rows = processor(ray.data.from_items(items)).take_all()
    assert [r["prompt"] for r in rows] == ["one", "two", "poison", "four"]
    assert [r["error"] is None for r in rows] == [True, True, False, True] and "died 3 times" in rows[2]["error"]
    assert all(r["completion_tokens"] == 3 for i, r in enumerate(rows) if i != 2)


def table(rows: list[int], report: dict | None = None) -> pa.Table:
    reports = [json.dumps(report) if report else None] + [None] * (len(rows) - 1)
    return pa.table({"row": rows, "completion_tokens": [1] * len(rows), ENGINE_COLUMN: pa.array(reports, pa.string())})


def test_collect_keeps_the_first_record_of_each_row_and_detects_missing_rows():
    emitted, commits = [], []
    report = {"replica": "a", "info": {"backend": "numpy"}, "stats": {}}
    replicas = _collect([table([0, 1], report), table([1, 2]), table([0])], 3, emitted.append,
                        lambda: commits.append(len(emitted)), lambda: False)
    assert [r["row"] for r in emitted] == [0, 1, 2] and commits == [2, 3, 3]
    assert replicas == {"a": {"info": {"backend": "numpy"}, "stats": {}}}
    with pytest.raises(JobError, match="1 of 3 rows never came back"):
        _collect([table([0, 2])], 3, lambda r: None, lambda: None, lambda: False)


def test_without_ray_says_how_to_install(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(JobError, match=r"pip install 'tinyvllm\[ray\]'"):
        run_ray_job(JobConfig(input=tmp_path / "in.jsonl", output=tmp_path / "out.parquet", model=tiny_model_dir))


@pytest.mark.parametrize("table,message", [("num_replicas = 4", None), ('gpus = 2', "unknown key 'ray.gpus'"),
                                           ('num_replicas = "4"', "wrong type"), ("batch_size = 0", ">= 1")])
def test_ray_table_of_a_job_file(tmp_path, table, message):
    job = tmp_path / "job.toml"
    job.write_text(f'input = "in.jsonl"\noutput = "out.parquet"\n[ray]\naddress = "auto"\n{table}\n')
    if message is None:
        assert load_job_file(job, {}, {}).ray == RayConfig(address="auto", num_replicas=4)
    else:
        with pytest.raises(JobError, match=message):
            load_job_file(job, {}, {})


@needs_ray
def test_cli_ray_flag_and_job_file_table(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from tinyvllm.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(6)))
    common = ["--model", str(tiny_model_dir), "--backend", "numpy", "--temperature", "0", "--max-tokens", "4",
              "--quiet"]
    local = CliRunner().invoke(main, ["run", "--input", str(src), "--output", str(tmp_path / "local.parquet"),
                                      *common])
    on_ray = CliRunner().invoke(main, ["run", "--input", str(src), "--output", str(tmp_path / "ray.parquet"),
                                       "--ray", "--num-replicas", "2", *common])
    assert local.exit_code == 0 and on_ray.exit_code == 0, on_ray.output
    job = tmp_path / "job.toml"
    job.write_text(f'input = "in.jsonl"\noutput = "job.parquet"\nmodel = "{tiny_model_dir}"\nbackend = "numpy"\n'
                   '[sampling]\ntemperature = 0.0\nmax_tokens = 4\n[ray]\nnum_replicas = 2\n')
    from_file = CliRunner().invoke(main, ["job", str(job), "--quiet"])
    assert from_file.exit_code == 0, from_file.output
    expected = pq.read_table(tmp_path / "local.parquet").column("completion").to_pylist()
    for name in ("ray.parquet", "job.parquet"):
        table = pq.read_table(tmp_path / name)
        assert table.column("completion").to_pylist() == expected
        assert b"tinyvllm.engine" in table.schema.metadata
