"""bench/invariant_device.sh (issue 43's tests and benchmarks on the GPU, one device call) with a stand-in python that
records each call: it builds the kernels, runs the mode's two GPU test files, then bench/batch_invariant.py on the
presets given and bench/profile_step.py at batch 1 off and on for each, with arguments their own parsers take,
results under the directory given."""

import os
import shlex
import subprocess
from pathlib import Path

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_script_runs_the_tests_and_benchmarks_with_arguments_they_take(tmp_path):
    log, fake = tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    results = tmp_path / "results"
    done = subprocess.run(["bash", str(ROOT / "bench" / "invariant_device.sh"), str(results), "tiny,tiny-moe"],
                          env={**os.environ, "PYTHON": str(fake)}, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    assert calls[0] == ["-m", "tinyvllm", "build-kernels"]
    tests = sorted(call[-1] for call in calls[1:3])  # the two pytest runs, side by side
    assert all(call[:2] == ["-m", "pytest"] for call in calls[1:3])
    assert tests == ["tests/gpu/test_attention_invariant.py", "tests/gpu/test_batch_invariant_cuda.py"]
    assert all((ROOT / test).is_file() for test in tests)
    bench = load_script(ROOT / "bench" / "batch_invariant.py", "batch_invariant")
    assert calls[3][0] == "bench/batch_invariant.py"
    args = bench.parse_args(calls[3][1:])
    assert args.presets == "tiny,tiny-moe" and args.json.parent == results
    profile = load_script(ROOT / "bench" / "profile_step.py", "profile_step")
    assert [call[0] for call in calls[4:]] == ["bench/profile_step.py"] * 4
    runs = [profile.parse_args(call[1:]) for call in calls[4:]]
    assert [(a.dummy_weights, a.batch_invariant) for a in runs] == [("tiny", False), ("tiny", True),
                                                                   ("tiny-moe", False), ("tiny-moe", True)]
    assert all(a.batch == "1" and a.chain for a in runs)
    assert "invariant_device:" in done.stdout
