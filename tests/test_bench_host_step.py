"""bench/host_step.py (the engine's host work per decode step, on the CPU) runs; it checks itself that every step it
times is a decode of all its sequences."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "host_step.py"


def test_host_step_runs_decode_steps():
    out = subprocess.run([sys.executable, str(SCRIPT), "--seqs", "16", "--prompt-len", "20", "--steps", "3",
                          "--repeats", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("16 sequences decoding: engine host work ") and "ms per step" in out.stdout


@pytest.mark.parametrize("argv,message", [
    (["--seqs", "0"], "--seqs 0: at least 1"),
    (["--repeats", "-1"], "--repeats -1: at least 1"),
    (["--prompt-len", "2000", "--steps", "30"], "do not fit in the 2048-token context"),
])
def test_bad_arguments_get_one_line(argv, message):
    out = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert message in out.stderr.strip().splitlines()[-1]
