"""The engine's host work per decode step when every sequence has a structured output (W6's JSON schema), on the
CPU: the numpy backend's tiny random model samples within the constraints' masks, and each phase of the step but
the backend's forward is timed (scheduling, input preparation, output processing; the masks are filled on a worker
thread and not counted). bench/host_step.py measures the same phases without constraints, where a backend that
answers at once can stand in for the model.

    python bench/host_step_structured.py [--seqs 256] [--steps 20] [--repeats 5]
"""

from __future__ import annotations

import argparse

import numpy as np

from host_step import timed_phases
from tinyvllm import LLM, SamplingParams
from tinyvllm.benchmark import W6_SCHEMA, dummy_model

MAX_MODEL_LEN = 1024
PROMPT_LEN = 64
WARMUP_STEPS = 8  # past the prefill steps, into steady decoding


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name in ("seqs", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: at least 1")
    llm = LLM(dummy_model("tiny"), backend="numpy", max_num_seqs=args.seqs, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=args.seqs * MAX_MODEL_LEN // 16)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    for i in range(args.seqs):
        params = SamplingParams(max_tokens=MAX_MODEL_LEN - PROMPT_LEN, temperature=0.8, seed=i,
                                structured_outputs={"json": W6_SCHEMA})
        engine.add_request(str(i), rng.integers(3, 300, PROMPT_LEN).tolist(), params)
    for _ in range(WARMUP_STEPS):
        engine.step()
    spent, phases, running = timed_phases(engine), {}, []
    for _ in range(args.repeats):
        for value in spent.values():
            value[0] = 0.0
        for _ in range(args.steps):
            engine.step()
            running.append(len(engine.scheduler.running))
        for name, value in spent.items():
            phases[name] = min(phases.get(name, np.inf), value[0] / args.steps * 1e3)
    host = sum(ms for name, ms in phases.items() if name != "backend")
    print(f"{args.seqs} sequences with a structured output ({min(running)}-{max(running)} running while timed): "
          f"engine host work {host:.3f} ms per step without the backend (least of {args.repeats} x {args.steps} "
          "steps per phase)")
    print("per step: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in phases.items()))


if __name__ == "__main__":
    main()
