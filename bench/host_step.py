"""The engine's host work per decode step, on the CPU: W1's shape (512 sequences of 256-token prompts) with a
backend that returns random tokens at once, so that only the engine loop is timed (scheduling, batch building,
output processing). A step's host work must stay under its GPU time for the engine to keep the GPU busy
(bench/profile_step.py measures both on the GPU). --mixed gives every fourth sequence a stop string (that never
matches), logprobs and penalties; --phases also prints the time per step of each phase (schedule, prepare inputs,
backend, output processing), each the least over as many windows again, after the timed ones.

    python bench/host_step.py [--seqs 512] [--steps 30] [--repeats 7] [--mixed] [--phases]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from tinyvllm import LLM, SamplingParams
from tinyvllm.backends.base import Logprobs, QueuedStep, SamplerOutput
from tinyvllm.benchmark import MIXED_SAMPLING, dummy_model


MAX_MODEL_LEN = 2048


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments; a value that cannot give every timed step a decode of all sequences gets argparse's one-line
    usage error."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mixed", action="store_true", help="stop strings, logprobs, penalties on a quarter")
    parser.add_argument("--phases", action="store_true", help="also the time of each phase per step")
    args = parser.parse_args(argv)
    for name in ("seqs", "prompt_len", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    if args.prompt_len + args.steps * args.repeats * (1 + args.phases) + 2 > MAX_MODEL_LEN:
        parser.error(f"--prompt-len {args.prompt_len} + --steps x --repeats {args.steps * args.repeats} decode steps "
                     f"do not fit in the {MAX_MODEL_LEN}-token context this runs with")
    return args


PHASES = {"schedule": ("scheduler", "schedule"), "prepare inputs": (None, "_prepare"),
          "backend": ("backend", "submit"), "output processing": ("output_processor", "process")}


def timed_phases(engine) -> dict[str, list[float]]:
    """Wrap each phase's method to add its time (seconds) to a list per phase."""
    spent = {name: [0.0] for name in PHASES}
    for name, (part, method) in PHASES.items():
        owner = engine if part is None else getattr(engine, part)
        inner = getattr(owner, method)

        def wrapper(*args, _inner=inner, _spent=spent[name]):
            start = time.perf_counter()
            out = _inner(*args)
            _spent[0] += time.perf_counter() - start
            return out

        setattr(owner, method, wrapper)
    return spent


def main() -> None:
    args = parse_args()
    llm = LLM(dummy_model("tiny"), backend="numpy", max_num_seqs=args.seqs, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=args.seqs * MAX_MODEL_LEN // 16)
    engine, vocab = llm.llm_engine, llm.model_config.vocab_size
    rng = np.random.default_rng(0)

    shapes = []  # (longest query, rows) of each step submitted
    top = Logprobs(np.full(args.seqs, -1.0, np.float32), np.arange(args.seqs * 2, dtype=np.int32).reshape(-1, 2) % vocab,
                   np.full((args.seqs, 2), -0.5, np.float32))

    def submit(batch):  # no forward: tokens at once
        shapes.append((batch.max_query_len, batch.num_seqs))
        n = batch.num_seqs
        ids = rng.integers(3, vocab, n).astype(np.int32)
        logprobs = (Logprobs(top.token_logprobs[:n], top.top_ids[:n], top.top_logprobs[:n])
                    if batch.sampling.num_logprobs >= 0 else None)
        return QueuedStep(lambda: SamplerOutput.one_each(ids, logprobs))

    llm.backend.submit = submit
    for i in range(args.seqs):
        extra = MIXED_SAMPLING if args.mixed and i % 4 == 0 else {}
        params = SamplingParams(max_tokens=MAX_MODEL_LEN - args.prompt_len, temperature=0, ignore_eos=True, **extra)
        engine.add_request(str(i), rng.integers(3, vocab, args.prompt_len).tolist(), params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()  # the prefill steps
    gc.collect()
    shapes.clear()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        times.append((time.perf_counter() - start) / args.steps * 1e3)
    phases = {}
    if args.phases:  # each phase's least time per step over `repeats` windows of `steps` steps
        spent = timed_phases(engine)
        for _ in range(args.repeats):
            for value in spent.values():
                value[0] = 0.0
            for _ in range(args.steps):
                engine.step()
            for name, value in spent.items():
                phases[name] = min(phases.get(name, np.inf), value[0] / args.steps * 1e3)
    assert shapes == [(1, args.seqs)] * len(shapes), "a timed step was not a decode of every sequence"
    mode = " (mixed: stop strings, logprobs, penalties on a quarter)" if args.mixed else ""
    print(f"{args.seqs} sequences decoding: engine host work {min(times):.2f} ms per step (best of {args.repeats} x "
          f"{args.steps} steps; median {np.median(times):.2f}){mode}")
    if args.phases:
        print(f"per step (least of {args.repeats}): " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in phases.items()))


if __name__ == "__main__":
    main()
