"""Batch-1 decode with sampling and logprobs against greedy, end to end, on the cuda backend.

    python bench/sampled_decode.py [--presets smollm2-135m,llama-3.2-1b] [--tokens 256] [--runs 3]

For each `--dummy-weights` preset (random weights), one LLM generates --tokens tokens after a 256-id prompt, alone,
greedy; at temperature 0.8 with top-p 0.9; greedy with 5 logprobs; and both. Printed: ms per output token, the best
of --runs generations (prefill included), so that what sampling and logprobs add to a step (`sample`, `logprobs`;
bench/sampling.py times them alone) is the difference from greedy's line.
"""

from __future__ import annotations

import argparse
import time

from tinyvllm import LLM, SamplingParams
from tinyvllm.benchmark import dummy_model
from tinyvllm.model.dummy import PRESETS

MODES = {"greedy": dict(temperature=0), "T 0.8, top-p 0.9": dict(temperature=0.8, top_p=0.9, seed=1),
         "greedy, 5 logprobs": dict(temperature=0, logprobs=5),
         "T 0.8, top-p 0.9, 5 logprobs": dict(temperature=0.8, top_p=0.9, seed=1, logprobs=5)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="smollm2-135m,llama-3.2-1b")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    for name in ("tokens", "runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: at least 1")
    unknown = [p for p in args.presets.split(",") if p not in PRESETS]
    if unknown:
        parser.error(f"--presets: {', '.join(unknown)} not among {', '.join(sorted(PRESETS))}")
    return args


def main() -> None:
    args = parse_args()
    prompt = [list(range(1, 257))]
    for preset in args.presets.split(","):
        llm = LLM(dummy_model(preset), backend="cuda", max_num_seqs=16, max_model_len=2048)
        llm.backend.finish_startup()  # the lazily captured graphs
        for name, mode in MODES.items():
            llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, **mode))  # warm-up
            params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, **mode)
            best = float("inf")
            for _ in range(args.runs):
                start = time.perf_counter()
                llm.generate(prompt, params)
                best = min(best, time.perf_counter() - start)
            print(f"{preset}, batch 1, {name}: {best / args.tokens * 1e3:.3f} ms per token", flush=True)
        llm.backend.close()


if __name__ == "__main__":
    main()
