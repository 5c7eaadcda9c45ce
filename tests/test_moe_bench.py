"""bench/moe_report.py, the table of bench/moe_device.sh: issue 41's targets judged from the runs' JSON files, a
missing or failed run said so."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from moe_report import report  # noqa: E402


def workload(tok_s, **extra):
    return {"output_tok_s": tok_s, "output_tokens": 256, **extra}


def test_moe_report(tmp_path):
    ours = {"W1": workload(20000.0, fraction_of_limit=0.6, floor_s=9.5),
            "W3": workload(500.0, fraction_of_limit=0.7, floor_s=0.36, ms_per_token=2.0)}
    (tmp_path / "ours.json").write_text(json.dumps({"workloads": ours}))
    (tmp_path / "ours-hf-scale.json").write_text(json.dumps({"workloads": {"W1": workload(15000.0)}}))
    (tmp_path / "hf-w1.json").write_text(json.dumps({"W1/compiled": {**workload(2500.0), "batch_size": 256}}))
    (tmp_path / "hf-w3.json").write_text(json.dumps({"W3/compiled": {"error": "OutOfMemoryError: ..."}}))
    lines = "\n".join(report(tmp_path))
    assert "60% " in lines and "2.000 ms/tok  ok" in lines and "MISSED" not in lines.split("HF")[0]
    assert "tinyvllm on the same requests 15000.0 tok/s = 6.0x ok" in lines  # the scaled run's, not the full one's
    assert "HF compiled W3: OutOfMemoryError" in lines
    assert "no results" in "\n".join(report(tmp_path / "nothing"))
