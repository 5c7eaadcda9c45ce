"""bench/gpu_suite.sh's file deals, with a stand-in python3 that records each call: the whole suite runs every GPU
test file once, and GPU_SUITE_PART 1 and 2 together do too, the solo files and the timed test in part 2 only."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOLO = {"tests/gpu/test_close.py", "tests/gpu/test_kernel_start.py"}
TIMED = "tests/gpu/test_cuda_model.py::test_measure_limits_and_describe"


def suite(tmp_path, shards: int, part: str | None = None) -> tuple[int, list[list[str]]]:
    """Run the script with a python3 that logs its arguments; (exit code, the pytest calls' arguments)."""
    bin_dir, log = tmp_path / f"bin{part}", tmp_path / f"calls{part}.txt"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("GPU_SUITE_PART", None)
    if part is not None:
        env["GPU_SUITE_PART"] = part
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), str(tmp_path / f"out{part}"), str(shards)],
                          env=env, capture_output=True, text=True, timeout=60)
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return done.returncode, [c[2:] for c in calls if c[:2] == ["-m", "pytest"]]


def files_of(calls: list[list[str]]) -> list[str]:
    """The test files and tests the calls run (not those they --deselect)."""
    return [a for c in calls for prev, a in zip(["", *c], c) if a.startswith("tests/gpu/") and prev != "--deselect"]


def all_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py")}


@pytest.mark.parametrize("shards", [1, 7, 64])
def test_the_whole_suite_runs_every_file_once(tmp_path, shards):
    code, calls = suite(tmp_path, shards)
    assert code == 0
    files = files_of(calls)
    assert sorted(f for f in files if f != TIMED) == sorted(all_files())
    assert files.count(TIMED) == 1 and all(files_of([c]) for c in calls)  # no call without a file (the CPU suite)
    assert all("--deselect" in c for c in calls if not SOLO & set(c))  # the shards leave the timed test out


def test_the_two_parts_run_every_file_once(tmp_path):
    parts = {}
    for part in ("1", "2"):
        code, calls = suite(tmp_path, 5, part)
        assert code == 0
        parts[part] = files_of(calls)
    assert not SOLO & set(parts["1"]) and TIMED not in parts["1"]
    assert SOLO <= set(parts["2"]) and parts["2"].count(TIMED) == 1
    both = [f for f in parts["1"] + parts["2"] if f != TIMED]
    assert sorted(both) == sorted(all_files())
    assert abs(len(parts["1"]) - len(parts["2"])) <= 4  # halves, give or take the solo files


def test_a_bad_part_is_refused(tmp_path):
    code, calls = suite(tmp_path, 3, "3")
    assert code == 2 and not calls
