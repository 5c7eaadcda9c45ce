"""Start-up: the per-phase breakdown of `tinyvllm bench --startup`, and the graph-capture setting."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tinyvllm.benchmark import format_startup, startup_phases
from tinyvllm.cli import main
from tinyvllm.config import EngineConfig

NUMPY_PHASES = ["python start", "python imports", "model load (read + convert)", "engine and backend, the rest",
                "first token (one prompt)", "8 tokens (one prompt)", "total"]


def test_startup_phases_in_process(tiny_model_dir):
    phases = startup_phases(str(tiny_model_dir), "numpy")
    assert list(phases) == NUMPY_PHASES[2:-1]
    assert all(seconds > 0 for seconds in phases.values())


def test_bench_startup_prints_every_phase_of_two_fresh_processes(tiny_model_dir, tmp_path):
    out = tmp_path / "startup.json"
    result = CliRunner().invoke(main, ["bench", "--startup", "--model", str(tiny_model_dir), "--backend", "numpy",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())
    assert list(runs) == ["1st (cold)", "2nd (warm)"]
    for phases in runs.values():
        assert list(phases) == NUMPY_PHASES
        assert all(seconds >= 0 for seconds in phases.values())
        assert phases["total"] == pytest.approx(sum(v for k, v in phases.items() if k != "total"))
    lines = result.output.splitlines()
    for name in NUMPY_PHASES:
        assert any(line.startswith(name) for line in lines), name


def test_bench_startup_failure_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    result = CliRunner().invoke(main, ["bench", "--startup", "--model", str(bad), "--backend", "numpy"])
    assert result.exit_code == 1
    assert "start-up run failed" in result.output and "bad.gguf" in result.output
    assert "Traceback" not in result.output


def test_format_startup_aligns_runs_and_marks_missing_phases():
    text = format_startup({"cold": {"kernels": 2.5, "total": 3.0}, "warm": {"total": 1.25}})
    assert text.splitlines() == ["phase          cold        warm",
                                 "kernels      2.500s           -",
                                 "total        3.000s      1.250s"]


def test_graph_capture_setting():
    assert EngineConfig().cuda_graph_capture == "lazy"
    assert EngineConfig(cuda_graph_capture="eager").cuda_graph_capture == "eager"
    with pytest.raises(ValueError, match="cuda_graph_capture"):
        EngineConfig(cuda_graph_capture="sometimes")
    help_text = CliRunner().invoke(main, ["run", "--help"]).output
    assert "--cuda-graph-capture" in help_text
