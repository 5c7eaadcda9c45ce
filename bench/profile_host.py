"""Where a step's host time goes on the cuda backend, phase by phase, and how long the GPU waits between steps.

    python3 bench/profile_host.py --dummy-weights smollm2-135m --batch 512,1 [--steps 100] [--json out.json]
    python3 bench/profile_host.py --dummy-weights smollm2-135m --batch "" --workloads W1,W3,J1 [--scale 1]

--batch: for each batch size, an LLM of that many sequences is filled with --prompt-len-token prompts and runs
--steps steady-state decode steps (every sequence decoding), timed once as they are and once profiled; --mixed
gives every fourth of them a stop string that never matches, 2 logprobs and presence/frequency penalties
(benchmark.MIXED_SAMPLING, as bench/host_step.py --mixed).
--workloads: W1, W3 and W6 (bench's requests; W6 under its JSON schema: the masks' phases too), and J1-like
(--j1-rows requests of a 24-token shared prefix and ~176 random tokens, 128 out, greedy: J1's shape as token ids),
each through llm.generate, profiled from first step to last.

Per engine step (median, p90, in ms) it reports the host time of each phase: the whole engine step, the scheduler,
the model-input build (_prepare, with build_batch inside it), the backend's submit and inside it the staging of the
logits processors, of the decode inputs and of the sampling parameters, each Staging upload, the graph launch call,
the output download queueing; the wait for the sampled ids (the event synchronize) and the whole result() read;
output processing. Phases nest (submit holds the staging; prepare holds build_batch): each is inclusive.

On the GPU (CUDA events, recorded from the host at the step's first launch, at its graph replay and where its
outputs are ready): the step's own GPU time (first launch to outputs copied), the replay alone, and the idle gap
between steps: the end of step N's work to the start of step N+1's first launch. Idle share: the gaps' sum over the
span from the first step's start to the last's end.

Everything is measured by wrapping methods from this script: the engine and backend carry no instrumentation.
--backend numpy runs the host phases alone (no GPU timeline): a CPU check of the script.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

# phase -> (owner's path from the LLM, method); "#module" owners are module paths. Order: as printed.
PHASES = {
    "engine step": ("llm_engine", "step"),
    "schedule": ("llm_engine.scheduler", "schedule"),
    "prepare": ("llm_engine", "_prepare"),
    "  build_batch": ("#tinyvllm.engine.llm_engine", "build_batch"),
    "submit": ("backend", "submit"),
    "  stage processing": ("backend", "_stage_processing"),
    "  decode (stage + launch)": ("backend", "_decode"),
    "    stage decode": ("backend", "_stage_decode"),
    "    fill sampling": ("backend", "_fill_sampling"),
    "    upload decode_in": ("backend.decode_in", "upload"),
    "  prefill (stage + launch)": ("backend", "_prefill"),
    "  download": ("backend.out", "download"),
    "result (wait + read)": None,  # each step's QueuedStep.result, wrapped at submit
    "  wait for sampled ids": None,  # the output event's synchronize
    "output processing": ("llm_engine.output_processor", "process"),
    "masks: rows": ("llm_engine", "_bitmask_rows"),  # structured outputs (W6): which rows of a step get a mask
    "masks: start worker": ("llm_engine.structured_outputs", "start"),
    "masks: wait for worker": ("llm_engine.structured_outputs", "finish"),  # the matchers fed, the masks filled
}
GRAPH_LAUNCH = "    graph launch"
ENGINE_PARTS = ("schedule", "prepare", "submit", "result (wait + read)", "output processing", "masks: rows",
                "masks: start worker", "masks: wait for worker")  # of the engine step, none inside another
ENGINE_OTHER = "engine other"
PRINTED = {name.strip(): name for name in (*PHASES, GRAPH_LAUNCH)}  # as printed: indented under its caller


def summary(values: list[float]) -> dict:
    """median, p90 and mean of values (ms), and how many."""
    if not values:
        return {"n": 0, "median": None, "p90": None, "mean": None}
    a = np.asarray(values, np.float64)
    return {"n": len(a), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)), "mean": float(a.mean())}


def phase_table(steps: list[dict[str, float]], phases: list[str]) -> dict[str, dict]:
    """Per phase, the summary of its ms per step over `steps` (seconds per phase each; a phase a step did not
    enter counts 0 there)."""
    return {name: summary([1e3 * step.get(name, 0.0) for step in steps]) for name in phases
            if any(name in step for step in steps)}


def device_times(begins: list[float | None], ends: list[float | None]) -> dict[str, list[float] | float]:
    """From each step's GPU start and end (ms on one clock; None: the step queued no GPU work): each step's GPU
    time, the idle gaps between consecutive steps with GPU work (end of one to start of the next), the span (first
    start to last end) and the gaps' share of it."""
    steps = [(b, e) for b, e in zip(begins, ends) if b is not None and e is not None]
    busy = [e - b for b, e in steps]
    gaps = [steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1)]
    span = steps[-1][1] - steps[0][0] if steps else 0.0
    return {"gpu_ms": busy, "gaps_ms": gaps, "span_ms": span,
            "idle_share": sum(gaps) / span if span > 0 else 0.0}


