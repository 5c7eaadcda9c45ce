"""bench/sampling.py and bench/sampled_decode.py (GPU benchmarks) refuse bad arguments in one line, before any GPU
is touched, so they are checked here without one."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("script,argv,message", [
    ("sampling.py", ["--runs", "0"], "--runs 0: at least 1"),
    ("sampling.py", ["--rows", "1,0"], "'1,0': positive integers, comma-separated"),
    ("sampling.py", ["--vocab", "big"], "'big': positive integers, comma-separated"),
    ("sampled_decode.py", ["--tokens", "0"], "--tokens 0: at least 1"),
    ("sampled_decode.py", ["--runs", "-2"], "--runs -2: at least 1"),
    ("sampled_decode.py", ["--presets", "llama-3.2-1b,gpt-9"], "gpt-9 not among"),
])
def test_bad_arguments_get_one_line(script, argv, message):
    out = subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert message in out.stderr.strip().splitlines()[-1]
