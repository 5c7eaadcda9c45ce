"""Start-up: the per-phase breakdown of `tinyvllm bench --startup`, the graph-capture setting, and the GGUF
header reader that replaced gguf's slow one on the load path."""

from __future__ import annotations

import json
import os
import struct

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as QT
from test_gguf import write_gguf

from tinyvllm.benchmark import format_startup, startup_phases
from tinyvllm.cli import main
from tinyvllm.config import EngineConfig
from tinyvllm.model import gguf as gguf_model
from tinyvllm.model import loader
from tinyvllm.model.dummy import random_weights, tiny_config
from tinyvllm.model.gguf import dequantize
from tinyvllm.model.gguf_file import read_gguf

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


def test_gguf_header_reader_matches_gguf_package(tmp_path):
    """read_gguf (the fast start-up path) gives what gguf's GGUFReader gives: every field and tensor."""
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_int8("test.int8", -3)
    writer.add_uint64("test.uint64", 2**40)
    writer.add_float64("test.float64", 0.1)
    writer.add_string("tokenizer.chat_template", "{{ messages }} é")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<|im_end|>"])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 3, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 256), dtype=np.float32)
    for qtype in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_1):
        raw = x if qtype == QT.F32 else gguf.quants.quantize(x, qtype)
        writer.add_tensor(f"t.{qtype.name}", raw, raw_dtype=None if qtype == QT.F32 else qtype)
    k_blocks = rng.integers(0, 256, (8, 144), dtype=np.uint8)  # a K-quant (256 weights a block), random bytes
    k_blocks[:, :4] = np.frombuffer(np.float16([0.01, 0.02]).tobytes(), np.uint8)
    writer.add_tensor("t.Q4_K", k_blocks, raw_dtype=QT.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    meta, tensors = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    assert meta == {name: field.contents() for name, field in reader.fields.items()}
    assert meta["tokenizer.ggml.tokens"] == ["a", "bé", "", "<|im_end|>"] and meta["test.uint64"] == 2**40
    expected = {t.name: t for t in reader.tensors}
    assert [t.name for t in tensors] == list(expected)
    for t in tensors:
        want = expected[t.name]
        assert t.tensor_type == want.tensor_type and t.shape.tolist() == want.shape.tolist()
        assert t.data.dtype == want.data.dtype and t.data.shape == want.data.shape
        np.testing.assert_array_equal(dequantize(t), dequantize(want), err_msg=t.name)


@pytest.mark.parametrize("cut", [3, 40, -100])
def test_gguf_header_reader_refuses_cut_files(tmp_path, default_model_path, cut):
    path = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        path.write_bytes(f.read(cut if cut > 0 else os.path.getsize(default_model_path) + cut))
    with pytest.raises((ValueError, struct.error)):
        read_gguf(path)


def test_load_model_reads_no_tensor(make_model_dir, tmp_path, monkeypatch):
    """Loading checks names and shapes from the headers: no tensor is read or dequantized until a backend packs it
    (Mapping's own `in` read each one: a 1B checkpoint was read and converted to float32 at load)."""
    def refuse(*args):
        raise AssertionError("a tensor was read at load")

    bf16_dir = make_model_dir(dtype="bfloat16")
    gguf_path = tmp_path / "m.gguf"
    write_gguf(gguf_path, tiny_config(), random_weights(tiny_config()))
    monkeypatch.setattr(loader.TensorEntry, "read", refuse)
    monkeypatch.setattr(gguf_model, "dequantize", refuse)
    for path in (bf16_dir, gguf_path):
        weights = loader.load_model(path).weights
        assert "model.norm.weight" in weights and "model.nothing" not in weights