class Phases:
    """Host seconds per phase of the engine step in progress; each finished step's go to `steps` (with its kind:
    'decode', 'prefill', or None when it submitted nothing)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.kind: str | None = None
        self.steps: list[dict[str, float]] = []
        self.kinds: list[str | None] = []
        self._undo: list[Callable[[], None]] = []

    def timed(self, name: str, inner: Callable) -> Callable:
        name = name.strip()  # the leading spaces only indent the printed table

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - start
        return wrapper

    def wrap(self, owner, method: str, name: str, wrapper: Callable | None = None) -> bool:
        """Replace owner.method (an object's or a class's) with a timed call (or `wrapper`), undone by unwrap();
        False if owner has no such method."""
        inner = getattr(owner, method, None)
        if inner is None:
            return False
        own = method in vars(owner)
        saved = vars(owner)[method] if own else None
        setattr(owner, method, wrapper or self.timed(name, inner))
        self._undo.append(lambda: setattr(owner, method, saved) if own else delattr(owner, method))
        return True

    def end_step(self) -> None:
        """File the step's phases, with the engine step's time outside the phases below it ("engine other")."""
        spent = self.current
        if "engine step" in spent:
            spent[ENGINE_OTHER] = spent["engine step"] - sum(spent.get(name, 0.0) for name in ENGINE_PARTS)
        self.steps.append(dict(spent))
        self.kinds.append(self.kind)
        self.current.clear()
        self.kind = None

    def unwrap(self) -> None:
        while self._undo:
            self._undo.pop()()


def resolve(llm, path: str):
    if path.startswith("#"):
        return sys.modules[path[1:]]
    owner = llm
    for part in path.split("."):
        owner = getattr(owner, part, None)
    return owner


class Timeline:
    """CUDA events of each submitted step on the backend's stream: at its first launch, around its graph replay,
    and where its outputs are ready. Only the main thread's launches outside a graph capture record."""

    def __init__(self, cuda, stream) -> None:
        self.cuda, self.stream = cuda, stream
        self.main = threading.main_thread()
        self.capturing = False
        self.steps: list[dict] = []  # per step: "begin", "end", "replay" (two events) where recorded

    def submitted(self) -> None:
        self.steps.append({})

    def _record(self):
        event = self.cuda.Event()
        event.record(self.stream)
        return event

    def live(self) -> bool:
        return bool(self.steps) and not self.capturing and threading.current_thread() is self.main

    def begin(self) -> None:
        if self.live() and "begin" not in self.steps[-1]:
            self.steps[-1]["begin"] = self._record()

    def end(self) -> None:
        if self.live():
            self.steps[-1]["end"] = self._record()

    def results(self) -> dict:
        """device_times of the steps recorded, plus each graph replay's GPU time (replays_ms)."""
        self.stream.synchronize()
        ref = next((s["begin"] for s in self.steps if "begin" in s), None)
        if ref is None:
            return {**device_times([], []), "replays_ms": []}

        def at(step, key):
            return step[key].time_since(ref) if key in step and "begin" in step and "end" in step else None
        times = device_times([at(s, "begin") for s in self.steps], [at(s, "end") for s in self.steps])
        times["replays_ms"] = [s["replay"][1].time_since(s["replay"][0]) for s in self.steps if "replay" in s]
        return times


