"""Where a job's host time goes beyond the engine's, per row: J1's rows with the model replaced by a backend that
answers at once, so what is left is the host's work alone (runs on a CPU; no weights are made).

    python bench/profile_job.py [--rows 4000] [--max-tokens 128] [--stop STRING] [--cprofile] [--device-us US]
                                [--backend cuda --dummy-weights smollm2-135m]

Times J1's requests as token ids through LLM.generate, then the same rows as a job through the CLI's runner (run_job,
in process), and prints both walls, their difference per row, the main thread's CPU time per row in each (on a GPU
the main thread runs the engine: what the job adds there is what cannot overlap the device; the worker threads' time
shows in the wall only where they take the GIL), the CPU of the job's own Python threads per row (the producer's,
the commit thread's and what the main thread adds: all of it holds the GIL but for batch tokenization and Parquet's
C++ writing, so on a GPU host, where the main thread is the bottleneck, it adds to the wall), and the inclusive
time of each phase of the job path per row (phases nest: the engine's step holds the detokenization; a row's
preparation holds the chat template; with no device to wait for, the threads' phases include waits for the GIL).
--stop gives every row a stop string (token-by-token detokenization); --cprofile prints the top functions by own time.
--timeline prints, for the engine's run and the job's (uninstrumented) one, where the wall goes by engine step: the
first step's start, the window of full batches (97.5% of max_num_seqs or more running) and its mean step interval
against its median (the steps' hiccups), the gaps of over 1 ms there between one step's return and the next one's
call (the job's work between steps, which the device waits for once it exceeds a step's device time less the
engine's own host time), the sequences a step runs on average, and the time after the last step.
--device-us makes each step take time as on a GPU (US microseconds per sequence, plus a tenth of that per prefill
token; steps queue back to back and the host waits for one without the GIL): then the job's threads compete with
the main thread for the GIL while it would wait for the device, as on a GPU host.
--backend runs the model instead, on random weights of --dummy-weights' shapes: J1's profile on a GPU (with
--timeline, the job's step interval, gaps, ramp and tail against the engine's on the same device).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import inspect
import json
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import tinyvllm.engine.output_processor as output_module
import tinyvllm.llm
from tinyvllm import LLM
from tinyvllm.backends.base import Backend, QueuedStep, SamplerOutput
from tinyvllm.benchmark import Request, bench_llm, make_j1_rows, run_workload
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.io import readers, writer
from tinyvllm.jobs import run as job_run
from tinyvllm.jobs.config import JobConfig
from tinyvllm.jobs.dummy import text_tokenizer
from tinyvllm.model.dummy import llama_3_2_1b_config
from tinyvllm.model.loader import LoadedModel
from tinyvllm.tokenizer import Tokenizer, _ByteDetokenizer, _WindowDetokenizer

TOTAL: dict[str, float] = collections.defaultdict(float)
CALLS: dict[str, int] = collections.defaultdict(int)
THREADS: dict[str, set[str]] = collections.defaultdict(set)  # "main" and/or "worker": where the phase ran
PRODUCER = "producer (read, parse, prepare, tokenize)"
COMMIT = "Parquet commit: to Arrow, write, fsync"


class InstantBackend(Backend):
    """Samples uniformly random regular token ids at once: the engine and job without a model."""

    name = "instant"

    def __init__(self, model, config) -> None:
        self.vocab_size, self.config = model.config.vocab_size, config
        self.rng = np.random.default_rng(0)

    def init_kv_cache(self) -> int:
        return self.config.max_num_seqs * -(-self.config.max_model_len // self.config.block_size)

    def execute(self, batch, bitmask=None) -> SamplerOutput:
        return SamplerOutput.one_each(self.rng.integers(0, 128000, batch.num_seqs, dtype=np.int32))


class DeviceLikeBackend(InstantBackend):
    """InstantBackend whose steps take device time: each starts when the one before it ends (or when submitted,
    if later) and its result is there at its end; waiting for it sleeps, releasing the GIL as a CUDA wait does."""

    def __init__(self, model, config, seconds_per_seq: float) -> None:
        super().__init__(model, config)
        self.seconds_per_seq = seconds_per_seq
        self.free_at = 0.0

    def submit(self, batch) -> QueuedStep:
        queued = super().submit(batch)
        prefill_tokens = len(batch.token_ids) - batch.num_seqs
        start = max(time.perf_counter(), self.free_at)
        end = self.free_at = start + self.seconds_per_seq * (batch.num_seqs + prefill_tokens / 10)

        def result() -> SamplerOutput:
            time.sleep(max(0.0, end - time.perf_counter()))
            return queued.result()

        return QueuedStep(result, queued.bitmask, queued.sample, lambda: time.perf_counter() >= end)


def timed(owner, name: str, label: str | None = None) -> None:
    """Replace owner.name with a call that adds the CPU time of the thread running it to TOTAL[label] (waits for the
    GIL left out) and notes that thread; a generator's time is that of its resumptions."""
    inner = getattr(owner, name)
    label = label or name

    def note(start: float) -> None:
        TOTAL[label] += time.thread_time() - start
        THREADS[label].add("main" if threading.current_thread() is threading.main_thread() else "worker")

    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            note(start)
            CALLS[label] += 1

    def generator(*args, **kwargs):
        items = inner(*args, **kwargs)
        while True:
            start = time.thread_time()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                note(start)
            yield item

    setattr(owner, name, generator if inspect.isgeneratorfunction(inner) else wrapper)


