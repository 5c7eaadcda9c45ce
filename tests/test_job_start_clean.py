"""A job writes nothing until it can start (the output free, the input readable, the model loaded), and a parts
folder that holds no committed rows never blocks another job; one with another job's committed rows still does,
and a busy output still exits 75."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import EXAMPLES, Crash, ok_run, one_line_error, run

from tinyvllm.io import PartsWriter
from tinyvllm.io.writer import lock_path, parts_dir
from tinyvllm.jobs.run import LocalExecutor, _JobRun

PROMPTS = EXAMPLES / "prompts.jsonl"
GREEDY = ("--temperature", "0", "--max-tokens", "3", "--piece-rows", "4")


def no_config_folder(tmp_path: Path, model: Path) -> tuple[Path, tuple]:
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    return folder, ()


FAILED_LOADS = {
    "folder-without-config": (no_config_folder, "config.json"),
    "cuda-without-pycuda": (lambda tmp, model: (model, ("--backend", "cuda")), None),
    "max-model-len-beyond-the-model": (lambda tmp, model: (model, ("--max-model-len", "100000")), "max_model_len"),
    "bad-model-path": (lambda tmp, model: (tmp / "no_such_model", ()), "model not found"),
}


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("case", FAILED_LOADS)
def test_a_failed_model_load_leaves_nothing_and_the_fixed_command_runs(tiny_model_dir, tmp_path, case):
    if case == "cuda-without-pycuda" and _importable("pycuda"):
        pytest.skip("pycuda is installed here: the cuda backend may load")
    make, message = FAILED_LOADS[case]
    model, args = make(tmp_path, tiny_model_dir)
    before = listing(tmp_path)
    for out in (tmp_path / "out.parquet", tmp_path / "new" / "folder" / "out.parquet"):
        one_line_error(run(model, PROMPTS, out, *GREEDY, *args), message, exit_code=None)
        assert listing(tmp_path) == before  # no parts folder, lock, manifest or output folder
    table = ok_run(tiny_model_dir, PROMPTS, tmp_path / "out.parquet", *GREEDY)  # the corrected command
    assert table.column("row").to_pylist() == list(range(16))


def _importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def test_a_failed_load_keeps_the_finished_output_it_was_to_overwrite(tiny_model_dir, tmp_path):
    out = tmp_path / "out.parquet"
    first = ok_run(tiny_model_dir, PROMPTS, out, *GREEDY)
    one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY, "--overwrite", "--max-model-len", "100000"),
                   exit_code=None)
    assert pq.read_table(out).equals(first) and not parts_dir(out).exists()


def stopped_before_a_commit(model, out, monkeypatch, *args) -> Path:
    """A run of the job that stops once its manifest is written, before it commits a row (as a Ray replica that
    fails to load would); returns the parts folder it leaves."""
    def crash(self, *a, **k):
        raise Crash

    with monkeypatch.context() as m:
        m.setattr(_JobRun, "execute", crash)
        assert isinstance(run(model, PROMPTS, out, *GREEDY, *args).exception, Crash)
    assert (parts_dir(out) / "manifest.json").exists() and not any(parts_dir(out).glob("piece-*.parquet"))
    return parts_dir(out)


@pytest.mark.parametrize("leftover", ["another-jobs-manifest", "damaged-manifest", "a-lock-alone"])
def test_a_parts_folder_with_no_committed_rows_is_taken_over(tiny_model_dir, tmp_path, monkeypatch, leftover):
    out = tmp_path / "out.parquet"
    parts = stopped_before_a_commit(tiny_model_dir, out, monkeypatch, "--max-tokens", "2")  # another job's settings
    if leftover == "damaged-manifest":
        (parts / "manifest.json").write_bytes(b"{not json")
    elif leftover == "a-lock-alone":
        (parts / "manifest.json").unlink()
        lock_path(out).touch()
    result = run(tiny_model_dir, PROMPTS, out, *GREEDY)
    assert result.exit_code == 0 and result.stderr == "", result.output
    table = pq.read_table(out)
    assert table.column("row").to_pylist() == list(range(16))
    assert json.loads(table.schema.metadata[b"tinyvllm.sampling"])["max_tokens"] == 3  # this job's settings
    assert not parts_dir(out).exists()


def test_a_parts_folder_with_another_jobs_rows_is_still_refused(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out.parquet"

    def crash(self, *a, **k):
        raise Crash

    with monkeypatch.context() as m:
        m.setattr(PartsWriter, "finalize", crash)
        assert isinstance(run(tiny_model_dir, PROMPTS, out, *GREEDY, "--max-tokens", "2").exception, Crash)
    pieces = sorted(parts_dir(out).glob("piece-*.parquet"))
    assert pieces
    with monkeypatch.context() as m:  # refused before the model is loaded
        m.setattr(LocalExecutor, "start", lambda self, cfg: pytest.fail("loaded the model of a refused job"))
        line = one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY))
    assert "holds rows of a different job" in line and "sampling.max_tokens 2 -> 3" in line and "--overwrite" in line
    assert sorted(parts_dir(out).glob("piece-*.parquet")) == pieces  # nothing lost


HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'1 elsewhere'); print('held', flush=True); time.sleep(60)")


def hold_lock(out: Path) -> subprocess.Popen:
    parts_dir(out).mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_path(out))], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_busy_output_exits_75_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out.parquet"
    holder = hold_lock(out)
    try:
        monkeypatch.setattr(LocalExecutor, "start", lambda self, cfg: pytest.fail("loaded the model of a busy output"))
        one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY), "is being written by another run", exit_code=75)
    finally:
        holder.kill()
        holder.wait()
    assert os.listdir(parts_dir(out)) == ["lock"]


def test_a_run_that_takes_the_lock_while_the_model_loads_keeps_the_second_out(tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """The check before the model loads only says "busy" early: the lock taken after it is what keeps two runs
    apart, so a run that takes it meanwhile still makes this one exit 75, having written nothing."""
    out = tmp_path / "out.parquet"
    holders = []
    load = LocalExecutor.start

    def load_then_lose_the_race(self, cfg):
        load(self, cfg)
        holders.append(hold_lock(out))

    monkeypatch.setattr(LocalExecutor, "start", load_then_lose_the_race)
    try:
        one_line_error(run(tiny_model_dir, PROMPTS, out, *GREEDY), "is being written by another run", exit_code=75)
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert holders and os.listdir(parts_dir(out)) == ["lock"] and not out.exists()