class TimedEvent:
    """An output-ready event whose record() also marks the step's end on the timeline, and whose synchronize()
    counts as the wait phase."""

    def __init__(self, event, phases: Phases, timeline: Timeline | None) -> None:
        self.event, self.timeline = event, timeline
        self.synchronize = phases.timed("  wait for sampled ids", event.synchronize)
        self.query = event.query  # the engine asks whether the device is busy (QueuedStep.done); not a wait

    def record(self, stream) -> None:
        if self.timeline is not None:
            self.timeline.end()
        self.event.record(stream)


def install(llm, phases: Phases, timeline: Timeline | None) -> list[str]:
    """Wrap every phase's method (and the GPU marks, with a timeline); return the phases not found."""
    missing = [name.strip() for name, where in PHASES.items() if where is not None and name not in
               ("engine step", "submit") and not phases.wrap(resolve(llm, where[0]), where[1], name)]
    engine, backend = llm.llm_engine, llm.backend
    step = engine.step

    def engine_step():
        try:
            return phases.timed("engine step", step)()
        finally:
            phases.end_step()
    phases.wrap(engine, "step", "engine step", engine_step)
    submit = backend.submit

    def timed_submit(batch):
        phases.kind = "decode" if batch.max_query_len == 1 else "prefill"
        if timeline is not None:
            timeline.submitted()
        queued = phases.timed("submit", submit)(batch)
        queued.result = phases.timed("result (wait + read)", queued.result)
        return queued
    phases.wrap(backend, "submit", "submit", timed_submit)
    if timeline is not None:
        _install_gpu_marks(backend, phases, timeline)
    if hasattr(backend, "out_ready"):
        ready = backend.out_ready
        backend.out_ready = [TimedEvent(e, phases, timeline) for e in ready]
        phases._undo.append(lambda: setattr(backend, "out_ready", ready))
    return missing


def _install_gpu_marks(backend, phases: Phases, timeline: Timeline) -> None:
    """Mark a step's GPU start at its first launch (a graph's, or an eager forward method's), time each graph replay
    with events around it, and mark the end where its outputs are ready."""
    from tinyvllm.backends.cuda.driver import Graph
    from tinyvllm.backends.cuda.forward import CudaForward
    for method in ("decode", "prefill", "copy_blocks", "init_token_slots"):
        def first_launch(*args, _inner=getattr(CudaForward, method), **kwargs):
            timeline.begin()
            return _inner(*args, **kwargs)
        phases.wrap(CudaForward, method, method, first_launch)
    launch = phases.timed(GRAPH_LAUNCH, Graph.launch)

    def replay(graph, stream_handle):
        timeline.begin()
        before = timeline._record() if timeline.live() else None
        launch(graph, stream_handle)
        if before is not None:
            timeline.steps[-1]["replay"] = (before, timeline._record())
    phases.wrap(Graph, "launch", GRAPH_LAUNCH, replay)
    capture = backend.graphs.capture

    def flagged_capture(*args, **kwargs):
        timeline.capturing = True
        try:
            return capture(*args, **kwargs)
        finally:
            timeline.capturing = False
    phases.wrap(backend.graphs, "capture", "graph capture", flagged_capture)


# ---- runs --------------------------------------------------------------------------------------------------------

def make_llm(args, max_num_seqs: int, text: bool = False):
    from tinyvllm import LLM
    from tinyvllm.benchmark import BENCH_MAX_MODEL_LEN, dummy_model
    from tinyvllm.model.loader import load_model
    model = dummy_model(args.dummy_weights, text=text) if args.model is None else load_model(args.model)
    max_len = min(BENCH_MAX_MODEL_LEN, model.config.max_position_embeddings)
    llm = LLM(model, backend=args.backend, max_num_seqs=max_num_seqs, max_model_len=max_len,
              num_kv_blocks=args.num_kv_blocks)
    if hasattr(llm.backend, "finish_startup"):
        llm.backend.finish_startup()  # no capture thread beside the profiled steps
    return llm