class StepTimeline:
    """LLMEngine.step wrapped to note each step's start and end and how many sequences run after it, from start()
    on."""

    def __init__(self, full: int) -> None:
        self.full, self.steps, self.start_s = full, [], 0.0
        inner = LLMEngine.step

        def step(engine):
            started = time.perf_counter()
            outputs = inner(engine)
            self.steps.append((started, time.perf_counter(), len(engine.scheduler.running)))
            return outputs

        LLMEngine.step = step

    def start(self) -> None:
        self.steps, self.start_s = [], time.perf_counter()

    def report(self, name: str, end_s: float) -> None:
        """One line: where the wall from start() to end_s went, by step."""
        starts, ends, running = (np.array(column) for column in zip(*self.steps))
        starts, ends = starts - self.start_s, ends - self.start_s
        full = np.flatnonzero(running >= self.full)
        first, last = (full[0], full[-1]) if len(full) > 1 else (0, 0)
        window = np.diff(starts[first:last + 1]) if last > first else np.zeros(1)
        gaps = starts[first + 1:last + 1] - ends[first:last]  # between a step's return and the next one's call
        long_gaps = gaps[gaps > 1e-3]
        print(f"{name}: {len(starts)} steps, the first at {1e3 * starts[0]:.0f} ms; full batches from "
              f"{1e3 * starts[first]:.0f} to {1e3 * starts[last]:.0f} ms, a step every {1e3 * window.mean():.2f} ms "
              f"there (median {1e3 * np.median(window):.2f}), {len(long_gaps)} gaps of over 1 ms between steps "
              f"({1e3 * long_gaps.sum():.0f} ms); {running.mean():.0f} sequences a step; "
              f"{1e3 * (end_s - self.start_s - starts[-1]):.0f} ms after the last step's start", flush=True)


def make_llm(args: argparse.Namespace) -> LLM:
    """The LLM both runs use: with --backend, random weights of --dummy-weights on that backend (its graphs
    captured before the runs); else the 1B's shapes with the model left out (InstantBackend, or DeviceLikeBackend
    with --device-us)."""
    if args.backend:
        llm = bench_llm(None, args.dummy_weights, ["J1"], backend=args.backend, max_num_seqs=args.max_num_seqs)
        llm.backend.finish_startup()
        return llm
    # the one place the model is left out
    tinyvllm.llm.create_backend = InstantBackend if args.device_us is None else \
        (lambda model, config: DeviceLikeBackend(model, config, args.device_us * 1e-6))
    config = llama_3_2_1b_config()
    model = LoadedModel(config, {}, text_tokenizer(config.vocab_size), "dummy:llama-3.2-1b")
    return LLM(model, max_num_seqs=args.max_num_seqs, max_model_len=4096)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--stop", help="a stop string on every row")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--device-us", type=float, help="device time per sequence of a step (default: none)")
    parser.add_argument("--prepare-workers", type=int, choices=(0, 1), help="the job's prepare_workers "
                        "(default: the job's default)")
    parser.add_argument("--timeline", action="store_true", help="where each run's wall goes, by engine step")
    parser.add_argument("--backend", choices=("numpy", "cuda"), help="a real backend on random weights of "
                        "--dummy-weights instead of a stand-in for the model (default: none)")
    parser.add_argument("--dummy-weights", default="smollm2-135m", help="the preset --backend runs")
    args = parser.parse_args(argv)
    if args.backend and args.device_us is not None:
        parser.error("--device-us stands in for a device: not with --backend")
    return args


def time_the_phases() -> None:
    """Wrap each phase of the job path (timed())."""
    for name in ("apply_chat_template", "encode_prompts"):
        timed(Tokenizer, name)
    timed(_ByteDetokenizer, "add", "detokenize (incremental, stop strings: byte table)")
    timed(_WindowDetokenizer, "add", "detokenize (incremental, stop strings: tokenizer window)")
    timed(output_module, "decode_continuations", "detokenize (once, at the end, a batch a step)")
    timed(job_run, "prepare_request", "prepare_request (overrides, chat template)")
    timed(job_run, "output_record", "output_record")
    timed(readers, "_jsonl_records", "read + json.loads")
    timed(readers, "_rows", "read + parse rows (all)")
    timed(writer.PartsWriter, "_start_commit", "Parquet commit: hand over (guard)")
    timed(writer.PartsWriter, "_commit_piece", COMMIT)
    timed(writer.PartsWriter, "finalize", "finalize (merge pieces into the output)")
    timed(LLMEngine, "add_request", "engine.add_request (tokenize inside)")
    timed(LLMEngine, "step", "engine.step (detokenize at the end inside)")
    timed(job_run.RowPipeline, "_produce", PRODUCER)


