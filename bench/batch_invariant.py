"""What batch_invariant=True costs on the cuda backend: W1 and W3 with it off and on, in one process, each run on
an LLM of its own (the GPU to itself), for each --dummy-weights preset; "on" also at other row counts for the
pinned GEMM algorithms (cublas.INVARIANT_ROWS: the heuristics' split-free tile for that many rows serves every m).

    python bench/batch_invariant.py --presets smollm2-135m,llama-3.2-1b --rows 256,64 --json out.json

Prints, per preset, out tok/s (W1) and ms/token (W3: its wall over its tokens) off and on, and on's cost in percent
(W1: throughput lost; W3: latency added), and W3's time to first token and time per output token (ms), which split
its wall into the prefill with the first token and the decode steps; for each "on" LLM, which weight shapes run
gemv_chain at up to 8 rows and which cuBLAS (each LLM times its own at start-up: benchmark.chain_choices)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyvllm.backends.cuda import cublas  # noqa: E402
from tinyvllm.benchmark import bench_llm, chain_choices, measure_limits, run_benchmark  # noqa: E402

WORKLOADS = ["W1", "W3"]


def measure(preset: str, invariant: bool, rows: int, limits: dict | None) -> tuple[dict, dict]:
    """(W1 out tok/s and W3 ms/token of one LLM, the limits it measured or was given)."""
    cublas.INVARIANT_ROWS = rows
    llm = bench_llm(None, preset, WORKLOADS, 0, backend="cuda", batch_invariant=invariant)
    try:
        limits = limits or measure_limits(llm.backend)
        results = run_benchmark(llm, WORKLOADS, 1.0, 0, limits=limits)["workloads"]
        if invariant:
            print(f"{preset} on (rows {rows}): {chain_choices(llm)}")
    finally:
        llm.close()
    w3 = results["W3"]
    return {"W1": results["W1"]["output_tok_s"], "W3": w3["ms_per_token"], "W3 TTFT": w3["ttft_p50_ms"],
            "W3 TPOT": w3["tpot_p50_ms"]}, limits


def positive_ints(text: str) -> list[int]:
    """'256,64' -> [256, 64]; argparse reports a ValueError as a usage error."""
    values = [int(part) for part in text.split(",")]
    if min(values) < 1:
        raise ValueError(text)
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="smollm2-135m,llama-3.2-1b")
    parser.add_argument("--rows", type=positive_ints, default=[cublas.INVARIANT_ROWS],
                        help="comma-separated INVARIANT_ROWS values to run 'on' with")
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    table, limits = {}, None
    default_rows = cublas.INVARIANT_ROWS
    for preset in args.presets.split(","):
        off, limits = measure(preset, False, default_rows, limits)
        table[preset] = {"off": off}
        for rows in args.rows:
            mode = f"on (rows {rows})"
            try:
                table[preset][mode] = measure(preset, True, rows, limits)[0]
            except RuntimeError as e:  # an algorithm cuBLASLt refuses at some m: reported, the others still run
                print(f"{preset} {mode}: {e}")
    print(f"{'preset':<15}{'mode':<28}{'W1 out tok/s':>14}{'W1 cost':>9}{'W3 ms/token':>13}{'W3 cost':>9}"
          f"{'W3 TTFT':>9}{'W3 TPOT':>9}")
    for preset, modes in table.items():
        off = modes["off"]
        for mode, r in modes.items():
            w1_cost = 100 * (1 - r["W1"] / off["W1"])
            w3_cost = 100 * (r["W3"] / off["W3"] - 1)
            print(f"{preset:<15}{mode:<28}{r['W1']:>14,.0f}{w1_cost:>8.1f}%{r['W3']:>13.3f}{w3_cost:>8.1f}%"
                  f"{r['W3 TTFT']:>9.2f}{r['W3 TPOT']:>9.3f}")
    if args.json:
        args.json.write_text(json.dumps({"results": table, "limits": limits}, indent=2, default=str))


if __name__ == "__main__":
    main()