def fill(llm, batch: int, prompt_len: int, max_tokens: int, mixed: bool = False) -> None:
    """Admit `batch` requests (mixed: every fourth with MIXED_SAMPLING's stop string, logprobs and penalties) and
    step until every one of them is decoding."""
    from tinyvllm import SamplingParams
    from tinyvllm.benchmark import MIXED_SAMPLING
    rng = np.random.default_rng(0)
    engine = llm.llm_engine
    for i in range(batch):
        extra = MIXED_SAMPLING if mixed and i % 4 == 0 else {}
        engine.add_request(f"p{batch}-{i}", rng.integers(0, llm.model_config.vocab_size, prompt_len).tolist(),
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in
                                          engine.scheduler.running):
        engine.step()


def profiled(llm, run: Callable[[], None]) -> tuple[Phases, dict | None, list[str], float]:
    """Run `run` with the phases wrapped (and the GPU timeline on the cuda backend); return the phases, the
    timeline's results, the phases not found and the wall seconds."""
    phases = Phases()
    timeline = None
    if llm.backend.name == "cuda":
        import pycuda.driver as cuda
        timeline = Timeline(cuda, llm.backend.stream)
    missing = install(llm, phases, timeline)
    try:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
        return phases, (timeline.results() if timeline is not None else None), missing, wall
    finally:
        phases.unwrap()


def report(phases: Phases, device: dict | None, kinds: tuple[str, ...] = ("decode", "prefill")) -> dict:
    """Per step kind: how many steps, the phase table; and the GPU figures (summaries; totals in ms)."""
    names = [name.strip() for name in (*PHASES, GRAPH_LAUNCH, ENGINE_OTHER)]
    out = {}
    for kind in kinds:
        steps = [s for s, k in zip(phases.steps, phases.kinds) if k == kind]
        if steps:
            out[kind] = {"steps": len(steps), "host_ms": phase_table(steps, names)}
    if device is not None:
        out["gpu"] = {"step_ms": summary(device["gpu_ms"]), "replay_ms": summary(device["replays_ms"]),
                      "idle_gap_ms": summary(device["gaps_ms"]), "idle_total_ms": float(sum(device["gaps_ms"])),
                      "busy_total_ms": float(sum(device["gpu_ms"])), "span_ms": device["span_ms"],
                      "idle_share": device["idle_share"]}
    return out


def steady_decode(args, batch: int) -> dict:
    """`batch` sequences decoding: --steps steps as they are (wall per step), then --steps profiled."""
    llm = make_llm(args, batch)
    fill(llm, batch, args.prompt_len, args.warmup + 2 * args.steps + 8, args.mixed)
    engine = llm.llm_engine
    for _ in range(args.warmup):
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    plain = (time.perf_counter() - start) / args.steps
    phases, device, missing, wall = profiled(llm, lambda: [engine.step() for _ in range(args.steps)])
    assert all(k == "decode" for k in phases.kinds), "a profiled step was not a decode of every sequence"
    result = {"batch": batch, "mixed": args.mixed, "steps": args.steps, "step_ms_unprofiled": plain * 1e3,
              "step_ms_profiled": wall / args.steps * 1e3, "out_tok_s_unprofiled": batch / plain,
              "phases_not_found": missing, **report(phases, device, ("decode",))}
    llm.backend.close()
    return result


J1_PREFIX = 24  # J1-like: a shared system prefix, then the row's own tokens


def workload_requests(name: str, vocab_size: int, scale: float, j1_rows: int):
    """The requests of W1 / W3 (bench's), or J1-like: j1_rows prompts of a shared J1_PREFIX-token prefix and
    ~176 (166-186) random tokens each, 128 tokens out (scaled)."""
    from tinyvllm.benchmark import Request, make_workload
    if name != "J1":
        return make_workload(name, vocab_size, scale)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, vocab_size, J1_PREFIX).tolist()
    rest = max(1, round(176 * scale))
    return [Request(prefix + rng.integers(0, vocab_size, rest + int(rng.integers(-10, 11)) if rest > 10 else rest)
                    .tolist(), max(1, round(128 * scale))) for _ in range(j1_rows)]


