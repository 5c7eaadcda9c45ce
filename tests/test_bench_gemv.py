"""bench/gemv.py (a GPU benchmark) refuses bad arguments in one line before it touches a GPU. It imports pycuda at
the top, so here it runs against a stand-in pycuda package (every name a MagicMock) in a process of its own: the
stand-in never reaches this test process's modules."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = """import sys
from unittest import mock
for name in ("pycuda", "pycuda.driver", "pycuda.compiler", "pycuda.gpuarray"):
    sys.modules[name] = mock.MagicMock(name=name)
"""


@pytest.mark.parametrize("argv,message", [
    (["--chain-tile", "8"], "--chain-tile goes with --invariant"),
    (["--fp8", "--chain-tile", "8"], "--chain-tile goes with --invariant"),
    (["--invariant", "--chain-tile", "4"], "argument --chain-tile: invalid choice: 4"),
    (["--invariant", "--fp8"], "argument --fp8: not allowed with argument --invariant"),
    (["--preset", "mixtral-8x7b"], "--preset mixtral-8x7b: a mixture of experts"),
])
def test_bad_arguments_get_one_line(tmp_path, argv, message):
    (tmp_path / "pycuda").mkdir()
    (tmp_path / "pycuda" / "__init__.py").write_text(STAND_IN)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gemv.py"), *argv], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert message in out.stderr.strip().splitlines()[-1]