def report(num_rows: int, wall: float, job_cpu: float, summary: dict, engine: dict, engine_cpu: float) -> None:
    """The job's wall and CPU against the engine's, per row, and each phase's CPU (TOTAL)."""
    finalize = TOTAL["finalize (merge pieces into the output)"]
    print(f"job, text rows:    {wall:.2f} s = {1e6 * wall / num_rows:.0f} us/row ({summary['output_tokens']} tokens), "
          f"of which finalize {finalize:.2f} s; main thread CPU {1e6 * job_cpu / num_rows:.0f} us/row")
    print(f"main thread CPU, job - engine, to the last commit: {1e6 * (job_cpu - finalize - engine_cpu) / num_rows:.0f}"
          " us/row")
    extra = wall - finalize - engine["wall_s"]
    print(f"job - engine, to the last commit: {1e6 * extra / num_rows:.0f} us/row = "
          f"{1e6 * extra / summary['output_tokens']:.2f} us/output token")
    # What holds the GIL: the engine's thread is the bottleneck on a GPU host, so this adds to the wall there.
    threads = TOTAL[PRODUCER] + TOTAL[COMMIT] + job_cpu - finalize - engine_cpu
    print(f"the job's own CPU in its Python threads (producer + commit + the main thread's extra): "
          f"{1e6 * threads / num_rows:.0f} us/row")
    print("phases of the job path, inclusive CPU time per row, and the threads they ran on:")
    for name, seconds in sorted(TOTAL.items(), key=lambda item: -item[1]):
        print(f"  {name:<45} {1e6 * seconds / num_rows:9.1f} us  {'+'.join(sorted(THREADS[name]))}")


def main() -> None:
    args = parse_args()
    try:
        llm = make_llm(args)
    except ValueError as e:  # an unknown --dummy-weights preset
        sys.exit(f"profile_job.py: {e}")
    model, tokenizer = llm.model, llm.tokenizer
    rows = make_j1_rows(args.rows)
    if args.stop:
        for row in rows:
            row["stop"] = [args.stop]
    requests = [Request(tokenizer.encode_prompt(tokenizer.apply_chat_template(r["messages"]), templated=True),
                        args.max_tokens, {"stop": [args.stop]} if args.stop else {}) for r in rows]
    run_workload(llm, requests[: args.max_num_seqs])  # warm-up
    pa.array([1])  # pyarrow imports pandas at its first list conversion (~0.3 s, once): not part of a row's cost
    reset_prefix_cache = llm.llm_engine.block_manager.reset_prefix_cache  # each run starts cold, as in J1
    reset_prefix_cache()
    timeline = StepTimeline(max(1, int(0.975 * args.max_num_seqs))) if args.timeline else None
    if timeline:
        timeline.start()
    cpu = time.thread_time()
    engine = run_workload(llm, requests)
    engine_cpu = time.thread_time() - cpu
    if timeline:
        timeline.report("engine", time.perf_counter())
    print(f"engine, token ids: {engine['wall_s']:.2f} s = {1e6 * engine['wall_s'] / len(rows):.0f} us/row "
          f"({engine['output_tokens']} tokens); main thread CPU {1e6 * engine_cpu / len(rows):.0f} us/row")

    def run_job(profiler: cProfile.Profile | None = None, instrumented: bool = False) -> tuple[float, float, dict]:
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "j1.jsonl"
            source.write_text("".join(json.dumps(r) + "\n" for r in rows))
            cfg = JobConfig(source, Path(tmp) / "out.parquet", Path(model.source), engine=llm.engine_config,
                            sampling={"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True},
                            quiet=True, prepare_workers=args.prepare_workers)
            reset_prefix_cache()
            if timeline and not instrumented:
                timeline.start()
            start, cpu = time.perf_counter(), time.thread_time()
            if profiler:
                profiler.enable()
            summary = job_run.run_job(cfg, job_run.LocalExecutor(llm))
            if profiler:
                profiler.disable()
            end = time.perf_counter()
            if timeline and not instrumented:
                timeline.report("job", end)
            return end - start, time.thread_time() - cpu, summary

    wall, job_cpu, summary = run_job()  # uninstrumented: the wall
    time_the_phases()
    profiler = cProfile.Profile(time.thread_time) if args.cprofile else None  # the main thread's CPU time
    run_job(profiler, instrumented=True)
    report(len(rows), wall, job_cpu, summary, engine, engine_cpu)
    if profiler:
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
