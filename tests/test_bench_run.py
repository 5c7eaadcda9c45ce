"""bench/run.py's record of the code a result came from."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from run import _git_commit  # noqa: E402


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_commit_is_marked_dirty_when_tracked_files_differ(tmp_path):
    try:
        _git(tmp_path, "init", "-q")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git")
    (tmp_path / "kernel.cu").write_text("// 4 stages\n")
    _git(tmp_path, "add", "kernel.cu")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert _git_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files are not the code\n")
    assert _git_commit(tmp_path) == head
    (tmp_path / "kernel.cu").write_text("// 3 stages\n")
    assert _git_commit(tmp_path) == f"{head}-dirty"


def test_commit_outside_a_repository_is_unknown(tmp_path):
    inside = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=tmp_path, capture_output=True).returncode == 0
    if inside:
        pytest.skip(f"{tmp_path} lies inside a git repository")
    assert _git_commit(tmp_path) == "unknown"


def test_bench_run_takes_tinyvllm_benchs_options_and_runs_the_same_way(tmp_path, monkeypatch):
    """bench/run.py is `tinyvllm bench` plus the HF peers and the record of the run: the same options (every
    workload by default), the same LLM."""
    import json

    from click.testing import CliRunner

    from run import main as bench_run
    from tinyvllm.cli import main

    assert {p.name for p in bench_run.params} - {"peers", "peer_batch_sizes"} == \
        {p.name for p in main.commands["bench"].params} - {"startup"}
    monkeypatch.setattr("tinyvllm.benchmark.measure_limits",
                        lambda backend, fp8=False: {"bandwidth_bytes_s": 1e10, "gemm_flops": 1e11})
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench_run, ["--dummy-weights", "tiny", "--backend", "numpy", "--workloads", "W3",
                                            "--scale", "0.02", "--max-num-seqs", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    recorded = json.loads(out.read_text())
    assert recorded["meta"]["llm"]["max_num_seqs"] == 4 and recorded["peers"] == {}
    assert recorded["workloads"]["W3"]["output_tokens"] > 0
