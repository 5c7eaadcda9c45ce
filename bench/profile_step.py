"""Where a decode step's time goes, on the cuda backend: host vs GPU, and GPU time per kernel.

    python bench/profile_step.py [--dummy-weights llama-3.2-1b | --model DIR] [--batch 256,512] [--prompt-len 256]
        [--chain] [--quantization fp8] [--quantize-lm-head] [--batch-invariant]

Host work is everything the engine does per step (scheduling, batch preparation, launching, output processing);
the engine overlaps it with the GPU's work on the previous step, so the cost that remains is the step's wall time
beyond its GPU time ("exposed host time"). Per-kernel times come from CUDA events around each launch of one eager
(not graph-replayed) step, each launch queued behind a spin kernel (bench/gemv.py's Timer) so that the host's
launch latency is not timed: a kernel alone, without the overlap programmatic dependent launch gives it in a graph.
With --chain (needs PyTorch, whose profiler reads kernel times through CUPTI), also each kernel's share of the graph
step as replayed: its marginal time, how much later the step's chain of kernels ends because of it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tinyvllm import LLM, SamplingParams
from tinyvllm.benchmark import chain_choices, dummy_model
from tinyvllm.model.loader import load_model


def fill(llm: LLM, batch: int, prompt_len: int) -> None:
    """Admit `batch` requests and step until every one of them is decoding."""
    rng = np.random.default_rng(0)
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", rng.integers(0, llm.model_config.vocab_size, prompt_len).tolist(),
                           SamplingParams(max_tokens=4000 - prompt_len, temperature=0, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()


def decode_graph(llm: LLM):
    """The captured graph of the decode bucket that the running sequences use."""
    graphs = llm.backend.graphs
    return graphs.sampled[graphs.bucket(len(llm.llm_engine.scheduler.running))]


def host_vs_gpu(llm: LLM, steps: int) -> dict:
    """Wall time per engine step; the GPU time of one decode step (its graph replayed back to back); the host's
    own work per step (wall minus time spent waiting for the GPU). The engine queues step N+1 before it reads step
    N, so host work hides behind the GPU: what shows is the step time beyond the GPU time."""
    import pycuda.driver as cuda
    engine, backend = llm.llm_engine, llm.backend
    submit = backend.submit
    waited = 0.0

    def timed_submit(batch):
        queued = submit(batch)
        result = queued.result

        def timed_result():
            nonlocal waited
            start = time.perf_counter()
            out = result()
            waited += time.perf_counter() - start
            return out
        queued.result = timed_result
        return queued

    backend.submit = timed_submit
    engine.step()  # capture the graph for this bucket, if not yet
    engine.step()
    waited = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    backend.submit = submit
    graph, stream = decode_graph(llm), backend.stream
    a, b = cuda.Event(), cuda.Event()
    a.record(stream)
    for _ in range(steps):
        graph.launch(stream.handle)  # replays the last step's inputs: same shapes, same work
    b.record(stream)
    b.synchronize()
    step_ms, gpu_ms = wall / steps * 1e3, b.time_since(a) / steps
    return {"step_ms": step_ms, "gpu_ms": gpu_ms, "host_work_ms": (wall - waited) / steps * 1e3,
            "exposed_host_ms": max(0.0, step_ms - gpu_ms)}


def per_kernel(llm: LLM) -> dict[str, float]:
    """GPU ms per kernel name (GEMMs by shape) over one eager decode step."""
    import pycuda.driver as cuda

    from gemv import Timer  # bench/gemv.py, next to this script
    backend, engine = llm.backend, llm.llm_engine
    ops, linear = backend.forward.ops, backend.forward.linear
    events: list[tuple[str, cuda.Event, cuda.Event]] = []
    launch, gemm = ops.launch, linear.gemm
    timer = Timer(backend.stream, runs=1)

    def timed(name: str, run: Callable[[], None]) -> None:
        a, b = cuda.Event(), cuda.Event()
        timer.hold()
        a.record(backend.stream)
        run()
        b.record(backend.stream)
        events.append((name, a, b))

    in_gemm = []  # the GEMV kernel a gemm launches is timed as the gemm (forward and Linear share one Ops)

    def timed_launch(name, *args, **kw):
        if in_gemm:
            launch(name, *args, **kw)
        else:
            timed(name, lambda: launch(name, *args, **kw))

    def timed_gemm(out, x, w, m, **kw):
        in_gemm.append(True)
        try:
            timed(f"gemm n={w.shape[0]} k={w.shape[1]}", lambda: gemm(out, x, w, m, **kw))
        finally:
            in_gemm.pop()

    backend.graphs.enabled = False  # every step eager, its graphs kept
    engine.step()  # untimed: the first eager step finds this forward's GEMM algorithms (host time the GPU waits for)
    ops.launch, linear.gemm = timed_launch, timed_gemm
    engine.step()
    del ops.launch, linear.gemm  # back to the methods
    backend.graphs.enabled = True
    totals: dict[str, float] = defaultdict(float)
    for name, a, b in events:
        b.synchronize()
        totals[name] += b.time_since(a)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def chain_times(kernels: list[tuple[float, float, str]], first: str) -> tuple[float, dict[str, tuple[float, float]]]:
    """From the (start, end, name) of every kernel of back-to-back replays of one step, each replay beginning with a
    kernel named `first`: the mean step time (start to start, over the complete replays) and, per kernel name, its
    launches per step and its marginal time per step, the sum over its launches of how far its end lies past the
    latest end before it (so the marginal times of a step add up to its chain's length)."""
    kernels = sorted(kernels)
    starts = [i for i, (_, _, name) in enumerate(kernels) if name == first]
    if len(starts) < 2:
        raise ValueError(f"fewer than two steps beginning with {first} among {len(kernels)} kernels")
    marginal: dict[str, float] = defaultdict(float)
    launches: Counter = Counter()
    last_end = max((end for _, end, _ in kernels[:starts[0]]), default=kernels[starts[0]][0])
    for _, end, name in kernels[starts[0]:starts[-1]]:
        marginal[name] += max(0.0, end - last_end)
        launches[name] += 1
        last_end = max(last_end, end)
    steps = len(starts) - 1
    step = (kernels[starts[-1]][0] - kernels[starts[0]][0]) / steps
    return step, {name: (launches[name] / steps, marginal[name] / steps)
                  for name in sorted(marginal, key=lambda name: -marginal[name])}


def chain(llm: LLM, steps: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """chain_times (µs) of the current decode bucket's graph replayed `steps` times back to back."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        raise SystemExit("--chain needs PyTorch (its profiler reads the kernels' times through CUPTI)") from None
    graph, stream = decode_graph(llm), llm.backend.stream
    stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.launch(stream.handle)
        stream.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel"]
    return chain_times(kernels, "resolve_tokens")  # a decode step's first kernel (forward.py)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dummy-weights", default="llama-3.2-1b")
    parser.add_argument("--model", default=None, help="a model dir instead of dummy weights (an FP8 checkpoint)")
    parser.add_argument("--batch", default="256,512")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--chain", action="store_true", help="also each kernel's marginal time in the graph step")
    parser.add_argument("--quantization", choices=["fp8"], default=None, help="the LLM's quantization")
    parser.add_argument("--quantize-lm-head", action="store_true", help="with --quantization fp8: the LM head too")
    parser.add_argument("--batch-invariant", action="store_true", help="the LLM's batch_invariant")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    model = load_model(args.model) if args.model else dummy_model(args.dummy_weights)
    for batch in map(int, args.batch.split(",")):
        llm = LLM(model, backend="cuda", max_num_seqs=batch, max_model_len=4096, quantization=args.quantization,
                  quantize_lm_head=args.quantize_lm_head, batch_invariant=args.batch_invariant)
        llm.backend.finish_startup()  # no graph capture on a thread beside the timed steps (or the profiler)
        if args.batch_invariant:
            print(f"batch-invariant products of up to 8 rows: {chain_choices(llm)}")
        fill(llm, batch, args.prompt_len)
        split = host_vs_gpu(llm, args.steps)
        if args.chain:
            step_us, times = chain(llm, args.steps)
            print(f"batch {batch}: graph step {step_us:.1f} µs; marginal time in the chain per step (launches):")
            for name, (count, us) in times.items():
                print(f"    {name[:48]:<50}{us:9.1f} µs ({count:.0f})")
        kernels = per_kernel(llm)
        total = sum(kernels.values())
        print(f"batch {batch}, context ~{args.prompt_len}: step {split['step_ms']:.2f} ms, GPU {split['gpu_ms']:.2f} "
              f"ms, host work {split['host_work_ms']:.2f} ms (overlapped), exposed host time "
              f"{split['exposed_host_ms']:.2f} ms ({split['exposed_host_ms'] / split['step_ms']:.0%} of the step)")
        print(f"  eager step, GPU time by kernel (sum {total:.2f} ms):")
        for name, ms in kernels.items():
            print(f"    {name:<40}{ms:8.3f} ms  {ms / total:5.1%}")
        llm.backend.close()


if __name__ == "__main__":
    main()