def workload(args, llm, name: str) -> dict:
    """One workload through llm.generate (W3: one request at a time), profiled from its first step to its last."""
    from tinyvllm import SamplingParams
    requests = workload_requests(name, llm.model_config.vocab_size, args.scale, args.j1_rows)
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, **r.sampling) for r in requests]
    outputs = []
    if name == "W3":
        def run():
            for prompt, p in zip(prompts, params):
                outputs.extend(llm.generate([prompt], p, use_tqdm=False))
    else:
        def run():
            outputs.extend(llm.generate(prompts, params, use_tqdm=False))
    phases, device, missing, wall = profiled(llm, run)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)  # W6's rows end where their JSON does
    return {"requests": len(requests), "output_tokens": out_tokens, "wall_s": wall, "out_tok_s": out_tokens / wall,
            "phases_not_found": missing, **report(phases, device)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dummy-weights", default="smollm2-135m", help="random weights of this preset")
    parser.add_argument("--model", default=None, help="a model path instead of dummy weights")
    parser.add_argument("--backend", default="cuda", choices=("cuda", "numpy"))
    parser.add_argument("--batch", default="512,1", help="steady-state decode batch sizes ('' for none)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--mixed", action="store_true",
                        help="steady decode with a stop string, logprobs and penalties on every fourth row")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workloads", default="", help="any of W1,W3,W6,J1 (J1-like: token ids, J1's shape)")
    parser.add_argument("--scale", type=float, default=1.0, help="the workloads' counts and lengths scaled")
    parser.add_argument("--j1-rows", type=int, default=20000)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: sized by memory)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batch {args.batch!r}: comma-separated integers")
    args.workload_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workload_names) - {"W1", "W3", "W6", "J1"})
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(unknown)} (choose from W1, W3, W6, J1)")
    for name in ("steps", "prompt_len", "j1_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        parser.error(f"--num-kv-blocks {args.num_kv_blocks}: at least 1")
    if args.warmup < 0 or not 0 < args.scale <= 1 or any(b < 1 for b in args.batches):
        parser.error("--warmup at least 0, --scale in (0, 1], --batch sizes at least 1")
    if not args.batches and not args.workload_names:
        parser.error("nothing to run: give --batch sizes or --workloads")
    return args


def print_section(title: str, result: dict) -> None:
    head = {k: v for k, v in result.items() if not isinstance(v, dict) and k != "phases_not_found"}
    print(f"== {title}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in head.items()))
    for kind in ("decode", "prefill"):
        if kind in result:
            print(f"  {kind} steps ({result[kind]['steps']}), host ms per step: median / p90")
            for name, s in result[kind]["host_ms"].items():
                print(f"    {PRINTED.get(name, name):<30}{s['median']:8.3f} {s['p90']:8.3f}")
    if "gpu" in result:
        g = result["gpu"]
        fmt = lambda s: "-" if s["median"] is None else f"{s['median']:.3f} / {s['p90']:.3f}"  # noqa: E731
        print(f"  GPU: step {fmt(g['step_ms'])} ms, replay {fmt(g['replay_ms'])} ms, idle gap {fmt(g['idle_gap_ms'])}"
              f" ms (median / p90); idle {g['idle_total_ms']:.1f} of {g['span_ms']:.1f} ms ({g['idle_share']:.1%})")
    if result.get("phases_not_found"):
        print(f"  (phases not found on this backend: {', '.join(result['phases_not_found'])})")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results: dict = {"model": args.model or f"dummy:{args.dummy_weights}", "backend": args.backend,
                     "batches": {}, "workloads": {}}
    for batch in args.batches:
        results["batches"][str(batch)] = steady_decode(args, batch)
        print_section(f"steady decode, batch {batch}", results["batches"][str(batch)])
    if args.workload_names:
        llm = make_llm(args, 512)
        for name in args.workload_names:
            results["workloads"][name] = workload(args, llm, name)
            print_section(f"workload {name}", results["workloads"][name])
        llm.backend.close()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
