"""The table of bench/moe_device.sh: tinyvllm's W1 and W3 at the Qwen3-30B-A3B shape against issue 41's targets
(W3 <= 2.2 ms/token, W1 >= 50% of its floor) and against HF transformers' compiled static-cache peer on the same
requests (>= 5x).

    python bench/moe_report.py OUT [PEER]    (PEER default compiled; reads OUT/ours.json, OUT/ours-hf-scale.json, OUT/hf-w1.json, OUT/hf-w3.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

W3_MS_TARGET, W1_FLOOR_TARGET, HF_RATIO_TARGET = 2.2, 0.5, 5.0


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report(out: Path, peer_name: str = "compiled") -> list[str]:
    """The table's lines from the run's JSON files (a missing or failed part says so)."""
    ours = _read(out / "ours.json").get("workloads", {})
    same = {"W1": _read(out / "ours-hf-scale.json").get("workloads", {}).get("W1") or ours.get("W1"),
            "W3": ours.get("W3")}
    hf = {**_read(out / "hf-w1.json"), **_read(out / "hf-w3.json")}
    lines = [f"{'':26}{'W1 (512 x 256/256)':>24}{'W3 (batch 1, 256/256)':>26}"]
    w1, w3 = ours.get("W1", {}), ours.get("W3", {})
    if w1 and w3:
        lines.append(f"{'tinyvllm tok/s':26}{w1['output_tok_s']:>24.0f}{w3['output_tok_s']:>26.1f}")
        w1_ok, w3_ok = w1["fraction_of_limit"] >= W1_FLOOR_TARGET, w3["ms_per_token"] <= W3_MS_TARGET
        lines.append(f"{'tinyvllm vs floor':26}{w1['fraction_of_limit']:>17.0%} {_mark(w1_ok):>6}"
                     f"{w3['ms_per_token']:>16.3f} ms/tok {_mark(w3_ok):>3}")
        lines.append(f"{'floor':26}{w1['floor_s']:>22.2f} s{w3['floor_s'] * 1000 / w3['output_tokens']:>19.3f} ms/tok")
    else:
        lines.append("tinyvllm: no results (see ours.txt)")
    for workload in ("W1", "W3"):
        peer = hf.get(f"{workload}/{peer_name}", {})
        mine = same[workload]
        if "output_tok_s" not in peer or not mine:
            lines.append(f"HF {peer_name} {workload}: {peer.get('error', 'no result (see hf-*.txt)')}")
            continue
        ratio = mine["output_tok_s"] / peer["output_tok_s"]
        batch = f", batch {peer['batch_size']}" if "batch_size" in peer else ""
        lines.append(f"HF {peer_name} {workload}: {peer['output_tok_s']:.1f} tok/s ({peer['output_tokens']} tokens"
                     f"{batch}); tinyvllm on the same requests {mine['output_tok_s']:.1f} tok/s = {ratio:.1f}x "
                     f"{_mark(ratio >= HF_RATIO_TARGET)}")
    return lines


if __name__ == "__main__":
    print("\n".join(report(Path(sys.argv[1]), *sys.argv[2:3])))
