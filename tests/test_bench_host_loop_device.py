"""bench/host_loop_device.sh (issue 38's profiles on the GPU host, one device call) with a stand-in python that
records each call: it builds the kernels, then runs profile_host and profile_job with arguments their own parsers
take, results under the directory given."""

import os
import shlex
import subprocess
from pathlib import Path

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_script_calls_the_profilers_with_arguments_they_take(tmp_path):
    log, fake = tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    results = tmp_path / "results"
    done = subprocess.run(["bash", str(ROOT / "bench" / "host_loop_device.sh"), str(results), "tiny"],
                          env={**os.environ, "PYTHON": str(fake)}, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    assert calls[0] == ["-m", "tinyvllm", "build-kernels"]
    scripts = {"bench/profile_host.py": load_script(ROOT / "bench" / "profile_host.py", "profile_host"),
               "bench/profile_job.py": load_script(ROOT / "bench" / "profile_job.py", "profile_job")}
    ran = [call[0] for call in calls[1:]]
    assert ran == ["bench/profile_host.py", "bench/profile_host.py", "bench/profile_job.py"], calls
    for call in calls[1:]:
        args = scripts[call[0]].parse_args(call[1:])
        assert args.dummy_weights == "tiny"
        assert getattr(args, "json", None) is None or Path(args.json).parent == results
    assert scripts["bench/profile_job.py"].parse_args(calls[3][1:]).backend == "cuda"
    assert results.is_dir()
