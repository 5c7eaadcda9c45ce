"""Where the engine loop's host time goes, per step, for W6 (structured outputs) and the same work unconstrained.

    python bench/profile_loop.py MODEL [LLGUIDANCE_THREADS]      (cuda backend; MODEL: e.g. the SmolLM2 GGUF)

Wraps the engine's phases with timers (process, prepare, schedule, the structured-output worker's start and join,
the backend's submit, a step's sampling and the wait for its output) and prints milliseconds per engine step. The
W6 requests run twice constrained (the first captures the forward-only decode graphs), then unconstrained with the
same lengths. A wait near zero means the GPU is waiting on the host.
"""

from __future__ import annotations

import collections
import sys
import time

from tinyvllm import LLM, SamplingParams
from tinyvllm.benchmark import Request, make_workload
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.requests import RequestAdmission
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.structured_outputs import StructuredOutputManager

TOTAL: dict[str, float] = collections.defaultdict(float)


def timed(owner, name: str, label: str | None = None) -> None:
    """Replace owner.name (a class's method, or an object's bound method) with a timed call."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TOTAL[label or name] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    for name in ("step", "_process", "_bitmask_rows", "_prepare"):
        timed(LLMEngine, name)
    timed(RequestAdmission, "fork_ready", "_fork")
    timed(Scheduler, "schedule")
    timed(StructuredOutputManager, "start", "worker start")
    timed(StructuredOutputManager, "finish", "worker join")
    llm = LLM(sys.argv[1], backend="cuda", max_num_seqs=512, max_model_len=4096)
    manager = llm.llm_engine.structured_outputs
    if len(sys.argv) > 2:
        manager.num_threads = int(sys.argv[2])
    backend = llm.backend
    submit = backend.submit

    def timed_submit(batch):
        start = time.perf_counter()
        queued = submit(batch)
        TOTAL["submit"] += time.perf_counter() - start
        timed(queued, "result", "wait for output")
        if queued.sample is not None:
            timed(queued, "sample", "sample()")
        return queued

    backend.submit = timed_submit
    requests = make_workload("W6", llm.model_config.vocab_size)
    for run in ("constrained (first)", "constrained", "unconstrained, same lengths"):
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, **r.sampling)
                  for r in requests]
        TOTAL.clear()
        steps, stats = llm.llm_engine.num_steps, manager.stats
        mask, matchers = stats.mask_seconds, stats.consume_seconds
        start = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], params)
        wall = time.perf_counter() - start
        steps = llm.llm_engine.num_steps - steps
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"{run}: {tokens / wall:,.0f} output tok/s, {1000 * wall / steps:.2f} ms per step ({steps} steps)")
        print(f"   on the worker thread: mask fill {1000 * (stats.mask_seconds - mask) / steps:.3f}, matchers "
              f"{1000 * (stats.consume_seconds - matchers) / steps:.3f} ms/step")
        for name, seconds in sorted(TOTAL.items(), key=lambda item: -item[1]):
            print(f"   {name:<16} {1000 * seconds / steps:8.3f} ms/step")
        if run == "constrained":
            requests = [Request(r.prompt_token_ids, len(o.outputs[0].token_ids)) for r, o in zip(requests, outputs)]


if __name__ == "__main__":
    main()
